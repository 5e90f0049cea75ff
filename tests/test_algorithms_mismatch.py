"""Train–inference mismatch: metrics, vanilla TIS and MIS vs float64 references; no gradient; veto; global
batch normalisation; slime defaults."""

import itertools
import math

import pytest
import torch

from rlbench.algorithms import (
    LossConfig,
    MISConfig,
    compute_is_weights,
    mis_weights,
    mismatch_metrics,
    vanilla_tis,
)
from rlbench.algorithms.aggregation import seq_ids_from_lengths

D = torch.float64
LENGTHS = [4, 1, 6, 3, 5, 2]
SEQ = seq_ids_from_lengths(LENGTHS)
N = len(LENGTHS)


def _data(seed=0, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    R = sum(LENGTHS)
    rollout = -torch.rand(R, generator=g, dtype=D) * 3
    old = rollout + scale * torch.randn(R, generator=g, dtype=D)
    mask = (torch.rand(R, generator=g) > 0.2).to(D)
    return old, rollout, mask


def _seqs():
    s = 0
    for n in LENGTHS:
        yield range(s, s + n)
        s += n


def test_mismatch_metrics_reference():
    old, roll, mask = _data()
    got = mismatch_metrics(old, roll, mask, SEQ, N)
    for idx in _seqs():
        msum = max(1.0, sum(mask[i].item() for i in idx))
        tlp = -sum(old[i].item() * mask[i].item() for i in idx) / msum
        rlp = -sum(roll[i].item() * mask[i].item() for i in idx) / msum
        slr = sum((old[i] - roll[i]).item() * mask[i].item() for i in idx)
        for i in idx:
            d = (old[i] - roll[i]).item()
            exp = {
                "train_rollout_logprob_abs_diff": abs(d), "mismatch_kl": -d, "mismatch_k3_kl": math.exp(d) - 1 - d,
                "mismatch_training_log_ppl": tlp, "mismatch_rollout_log_ppl": rlp,
                "mismatch_training_ppl": math.exp(tlp), "mismatch_rollout_ppl": math.exp(rlp),
                "mismatch_log_ppl_diff": tlp - rlp, "mismatch_log_ppl_abs_diff": abs(tlp - rlp),
                "mismatch_ppl_ratio": math.exp(tlp - rlp), "mismatch_chi2_token": math.exp(2 * d) - 1,
                "mismatch_chi2_seq": math.exp(2 * slr) - 1,
            }
            for k, v in exp.items():
                assert abs(got[k][i].item() - v) < 1e-9 * max(1.0, abs(v)), k


def test_vanilla_tis_reference_and_no_grad():
    old, roll, mask = _data()
    old = old.clone().requires_grad_()
    res = vanilla_tis(old, roll, mask, SEQ, N, 0.1, 2.0)
    w = torch.exp(old.detach() - roll)
    assert not res.weights.requires_grad and res.weights.grad_fn is None
    torch.testing.assert_close(res.weights, w.clamp(0.1, 2.0), rtol=0, atol=0)
    torch.testing.assert_close(res.metrics["tis_clipfrac"], ((w < 0.1) | (w > 2.0)).to(D), rtol=0, atol=0)
    torch.testing.assert_close(res.metrics["tis_abs"], (w - 1).abs(), rtol=0, atol=0)


def _mis_ref(old, roll, mask, c: MISConfig):
    """Per-token weights of slime's mis.py, written per sequence with python floats (global batch norm)."""
    def level(idx, lvl):
        d = [(old[i] - roll[i]).item() for i in idx]
        m = [mask[i].item() for i in idx]
        if lvl == "token":
            vals = d
        elif lvl == "sequence":
            vals = [sum(a * b for a, b in zip(d, m))] * len(d)
        else:
            vals = [sum(a * b for a, b in zip(d, m)) / max(1.0, sum(m))] * len(d)
        return [math.exp(max(-20, min(20, v))) for v in vals]

    w, keep = [], []
    for idx in _seqs():
        wi, ki = level(idx, c.tis_level), [1.0] * len(idx)
        if c.tis_mode == "truncate":
            wi = [min(x, c.tis_upper_bound) for x in wi]
        elif c.tis_mode == "clip":
            wi = [min(max(x, c.tis_lower_bound), c.tis_upper_bound) for x in wi]
        else:
            ki = [k * float(c.tis_lower_bound <= x <= c.tis_upper_bound) for k, x in zip(ki, wi)]
        if c.use_rs:
            ki = [k * float(c.rs_lower_bound <= x <= c.rs_upper_bound) for k, x in zip(ki, level(idx, c.rs_level))]
            if any((old[i] - roll[i]).item() < math.log(c.rs_veto_threshold) and mask[i] > 0 for i in idx):
                ki = [0.0] * len(idx)
        w.append([a * b for a, b in zip(wi, ki)])
        keep.append(ki)
    if c.tis_batch_normalize:
        if c.tis_level == "token":
            em = [[k * mask[i].item() for k, i in zip(ks, idx)] for ks, idx in zip(keep, _seqs())]
            mean = sum(a * b for ws, ms in zip(w, em) for a, b in zip(ws, ms)) / max(1.0, sum(map(sum, em)))
        else:
            means = []
            for ws, ks, idx in zip(w, keep, _seqs()):
                em = [k * mask[i].item() for k, i in zip(ks, idx)]
                if sum(em) > 0:
                    means.append(sum(a * b for a, b in zip(ws, em)) / sum(em))
            mean = sum(means) / max(1, len(means))
        w = [[x / mean for x in ws] for ws in w] if mean > 1e-8 else w
    return torch.tensor([x for ws in w for x in ws], dtype=D)


@pytest.mark.parametrize(
    "level,rs_level,mode", list(itertools.product(["token", "sequence"], ["token", "geometric"], ["truncate", "clip", "mask"]))
)
def test_mis_weights_match_reference(level, rs_level, mode):
    old, roll, mask = _data(1, scale=0.5)
    old[7] = roll[7] + math.log(1e-5)  # one catastrophic token: its sequence is vetoed
    c = MISConfig(tis_level=level, rs_level=rs_level, tis_mode=mode, rs_lower_bound=0.3, rs_upper_bound=3.0)
    res = mis_weights(old.clone().requires_grad_(), roll, mask, SEQ, N, c)
    assert res.weights.grad_fn is None and not res.weights.requires_grad
    torch.testing.assert_close(res.weights, _mis_ref(old, roll, mask, c), rtol=1e-12, atol=1e-12)


def test_mis_veto_masks_whole_sequence():
    old, roll, mask = _data(2, scale=0.05)
    mask[:] = 1.0
    s = sum(LENGTHS[:2])  # third sequence starts here
    old[s + 2] = roll[s + 2] + math.log(5e-5)
    res = mis_weights(old, roll, mask, SEQ, N, MISConfig())
    assert torch.all(res.weights[s : s + LENGTHS[2]] == 0)
    assert torch.all(res.weights[:s] > 0) and torch.all(res.weights[s + LENGTHS[2] :] > 0)
    assert res.metrics["mis_rs_catastrophic_seq_fraction"][s : s + LENGTHS[2]].eq(1).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_batch_norm_spans_the_global_batch(level):
    """Two simulated DP ranks with summed stats give exactly the weights of one pass over the whole batch."""
    old, roll, mask = _data(3)
    c = MISConfig(tis_level=level)
    full = mis_weights(old, roll, mask, SEQ, N, c)
    cut = sum(LENGTHS[:3])
    parts = [(slice(0, cut), LENGTHS[:3]), (slice(cut, None), LENGTHS[3:])]
    local = [mis_weights(old[s], roll[s], mask[s], seq_ids_from_lengths(ls), len(ls), c) for s, ls in parts]
    total = local[0].batch_stats + local[1].batch_stats
    again = [mis_weights(old[s], roll[s], mask[s], seq_ids_from_lengths(ls), len(ls), c, total) for s, ls in parts]
    torch.testing.assert_close(torch.cat([r.weights for r in again]), full.weights, rtol=1e-14, atol=0)
    assert not torch.allclose(torch.cat([r.weights for r in local]), full.weights)  # per-part norm differs


def test_modes_standard_bypass_decoupled():
    old, roll, mask = _data()
    std = compute_is_weights(LossConfig(), old, roll, mask, SEQ, N)
    assert std.weights is None and "train_rollout_logprob_abs_diff" in std.metrics
    byp = compute_is_weights(LossConfig(use_rollout_logprobs=True), None, roll, mask, SEQ, N)
    assert byp.weights is None and not byp.metrics
    dec = compute_is_weights(LossConfig(use_tis=True), old, roll, mask, SEQ, N)
    torch.testing.assert_close(dec.weights, torch.exp(old - roll).clamp(0.0, 2.0), rtol=0, atol=0)
    mis = compute_is_weights(LossConfig(use_tis=True, mis=MISConfig()), old, roll, mask, SEQ, N)
    assert "mis_batch_norm_factor" in mis.metrics and "mismatch_kl" in mis.metrics
    with pytest.raises(ValueError, match="use_tis=True needs"):
        compute_is_weights(LossConfig(use_tis=True), old, None, mask, SEQ, N)


def test_mis_defaults_match_slime_yaml():
    c = MISConfig()
    assert (c.use_tis, c.use_rs, c.tis_level, c.rs_level, c.tis_mode) == (True, True, "token", "token", "truncate")
    assert (c.tis_lower_bound, c.tis_upper_bound, c.rs_lower_bound, c.rs_upper_bound) == (0.5, 2.0, 0.5, 2.0)
    assert (c.rs_veto_threshold, c.tis_batch_normalize) == (1e-4, True)
    assert MISConfig(tis_lower_bound=None, tis_upper_bound=4.0).tis_lower_bound == 0.25
    with pytest.raises(ValueError, match="geometric"):
        MISConfig(tis_level="geometric")
    with pytest.raises(ValueError, match="use_tis=True"):
        LossConfig(mis=MISConfig())
