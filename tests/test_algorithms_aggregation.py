"""Aggregation weights vs the formulas; GlobalNorm counts, combine and validation; segment helpers."""

import pytest
import torch

from rlbench.algorithms import GlobalNorm, loss_token_weights
from rlbench.algorithms.aggregation import segment_masked_mean, seq_ids_from_lengths

D = torch.float64
LENGTHS = [3, 0, 5, 2]
MASK = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1, 0, 0], dtype=D)  # the last sample has no trained token


def test_weights_match_formulas():
    norm = GlobalNorm(n_samples=10, n_tokens=40.0, constant=7.0)  # a larger global batch than this micro-batch
    sm = loss_token_weights(MASK, LENGTHS, "sample_mean", norm)
    exp, s = [], 0
    for n in LENGTHS:
        k = sum(MASK[s : s + n].tolist())
        exp += [MASK[i].item() / (max(1.0, k) * 10) for i in range(s, s + n)]
        s += n
    torch.testing.assert_close(sm, torch.tensor(exp, dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(loss_token_weights(MASK, LENGTHS, "token_mean", norm), MASK / 40.0, rtol=0, atol=0)
    torch.testing.assert_close(loss_token_weights(MASK, LENGTHS, "seq_sum_constant", norm), MASK / 70.0, rtol=0, atol=0)
    assert sm.dtype == D and loss_token_weights(MASK.float(), LENGTHS, "token_mean", norm).dtype == torch.float32


def test_weights_sum_to_one_over_the_global_batch():
    masks = [MASK, torch.ones(4, dtype=D)]
    lengths = [LENGTHS, [1, 3]]
    norm = GlobalNorm.from_masks(masks, lengths)
    assert (norm.n_samples, norm.n_tokens) == (6, 10.0)
    for mode in ("sample_mean", "token_mean"):
        total = sum(loss_token_weights(m, ls, mode, norm).sum() for m, ls in zip(masks, lengths))
        # sample_mean: the 2 samples without trained tokens contribute 0 but still count as samples
        assert abs(total.item() - (4 / 6 if mode == "sample_mean" else 1.0)) < 1e-15


def test_global_norm_combine_and_validation():
    a, b = GlobalNorm(3, 10.0, 4.0), GlobalNorm(5, 2.0, 4.0)
    assert GlobalNorm.combine([a, b]) == GlobalNorm(8, 12.0, 4.0)
    with pytest.raises(ValueError, match="constants differ"):
        GlobalNorm.combine([a, GlobalNorm(1, 1.0, 2.0)])
    with pytest.raises(ValueError, match="n_samples=0"):
        GlobalNorm(0, 0.0)
    with pytest.raises(ValueError, match="loss_aggregation='bad'"):
        loss_token_weights(MASK, LENGTHS, "bad", a)
    with pytest.raises(ValueError, match="sum to"):
        loss_token_weights(MASK, [3, 5], "token_mean", a)


def test_segment_masked_mean():
    x = torch.arange(10, dtype=D)
    got = segment_masked_mean(x, MASK, seq_ids_from_lengths(LENGTHS), len(LENGTHS))
    torch.testing.assert_close(got, torch.tensor([(0 + 2) / 2, 0.0, (3 + 4 + 6 + 7) / 4, 0.0], dtype=D))
