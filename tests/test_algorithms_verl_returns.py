"""GAE, REINFORCE++ returns and KL-in-reward against verl on identical tensors, over a randomized sweep of
multi-turn-shaped batches (loss-masked spans inside responses, masked heads and tails, fully masked rows,
responses cut at the length limit, padding), γ and λ < 1, to 1e-10 in float64 at EVERY position.

The references are independent re-implementations, in python floats, of verl's loops
(verl/trainer/ppo/core_algos.py at verl-project/verl 1dda039, Aug 2026): `compute_gae_advantage_return`
(`nextvalues` / `lastgaelam` carried through observation tokens, returns = A + V, before its whitening),
`compute_reinforce_plus_plus_outcome_advantage` (the running return carried through observation tokens, 0
returned there: verl PR #7300; verl before it, e.g. volcengine/verl b178a3c of Jan 2026, reset the running
return at every masked token, so a reward never reached the turns before a tool output), and the KL penalty of
`apply_kl_penalty` / `kl_penalty` (token_level_rewards = scores − β·kld, kld on π_old vs π_ref times the mask).
"""

import math
import random

import pytest
import torch

from rlbench.algorithms import (
    LossConfig,
    compute_advantages,
    gae,
    reinforce_pp_advantages,
    token_advantages,
    token_advantages_and_returns,
)
from rlbench.algorithms.advantages import discounted_returns, reward_kl, to_tokens
from rlbench.algorithms.kl_control import mean_sequence_kl
from rlbench.configs.loss import ADVANTAGE_ESTIMATORS

D = torch.float64
TOL = 1e-10
GAE = next(name for name in ADVANTAGE_ESTIMATORS if name in ("ppo", "gae"))  # the GAE estimator's config name


# ------------------------------------------------------------------------------------- verl, in python floats
def verl_gae(rewards, values, mask, gamma, lam):
    """One row: compute_gae_advantage_return's loop (advantages before masked_whiten, returns)."""
    nextvalues, lastgaelam, adv = 0.0, 0.0, [0.0] * len(rewards)
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * nextvalues - values[t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[t] * mask[t] + (1 - mask[t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[t] + (1 - mask[t]) * lastgaelam
        adv[t] = lastgaelam
    return adv, [a + v for a, v in zip(adv, values)]


def verl_rpp_returns(rewards, mask, gamma):
    """One row: compute_reinforce_plus_plus_outcome_advantage's returns."""
    running, returns = 0.0, [0.0] * len(rewards)
    for t in reversed(range(len(rewards))):
        new = rewards[t] + gamma * running
        returns[t] = new * mask[t]
        running = new * mask[t] + running * (1 - mask[t])
    return returns


def verl_kld(old, ref, kind):
    """verl's kl_penalty_forward for one token: "kl"/k1, and "low_var_kl" (verl's k3 too)."""
    if kind == "k1":
        return old - ref
    kl = min(max(ref - old, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1, -10.0), 10.0)


# ------------------------------------------------------------------------------------------------ the batches
def _row_mask(rng, n, L):
    """A response of n tokens in a row of L: trained turns with masked (tool output) spans between them."""
    m, t = [], 0
    while t < n:
        span = rng.randint(1, 4)
        m += [1.0 if rng.random() < 0.65 else 0.0] * span
        t += span
    return m[:n] + [0.0] * (L - n)


def _batch(seed, B=6, L=14):
    """Padded [B, L] float64 tensors. Row 0 always has a masked span between two trained tokens, row 1 is cut
    at the length limit (its last position trained: V after it is 0), row 2 is fully masked; rewards and
    values at masked positions and padding are random (verl drops them the same way)."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, L) for _ in range(B)]
    masks = [_row_mask(rng, n, L) for n in lengths]
    masks[0] = [1.0, 1.0, 0.0, 0.0, 1.0] + [1.0 if rng.random() < 0.6 else 0.0 for _ in range(L - 5)]
    lengths[0] = L
    lengths[1], masks[1] = L, _row_mask(rng, L - 1, L)[: L - 1] + [1.0]
    masks[2] = [0.0] * L
    g = torch.Generator().manual_seed(seed)
    return (torch.tensor(masks, dtype=D), torch.randn(B, L, generator=g, dtype=D),
            torch.randn(B, L, generator=g, dtype=D), lengths)


def _flat(x, lengths):
    """`[B, L]` -> `[R]`: each row's response, end to end (how the loop lays samples out)."""
    return torch.cat([x[b, :n] for b, n in enumerate(lengths)])


def _has_inner_span(row):
    on = [t for t, x in enumerate(row) if x]
    return bool(on) and any(x == 0 for x in row[on[0]:on[-1]])


GAMMAS, LAMBDAS, GAE_SEEDS, RPP_SEEDS = (1.0, 0.99, 0.9), (1.0, 0.95, 0.5, 0.0), range(8), range(15)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("lam", LAMBDAS)
def test_gae_equals_verl_at_every_position(gamma, lam):
    for seed in GAE_SEEDS:  # 3 γ × 4 λ × 8 seeds = 96 cases
        mask, rewards, values, _ = _batch(seed)
        assert _has_inner_span(mask[0].tolist())
        adv, ret = gae(rewards, values, mask, gamma, lam)
        for b in range(mask.shape[0]):
            a_ref, r_ref = verl_gae(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
            torch.testing.assert_close(adv[b], torch.tensor(a_ref, dtype=D), rtol=0, atol=TOL)
            torch.testing.assert_close(ret[b], torch.tensor(r_ref, dtype=D), rtol=0, atol=TOL)


@pytest.mark.parametrize("gamma", (1.0, 0.99, 0.9, 0.5))
def test_reinforce_pp_returns_equal_verl_at_every_position(gamma):
    for seed in RPP_SEEDS:  # 4 γ × 15 seeds = 60 cases
        mask, rewards, _, lengths = _batch(100 + seed)
        B, L = mask.shape
        ref = torch.tensor([verl_rpp_returns(rewards[b].tolist(), mask[b].tolist(), gamma) for b in range(B)],
                           dtype=D)
        got = discounted_returns(rewards.reshape(-1), [L] * B, gamma, mask.reshape(-1)).reshape(B, L)
        torch.testing.assert_close(got, ref, rtol=0, atol=TOL)
        # the responses alone (no padding), as the loop lays them out
        got = discounted_returns(_flat(rewards, lengths), lengths, gamma, _flat(mask, lengths))
        torch.testing.assert_close(got, _flat(ref, lengths), rtol=0, atol=TOL)


@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_kl_in_reward_equals_verl(kind, estimator):
    """Outcome reward on each response's last token (trained here, where verl and rlbench both put it), the
    KL penalty of π_old vs π_ref on the trained tokens, then GAE / REINFORCE++ returns, against verl; the
    controller's β passed per step overrides the config's starting value."""
    beta, gamma, lam = 0.07, 0.95, 0.9
    mask, _, values, lengths = _batch(7)
    B, L = mask.shape
    for b in range(B):  # the last response token is trained (where verl's reward manager puts the score)
        if mask[b].sum() > 0:
            mask[b, lengths[b] - 1] = 1.0
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(B, L, generator=g, dtype=D) * 3
    ref = -torch.rand(B, L, generator=g, dtype=D) * 3
    scores = torch.randn(B, generator=g, dtype=D)
    kld = [[verl_kld(old[b, t].item(), ref[b, t].item(), kind) * mask[b, t].item() for t in range(L)]
           for b in range(B)]
    tok = [[-beta * k for k in row] for row in kld]
    for b in range(B):
        tok[b][lengths[b] - 1] += scores[b].item()  # on a fully masked row it reaches no trained token (both)

    def flat(x):
        return _flat(x, lengths)

    if estimator == "gae":
        exp = [verl_gae(tok[b], values[b].tolist(), mask[b].tolist(), gamma, lam)[0] for b in range(B)]
        cfg = LossConfig(advantage_estimator=GAE, kl_coef=0.01, kl_loss_type=kind, gamma=gamma, lambd=lam)
    else:
        exp = [verl_rpp_returns(tok[b], mask[b].tolist(), gamma) for b in range(B)]
        cfg = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.01,
                         kl_loss_type=kind, gamma=gamma)
        direct = reinforce_pp_advantages(scores, lengths, flat(mask), flat(torch.tensor(kld, dtype=D)), beta, gamma)
        torch.testing.assert_close(direct, flat(torch.tensor(exp, dtype=D)), rtol=0, atol=TOL)
    base = to_tokens(scores, lengths)
    got = token_advantages(cfg, base, lengths, flat(mask), old_log_probs=flat(old), ref_log_probs=flat(ref),
                           values=flat(values), kl_coef=beta)
    # whitened over the trained tokens, as verl's masked_whiten (unbiased variance, eps 1e-8)
    sel = [exp[b][t] for b in range(B) for t in range(lengths[b]) if mask[b, t]]
    mean = sum(sel) / len(sel)
    std = math.sqrt(sum((x - mean) ** 2 for x in sel) / (len(sel) - 1) + 1e-8)
    white = torch.tensor([(exp[b][t] - mean) / std for b in range(B) for t in range(lengths[b])], dtype=D)
    on = flat(mask) > 0
    if estimator == "gae":
        torch.testing.assert_close(got, flat(torch.tensor(exp, dtype=D)), rtol=0, atol=TOL)
        # verl whitens GAE's advantages, never its returns (A + V before whitening, the critic's target)
        cfg_w = LossConfig(advantage_estimator=GAE, kl_coef=0.01, kl_loss_type=kind, gamma=gamma, lambd=lam,
                           normalize_advantages=True)
        adv_w, returns = token_advantages_and_returns(cfg_w, base, lengths, flat(mask), old_log_probs=flat(old),
                                                      ref_log_probs=flat(ref), values=flat(values), kl_coef=beta)
        torch.testing.assert_close(adv_w[on], white[on], rtol=0, atol=TOL)
        verl_ret = [verl_gae(tok[b], values[b].tolist(), mask[b].tolist(), gamma, lam)[1] for b in range(B)]
        torch.testing.assert_close(returns, flat(torch.tensor(verl_ret, dtype=D)), rtol=0, atol=TOL)
    else:
        torch.testing.assert_close(got[on], white[on], rtol=0, atol=TOL)
        returns = token_advantages_and_returns(cfg, base, lengths, flat(mask), old_log_probs=flat(old),
                                               ref_log_probs=flat(ref), kl_coef=beta)[1]
        torch.testing.assert_close(returns, flat(torch.tensor(exp, dtype=D)), rtol=0, atol=TOL)
    # the KL the adaptive controller reads: verl's current_kl (mean over rows of the masked row means), rows
    # with a trained token (verl would count the fully masked row as 0)
    rows = [b for b in range(B) if mask[b].sum() > 0]
    assert len(rows) < B
    verl_kl = sum(sum(kld[b]) / mask[b].sum().item() for b in rows) / len(rows)
    ours = mean_sequence_kl(reward_kl(cfg, flat(old), flat(ref), flat(mask)), lengths, flat(mask))
    assert abs(ours - verl_kl) < TOL


def test_kl_coef_override_needs_kl_in_reward_on():
    mask = torch.ones(4, dtype=D)
    cfg = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True)
    with pytest.raises(ValueError, match="config's kl_coef is 0"):
        compute_advantages(cfg, torch.ones(2, dtype=D), [2, 2], mask, group_size=2, kl_coef=0.1,
                           old_log_probs=torch.zeros(4, dtype=D), ref_log_probs=torch.zeros(4, dtype=D))
    on = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.1)
    with pytest.raises(ValueError, match="needs old_log_probs and ref_log_probs"):
        compute_advantages(on, torch.ones(2, dtype=D), [2, 2], mask, group_size=2)


def test_group_estimators_have_no_returns():
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=D)
    base = torch.tensor([0.5, 0.5, -0.5, -0.5], dtype=D)
    adv, returns = token_advantages_and_returns(LossConfig(), base, [2, 2], mask)
    assert returns is None and torch.equal(adv, base)
