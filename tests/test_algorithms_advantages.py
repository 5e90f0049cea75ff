"""Advantage estimators vs float64 python-loop references written from the formulas."""

import math

import pytest
import torch

from rlbench.algorithms import (
    LossConfig,
    compute_advantages,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)

D = torch.float64
G = torch.Generator().manual_seed(0)
REWARDS = torch.randn(12, generator=G, dtype=D)
LENGTHS = [3, 1, 5, 2, 4, 6, 2, 3, 1, 4, 5, 2]
MASK = (torch.rand(sum(LENGTHS), generator=G) > 0.25).to(D)
KL = torch.randn(sum(LENGTHS), generator=G, dtype=D)


def _groups(r, n):
    return [r[i : i + n].tolist() for i in range(0, len(r), n)]


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize("n", [1, 3, 4])
def test_grpo_and_dr_grpo(n):
    exp, exp_dr = [], []
    for grp in _groups(REWARDS, n):
        for x in grp:
            exp_dr.append(x - _mean(grp))
            exp.append((x - _mean(grp)) / (_std(grp) + 1e-6) if n > 1 else x - _mean(grp))
    torch.testing.assert_close(grpo_advantages(REWARDS, n), torch.tensor(exp, dtype=D), rtol=0, atol=1e-12)
    torch.testing.assert_close(dr_grpo_advantages(REWARDS, n), torch.tensor(exp_dr, dtype=D), rtol=0, atol=1e-12)


def test_group_size_mismatch_raises_instead_of_one_big_group():
    with pytest.raises(ValueError, match="group_size=5"):
        grpo_advantages(REWARDS, 5)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(REWARDS, 5)


def test_rloo():
    exp = [x - (sum(g) - x) / (len(g) - 1) for g in _groups(REWARDS, 4) for x in g]
    torch.testing.assert_close(rloo_advantages(REWARDS, 4), torch.tensor(exp, dtype=D), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="RLOO"):
        rloo_advantages(REWARDS, 1)


def _ref_shaped(kl_coef):
    out, s = [], 0
    for i, n in enumerate(LENGTHS):
        m = MASK[s : s + n].tolist()
        tok = [-kl_coef * KL[s + t].item() * m[t] for t in range(n)]
        last = max([t for t in range(n) if m[t] > 0], default=n - 1)
        tok[last] += REWARDS[i].item()
        out.append(tok)
        s += n
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_discounted_shaped_returns(gamma):
    exp = []
    for tok, m in zip(_ref_shaped(0.05), torch.split(MASK, LENGTHS)):  # masked tokens are not time steps
        g, ret = 0.0, []
        for r, mt in zip(reversed(tok), reversed(m.tolist())):
            g = r + gamma * g if mt else g
            ret.append(g if mt else 0.0)
        exp += ret[::-1]
    got = reinforce_pp_advantages(REWARDS, LENGTHS, MASK, KL, 0.05, gamma)
    torch.testing.assert_close(got, torch.tensor(exp, dtype=D), rtol=0, atol=1e-12)


def test_reinforce_pp_baseline():
    base = [x - _mean(g) for g in _groups(REWARDS, 4) for x in g]
    exp = [base[i] - 0.1 * KL[sum(LENGTHS[:i]) + t].item() for i, n in enumerate(LENGTHS) for t in range(n)]
    got = reinforce_pp_baseline_advantages(REWARDS, 4, LENGTHS, KL, 0.1)
    torch.testing.assert_close(got, torch.tensor(exp, dtype=D), rtol=0, atol=1e-12)


def test_gae_matches_loop():
    B, L = 3, 6
    r, v = torch.randn(B, L, generator=G, dtype=D), torch.randn(B, L, generator=G, dtype=D)
    lens = [6, 4, 1]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(L)] for n in lens], dtype=D)
    adv, ret = gae(r * mask, v, mask, 0.95, 0.9)
    for b, n in enumerate(lens):
        a_next = 0.0
        for t in reversed(range(n)):
            v_next = v[b, t + 1].item() if t + 1 < n else 0.0
            delta = r[b, t].item() + 0.95 * v_next - v[b, t].item()
            a_next = delta + 0.95 * 0.9 * a_next
            assert abs(adv[b, t].item() - a_next) < 1e-12
            assert abs(ret[b, t].item() - (a_next + v[b, t].item())) < 1e-12
        assert adv[b, n:].abs().sum() == 0 and torch.equal(ret[b, n:], v[b, n:])  # padding: A = 0, ret = A + V


def test_whiten_masked_unbiased():
    x = torch.randn(sum(LENGTHS), generator=G, dtype=D)
    sel = x[MASK > 0].tolist()
    m, s = _mean(sel), _std(sel)
    exp = (x - m) / math.sqrt(s * s + 1e-8)
    torch.testing.assert_close(whiten(x, MASK), exp, rtol=0, atol=1e-12)
    out = whiten(x, MASK)[MASK > 0]
    assert abs(out.mean().item()) < 1e-12


def test_compute_advantages_dispatch_and_shaping():
    old, ref = torch.randn(sum(LENGTHS), generator=G, dtype=D), torch.randn(sum(LENGTHS), generator=G, dtype=D)
    cfg = LossConfig(advantage_estimator="grpo")
    got = compute_advantages(cfg, REWARDS, LENGTHS, MASK, group_size=4)
    exp = torch.repeat_interleave(grpo_advantages(REWARDS, 4), torch.tensor(LENGTHS))
    assert torch.equal(got, exp)
    cfg = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.1, gamma=0.9)
    got = compute_advantages(cfg, REWARDS, LENGTHS, MASK, group_size=4, old_log_probs=old, ref_log_probs=ref)
    raw = reinforce_pp_advantages(REWARDS, LENGTHS, MASK, old - ref, 0.1, 0.9)  # k1 KL = old − ref
    torch.testing.assert_close(got, whiten(raw, MASK), rtol=0, atol=1e-12)
    cfg = LossConfig(advantage_estimator="gae", gamma=0.9, lambd=0.8)
    values = torch.randn(sum(LENGTHS), generator=G, dtype=D)
    got = compute_advantages(cfg, REWARDS, LENGTHS, MASK, group_size=4, values=values)
    # last sample alone: GAE by hand
    n, s = LENGTHS[-1], sum(LENGTHS[:-1])
    tok = [0.0] * n
    tok[max(t for t in range(n) if MASK[s + t] > 0) if MASK[s : s + n].sum() > 0 else n - 1] += REWARDS[-1].item()
    a, exp_last = 0.0, []
    for t in reversed(range(n)):
        vn = values[s + t + 1].item() if t + 1 < n else 0.0
        a = tok[t] + 0.9 * vn - values[s + t].item() + 0.9 * 0.8 * a
        exp_last.append(a)
    torch.testing.assert_close(got[s:], torch.tensor(exp_last[::-1], dtype=D), rtol=0, atol=1e-12)


def test_config_rules_for_estimators():
    with pytest.raises(ValueError, match="normalize_advantages"):
        LossConfig(advantage_estimator="reinforce_plus_plus")
    with pytest.raises(ValueError, match="no effect"):
        LossConfig(advantage_estimator="grpo", kl_coef=0.1)
    with pytest.raises(ValueError, match="cannot both"):
        LossConfig(advantage_estimator="gae", kl_coef=0.1, use_kl_loss=True, kl_loss_coef=0.1)
    assert LossConfig(advantage_estimator="gspo").policy_loss == "gspo"
