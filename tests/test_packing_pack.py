"""Pack / unpack (rlbench.packing.pack) and PackingReport."""

import random

import pytest
import torch

from rlbench.packing import (
    PackingReport,
    bucket_length,
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


def test_bucket_ladder():
    """128-multiples up to 1024, then 8 lengths per doubling (< 1/8 padding), capped at the budget."""
    assert [bucket_length(n) for n in (0, 1, 128, 129, 1024, 1025, 1153, 2048, 2049, 4097)] == \
        [128, 128, 128, 256, 1024, 1152, 1280, 2048, 2304, 4608]
    assert max((bucket_length(n) - n) / n for n in range(1025, 40_000)) < 1 / 8
    lengths = {bucket_length(n, 16384) for n in range(1, 16385)}
    assert len(lengths) == 8 + 8 * 4 and max(lengths) == 16384  # a 16k budget: 40 shapes
    assert {bucket_length(n, 1000, 8) for n in range(1, 1001)} == {128, 256, 384, 512, 640, 768, 896, 1000}
    assert bucket_length(100, multiple=48) == 144  # CP alignment (2*cp) is kept
    with pytest.raises(ValueError, match="over its budget"):
        bucket_length(1001, 1000)


def test_bucketed_packs_only_lengthen_the_trailing_pad():
    """bucket=True: same sequences, slots and response arrays; T = bucket_length(slot tokens) <= budget, the
    extra tokens are the trailing pad pseudo-sequence (positions 0, 1, ...)."""
    rng = random.Random(2)
    for _ in range(200):
        samples = [_sample(rng, i, max_len=rng.choice([40, 400])) for i in range(rng.randint(1, 12))]
        align = rng.choice([1, 4])
        slots = [round_up(s.total_length, align) for s in samples]
        budget = round_up(max(slots), align) + rng.randint(0, 600)
        plain = make_step_packs(samples, None, budget, align, seq_align=align)
        packs = make_step_packs(samples, None, budget, align, seq_align=align, bucket=True)
        assert len(packs) == len(plain)
        for b, p in zip(packs, plain):
            used = int(p.cu_seqlens[-1])
            assert b.num_tokens == bucket_length(used, budget // align * align, align) <= budget
            assert b.sample_ids == p.sample_ids and torch.equal(b.cu_seqlens, p.cu_seqlens)
            assert torch.equal(b.tokens[:used], p.tokens[:used]) and torch.equal(b.response_index, p.response_index)
            assert torch.equal(b.position_ids[:used], p.position_ids[:used])
            assert b.position_ids[used:].tolist() == list(range(b.pad_length))
            assert (b.tokens[used:] == b.pad_token_id).all()
            for name in ("loss_mask", "advantages", "rollout_log_probs"):
                assert torch.equal(getattr(b, name), getattr(p, name)), name
    empty = make_step_packs([], 2, 1000, bucket=True)
    assert [p.num_tokens for p in empty] == [128, 128] and all(p.num_sequences == 0 for p in empty)


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


def _reference_pack(samples, ids, pad_multiple, seq_align, pad_token_id, extras):
    """The layout spelled out token by token (Python lists, one torch.tensor per field at the end)."""
    tokens, positions, cu, resp_index = [], [], [0], []
    resp = {"loss_mask": [], "advantages": [], "rollout_log_probs": [], **{k: [] for k in extras}}
    for i in ids:
        s, start = samples[i], len(tokens)
        slot = round_up(s.total_length, seq_align)
        tokens += s.tokens + [pad_token_id] * (slot - s.total_length)
        positions += list(range(slot))
        cu.append(len(tokens))
        resp_index += [start + s.prompt_length - 1 + k for k in range(s.response_length)]
        resp["loss_mask"] += s.loss_mask
        resp["advantages"] += s.token_advantages or [s.advantage or 0.0] * s.response_length
        resp["rollout_log_probs"] += s.rollout_log_probs or []
        for k in extras:
            resp[k] += extras[k][i][: s.response_length]
    pad = round_up(len(tokens), pad_multiple) - len(tokens) if ids else pad_multiple
    f32 = {k: torch.tensor(v, dtype=torch.float32) for k, v in resp.items()}
    logps = f32.pop("rollout_log_probs")
    return {
        "tokens": torch.tensor(tokens + [pad_token_id] * pad, dtype=torch.long),
        "position_ids": torch.tensor(positions + list(range(pad)), dtype=torch.long),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "seq_lengths": torch.tensor([samples[i].total_length for i in ids], dtype=torch.long),
        "response_lengths": [samples[i].response_length for i in ids],
        "response_index": torch.tensor(resp_index, dtype=torch.long),
        "pad_length": pad, "sample_ids": list(ids),
        "loss_mask": f32.pop("loss_mask"), "advantages": f32.pop("advantages"),
        "rollout_log_probs": logps if ids and samples[ids[0]].rollout_log_probs is not None else None,
        "extras": f32 if ids else {},
    }


def _varied_sample(rng, with_logps):
    """Scalar or per-token advantages, default / 0-1 / bool loss masks, token ids beyond int32."""
    prompt, n = rng.randint(1, 15), rng.randint(0, 15)
    kind = rng.randint(0, 3)
    return Sample(
        tokens=[rng.randint(0, 2**40) for _ in range(prompt + n)], response_length=n,
        loss_mask=None if kind == 0 else [rng.choice([0, 1, True, 1.0]) for _ in range(n)],
        rollout_log_probs=[rng.uniform(-30, 0) for _ in range(n)] if with_logps else None,
        advantage=rng.choice([None, rng.gauss(0, 1), 3]),
        token_advantages=[rng.gauss(0, 1e3) for _ in range(n)] if kind >= 2 else None,
    )


def test_vectorised_builder_matches_reference_exactly():
    """Every Pack field equals the token-by-token reference: same dtype, same bits (float64 inputs
    rounded to float32 once), for permuted/partial/empty index lists, alignment and trailing pad."""
    rng = random.Random(7)
    for _ in range(300):
        samples = [_varied_sample(rng, with_logps=rng.random() < 0.5) for _ in range(rng.randint(0, 8))]
        for s in samples[1:]:
            s.rollout_log_probs = None if samples[0].rollout_log_probs is None else [-1.5] * s.response_length
        extras = {"ref": [[rng.gauss(0, 1) for _ in range(s.response_length + rng.randint(0, 2))] for s in samples]}
        kw = {"pad_multiple": rng.choice([1, 3, 8]), "seq_align": rng.choice([1, 2, 4]),
              "pad_token_id": rng.randint(0, 9), "extras": extras if rng.random() < 0.5 else {}}
        ids = rng.sample(range(len(samples)), rng.randint(0, len(samples)))
        got, want = pack_samples(samples, ids, **kw), _reference_pack(samples, ids, **kw)
        for name, w in want.items():
            g = getattr(got, name)
            if isinstance(w, torch.Tensor):
                assert g.dtype == w.dtype and torch.equal(g, w), name
            elif isinstance(w, dict):
                assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), name
            else:
                assert g == w, name
