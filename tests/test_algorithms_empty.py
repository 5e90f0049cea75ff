"""Empty rows and (nearly) empty masks, each against a float64 reference written here:

1. The per-sequence mismatch metrics (training / rollout PPL, PPL ratio and their logs) are a mean over the rows
   with a trained token: on eight rows with one empty, whatever the split into micro-batches, the aggregation and
   whether π_old is the training forward. A norm or loss inputs that lack the non-empty count are refused, never
   averaged over all rows (which deflates the mean by 7/8).
2. `whiten` with fewer than two trained tokens has no variance to scale by: zeros (the centred value), not
   x / sqrt(1e-8).
"""

import math

import pytest
import torch

from rlbench.algorithms import (
    GlobalNorm,
    LossConfig,
    LossInputs,
    ResponseBatch,
    build_loss,
    build_loss_inputs,
    compute_advantages,
    compute_is_weights,
    global_norm,
    loss_token_weights,
    whiten,
)
from rlbench.algorithms.aggregation import seq_ids_from_lengths

D = torch.float64
LENGTHS = [3, 5, 2, 4, 6, 3, 2, 4]
EMPTY = 5  # the row with no trained token
PPL_KEYS = ("mismatch_training_ppl", "mismatch_rollout_ppl", "mismatch_ppl_ratio", "mismatch_training_log_ppl",
            "mismatch_rollout_log_ppl", "mismatch_log_ppl_diff")


def _rows():
    g = torch.Generator().manual_seed(46)
    rows = []
    for i, n in enumerate(LENGTHS):
        roll = -torch.rand(n, generator=g, dtype=D) * 3
        old = roll + 0.4 * torch.randn(n, generator=g, dtype=D)
        mask = torch.ones(n, dtype=D)
        if i == EMPTY:
            mask[:] = 0
        elif n > 3:
            mask[1] = 0  # a masked token inside a trained row
        rows.append((old, roll, mask))
    return rows


def _reference(rows) -> dict[str, float]:
    """Python floats: each row's masked-mean log-PPL, averaged over the rows with a trained token."""
    per = []
    for old, roll, mask in rows:
        o, r, m = old.tolist(), roll.tolist(), mask.tolist()
        if sum(m) == 0:
            continue
        tlp = -math.fsum(x * k for x, k in zip(o, m)) / sum(m)
        rlp = -math.fsum(x * k for x, k in zip(r, m)) / sum(m)
        per.append([math.exp(tlp), math.exp(rlp), math.exp(tlp - rlp), tlp, rlp, tlp - rlp])
    assert len(per) == len(rows) - 1
    return {k: math.fsum(p[i] for p in per) / len(per) for i, k in enumerate(PPL_KEYS)}


def _micro_batches(rows, split, with_old: bool):
    out, s = [], 0
    for k in split:
        part = rows[s : s + k]
        s += k
        old, roll, mask = (torch.cat([r[j] for r in part]) for j in range(3))
        out.append(ResponseBatch(loss_mask=mask, advantages=torch.zeros_like(mask),
                                 response_lengths=[len(r[0]) for r in part],
                                 old_log_probs=old if with_old else None, rollout_log_probs=roll))
    return out


@pytest.mark.parametrize("from_forward", [False, True], ids=["recomputed old", "old = training forward"])
@pytest.mark.parametrize("split", [[8], [3, 3, 2], [1] * 8], ids=["one mb", "three mbs", "eight mbs"])
@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean", "seq_sum_constant"])
def test_per_sequence_ppl_metrics_exclude_the_empty_row(aggregation, split, from_forward):
    rows = _rows()
    cfg = LossConfig(loss_aggregation=aggregation, loss_aggregation_constant=6.0)
    mbs = _micro_batches(rows, split, with_old=not from_forward)
    norm = GlobalNorm.combine([global_norm(cfg, [mb]) for mb in mbs])  # counted per micro-batch, then summed
    assert norm.n_nonempty == 7 and norm.n_samples == 8
    got = dict.fromkeys(PPL_KEYS, 0.0)
    loss_fn = build_loss(cfg)
    olds = [mb.old_log_probs for mb in _micro_batches(rows, split, with_old=True)]  # also the current log-probs
    for old, inputs in zip(olds, build_loss_inputs(cfg, mbs, norm=norm, old_from_forward=from_forward)):
        _, metrics = loss_fn(old.clone(), None, inputs)
        for k in PPL_KEYS:
            got[k] += metrics[k].item()
    want = _reference(rows)
    for k in PPL_KEYS:
        assert abs(got[k] - want[k]) <= 1e-12 * max(1.0, abs(want[k])), (k, got[k], want[k])
    # the bug this guards against: the same sum over 8 rows instead of 7 (12.5 % low), well outside the tolerance
    assert abs(got["mismatch_training_ppl"] - want["mismatch_training_ppl"] * 7 / 8) > 0.1


def test_a_norm_or_inputs_without_the_non_empty_count_are_refused():
    rows = _rows()
    cfg = LossConfig()
    mbs = _micro_batches(rows, [8], with_old=True)
    n_tokens = float(sum(r[2].sum() for r in rows))
    with pytest.raises(ValueError, match=r"no n_nonempty, the denominator of per-sequence metrics"):
        build_loss_inputs(cfg, mbs, norm=GlobalNorm(8, n_tokens))  # counted by hand, the empty row included
    mb = mbs[0]
    diag = compute_is_weights(cfg, mb.old_log_probs, mb.rollout_log_probs, mb.loss_mask,
                              seq_ids_from_lengths(LENGTHS), len(LENGTHS)).metrics
    weights = loss_token_weights(mb.loss_mask, LENGTHS, "sample_mean", GlobalNorm(8, n_tokens))
    inputs = LossInputs(mb.old_log_probs, mb.advantages, mb.loss_mask, weights, LENGTHS, token_metrics=diag)
    with pytest.raises(ValueError, match=r"per-sequence metric 'mismatch_.*' but LossInputs.seq_metric_weights"):
        build_loss(cfg)(mb.old_log_probs.clone(), None, inputs)


def test_whiten_with_no_trained_token_returns_zeros():
    x = torch.tensor([5.0, -3.0, 2.0, float("nan")], dtype=D)  # a NaN on an untrained token changes nothing
    mask = torch.zeros(4, dtype=D)
    assert torch.equal(whiten(x, mask), torch.zeros(4, dtype=D))  # was 5 / sqrt(1e-8) = 50000 (and NaN)
    assert torch.equal(whiten(x, mask, shift_mean=False), torch.zeros(4, dtype=D))


def test_whiten_with_one_trained_token_returns_its_centred_value_zero():
    x = torch.tensor([3.0, -1.0, 7.0], dtype=D)
    mask = torch.tensor([0.0, 1.0, 0.0], dtype=D)
    assert torch.equal(whiten(x, mask), torch.zeros(3, dtype=D))  # was (3 - (-1)) / 1e-4 = 40000 at position 0
    assert torch.equal(whiten(x, mask, shift_mean=False), torch.full((3,), -1.0, dtype=D))  # the mean, unscaled
    # through compute_advantages (REINFORCE++ whitens): one trained token in the step gives a zero advantage
    cfg = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.0)
    adv = compute_advantages(cfg, torch.tensor([1.0, 0.0], dtype=D), [2, 1], torch.tensor([0.0, 1.0, 0.0], dtype=D),
                             group_size=2)
    assert torch.equal(adv, torch.zeros(3, dtype=D))


def test_whiten_with_two_trained_tokens_is_the_formula():
    x = torch.tensor([3.0, -1.0, 7.0], dtype=D)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=D)
    mean, var = 1.0, ((3.0 - 1.0) ** 2 + (-1.0 - 1.0) ** 2) / 1  # unbiased over the two trained tokens
    want = torch.tensor([(v - mean) / math.sqrt(var + 1e-8) for v in x.tolist()], dtype=D)
    torch.testing.assert_close(whiten(x, mask), want, rtol=0, atol=1e-15)
