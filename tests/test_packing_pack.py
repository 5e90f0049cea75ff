"""Pack / unpack (rlbench.packing.pack) and PackingReport."""

import random

import pytest
import torch

from rlbench.packing import (
    PackingReport,
    make_step_packs,
    pack_samples,
    response_values,
    round_up,
    unpack_response,
    unpack_tokens,
)
from rlbench.packing.pack import truncate_sample
from rlbench.types import Sample


def _sample(rng, idx, max_len=40, zero_tail=False):
    prompt = rng.randint(1, max_len // 2)
    resp = rng.randint(0, max_len // 2)
    tokens = [rng.randint(0, 9) for _ in range(prompt + resp)]
    if zero_tail:
        tokens[-1] = 0  # token id 0 is a real token (Qwen: "!"); must never be taken for padding
    return Sample(
        tokens=tokens,
        response_length=resp,
        loss_mask=[rng.randint(0, 1) for _ in range(resp)],
        rollout_log_probs=[-rng.random() for _ in range(resp)],
        token_advantages=[rng.uniform(-1, 1) for _ in range(resp)],
        index=idx,
    )


def test_hand_worked_pack():
    s = [
        Sample(tokens=[5, 6, 7, 8], response_length=2, rollout_log_probs=[-0.5, -0.25], advantage=1.0),
        Sample(tokens=[0, 2, 0], response_length=1, rollout_log_probs=[-2.0], loss_mask=[0]),
    ]
    p = pack_samples(s, [1, 0], pad_multiple=4, extras={"old_log_probs": [[-1.0, -2.0], [-3.0]]})
    assert p.tokens.tolist() == [0, 2, 0, 5, 6, 7, 8, 0]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 7]
    assert p.cu_seqlens_with_pad.tolist() == [0, 3, 7, 8]
    assert p.pad_length == 1 and p.sample_ids == [1, 0] and p.response_lengths == [1, 2]
    # sample 1's response token (position 2) is predicted at 1; sample 0's (7, 8 at 5, 6) at 4, 5
    assert p.response_index.tolist() == [1, 4, 5]
    assert p.loss_mask.tolist() == [0.0, 1.0, 1.0]
    assert p.advantages.tolist() == [0.0, 1.0, 1.0]
    assert p.rollout_log_probs.tolist() == [-2.0, -0.5, -0.25]
    assert p.extras["old_log_probs"].tolist() == [-3.0, -1.0, -2.0]


def test_round_trip_properties_random():
    """Pack -> unpack is exact, response_index points at the predecessors of the response tokens,
    cu_seqlens/positions are consistent, padding is only what alignment requires, budget holds."""
    rng = random.Random(0)
    for case in range(600):
        samples = [_sample(rng, i, zero_tail=case % 3 == 0) for i in range(rng.randint(1, 12))]
        pad_multiple, seq_align = rng.choice([1, 2, 8]), rng.choice([1, 1, 4])
        slots = [round_up(s.total_length, seq_align) for s in samples]
        budget = round_up(max(slots), pad_multiple) + rng.randint(0, 60)
        extras = {"ref_log_probs": [[rng.random() for _ in range(s.response_length)] for s in samples]}
        packs = make_step_packs(samples, None, budget, pad_multiple, seq_align=seq_align, extras=extras)
        assert sorted(i for p in packs for i in p.sample_ids) == list(range(len(samples)))
        for p in packs:
            _check_pack(p, samples, extras, pad_multiple, seq_align)
            assert p.num_tokens <= budget


def _check_pack(p, samples, extras, pad_multiple, seq_align):
    cu, T = p.cu_seqlens, p.num_tokens
    assert cu.dtype == torch.int32 and cu[0] == 0 and int(cu[-1]) + p.pad_length == T
    assert 0 <= p.pad_length < pad_multiple and T % pad_multiple == 0
    assert bool((p.seq_pads >= 0).all()) and bool((p.seq_pads < seq_align).all())
    for j, (tok, i) in enumerate(zip(unpack_tokens(p, p.tokens), p.sample_ids)):
        s = samples[i]
        assert tok.tolist() == s.tokens
        start = int(cu[j])
        assert p.position_ids[start : int(cu[j + 1])].tolist() == list(range(int(cu[j + 1]) - start))
    assert p.position_ids[int(cu[-1]) :].tolist() == list(range(p.pad_length))
    # the position predicting each response token is its predecessor
    assert p.tokens[p.response_index + 1].tolist() == [t for i in p.sample_ids for t in samples[i].response_tokens]
    for name, got in [("loss_mask", p.loss_mask), ("rollout_log_probs", p.rollout_log_probs),
                      ("token_advantages", p.advantages)]:
        for g, i in zip(unpack_response(p, got), p.sample_ids):
            assert g.tolist() == torch.tensor(getattr(samples[i], name), dtype=torch.float32).tolist()
    for g, i in zip(unpack_response(p, p.extras["ref_log_probs"]), p.sample_ids):
        assert g.tolist() == torch.tensor(extras["ref_log_probs"][i], dtype=torch.float32).tolist()


def test_position_space_outputs_map_to_response_tokens():
    rng = random.Random(1)
    samples = [_sample(rng, i) for i in range(5)]
    p = pack_samples(samples, pad_multiple=8)
    logp_t = torch.randn(p.num_tokens, dtype=torch.float64)  # e.g. per-position log-probs
    per_seq = unpack_response(p, response_values(p, logp_t))
    for j, i in enumerate(p.sample_ids):
        start, s = int(p.cu_seqlens[j]), samples[i]
        want = logp_t[start + s.prompt_length - 1 : start + s.total_length - 1]
        assert torch.equal(per_seq[j], want)
    with pytest.raises(ValueError, match="response_values"):
        unpack_response(p, logp_t)


def test_plain_token_lists_and_errors():
    p = pack_samples([[1, 2, 3], [4, 5]])
    assert p.response_lengths == [2, 1] and p.rollout_log_probs is None
    with pytest.raises(ValueError, match="no prompt token"):
        pack_samples([Sample(tokens=[1, 2], response_length=2)])
    mixed = [Sample(tokens=[1, 2], response_length=1, rollout_log_probs=[-1.0]), Sample(tokens=[1, 2], response_length=1)]
    with pytest.raises(ValueError, match="all or none"):
        pack_samples(mixed)


def test_over_budget_raises_or_truncates_and_counts():
    samples = [Sample(tokens=list(range(1, 11)), response_length=6), Sample(tokens=[1, 2, 3], response_length=1),
               Sample(tokens=list(range(1, 31)), response_length=20)]
    with pytest.raises(ValueError, match=r"sequence 2 has 30 tokens.*max_tokens=16"):
        make_step_packs(samples, 2, max_tokens=16)
    packs = make_step_packs(samples, 2, max_tokens=16, truncate=True)
    report = PackingReport.from_packs(packs, max_tokens=16)
    assert report.num_truncated == 1 and max(t + p for t, p in zip(report.tokens, report.padding)) <= 16
    cut = truncate_sample(samples[2], 16)
    assert cut.tokens == list(range(1, 17)) and cut.response_length == 6 and cut.loss_mask == [1] * 6


def test_empty_pack_is_pad_only_and_report_values():
    packs = make_step_packs([[1, 2, 3]], n_micro_batches=2, max_tokens=8, pad_multiple=4)
    assert [p.num_sequences for p in packs] == [1, 0] and packs[1].num_tokens == 4
    assert len(packs[1].response_index) == 0
    r = PackingReport.from_packs(packs, max_tokens=8)
    assert r.tokens == [3, 0] and r.padding == [1, 4] and r.sequences == [1, 0]
    assert r.imbalance == pytest.approx(3 / 1.5) and r.padding_fraction == pytest.approx(5 / 8)
    d = r.to_dict()
    assert d["num_packs"] == 2 and d["max_pack_tokens"] == 4 and d["tokens"] == [3, 0]
