"""Policy losses, KL estimators and the total PolicyLoss vs float64 references; gradients; exact zeros."""

import math

import pytest
import torch

from rlbench.algorithms import GlobalNorm, LossConfig, LossInputs, approx_kl, build_loss, loss_token_weights
from rlbench.algorithms.kl import KL_TYPES

D = torch.float64
LENGTHS = [4, 1, 6, 3, 5]


def _data(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    R = sum(lengths)
    old = -torch.rand(R, generator=g, dtype=D) * 3
    new = old + 0.4 * torch.randn(R, generator=g, dtype=D)
    ref = old + 0.3 * torch.randn(R, generator=g, dtype=D)
    adv = torch.randn(R, generator=g, dtype=D)
    mask = (torch.rand(R, generator=g) > 0.2).to(D)
    ent = torch.rand(R, generator=g, dtype=D)
    return old, new, ref, adv, mask, ent


# ---- float64 references written from the formulas, one token / one sequence at a time ----
def _clip_ref(lr, a, el, eh, c):
    r = math.exp(lr)
    loss = max(-r * a, -min(max(r, 1 - el), 1 + eh) * a)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss


def _pg_ref(cfg, new, old, adv, mask):
    out, s = [], 0
    for n in LENGTHS:
        idx = range(s, s + n)
        msum = sum(mask[i].item() for i in idx)
        seq_lr = sum((new[i] - old[i]).item() * mask[i].item() for i in idx) / max(1.0, msum)
        for i in idx:
            lr, a = (new[i] - old[i]).item(), adv[i].item()
            if cfg.policy_loss == "gspo":
                loss = _clip_ref(seq_lr, a, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)
            elif cfg.policy_loss == "ppo":
                loss = _clip_ref(lr, a, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)
            else:
                loss = -min(max(math.exp(lr), 1 - cfg.eps_clip), 1 + cfg.eps_clip_high) * a * new[i].item()
            if cfg.use_opsm and a < 0 and -seq_lr > cfg.opsm_delta:
                loss = 0.0
            out.append(loss)
        s += n
    return out


def _kl_ref(kind, lp, rf, old, unbiased):
    d = lp - rf
    k = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d, "low_var_kl": math.exp(-d) - 1 + d}[kind]
    if unbiased:
        k *= math.exp(lp - old)
    return max(-10.0, min(10.0, k)) if kind == "low_var_kl" else k


def _total_ref(cfg, new, old, ref, adv, mask, ent):
    """Sample-mean aggregation over one global batch, by hand."""
    pg = _pg_ref(cfg, new, old, adv, mask)
    total, s = 0.0, 0
    for n in LENGTHS:
        msum = max(1.0, sum(mask[s : s + n].tolist()))
        for i in range(s, s + n):
            x = pg[i]
            if cfg.use_kl_loss:
                x += cfg.kl_loss_coef * _kl_ref(cfg.kl_loss_type, new[i].item(), ref[i].item(), old[i].item(),
                                                cfg.use_unbiased_kl)
            x -= cfg.entropy_coef * ent[i].item()
            total += x * mask[i].item() / msum / len(LENGTHS)
        s += n
    return total


CONFIGS = [
    dict(policy_loss="ppo"),
    dict(policy_loss="ppo", eps_clip=0.1, eps_clip_high=0.28, eps_clip_c=3.0),
    dict(policy_loss="gspo", eps_clip=0.05, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3"),
    dict(policy_loss="cispo", eps_clip_high=0.3, entropy_coef=0.01),
    dict(policy_loss="ppo", use_opsm=True, opsm_delta=1e-4, use_kl_loss=True, kl_loss_coef=0.2,
         kl_loss_type="low_var_kl", use_unbiased_kl=True),
    dict(policy_loss="ppo", use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k2", entropy_coef=0.02),
]


def _inputs(cfg, old, ref, adv, mask):
    norm = GlobalNorm(len(LENGTHS), float(mask.sum()))
    w = loss_token_weights(mask, LENGTHS, cfg.loss_aggregation, norm)
    return LossInputs(old, adv, mask, w, LENGTHS, ref_log_probs=ref)


@pytest.mark.parametrize("kw", CONFIGS)
def test_total_loss_matches_reference_and_gradcheck(kw):
    cfg = LossConfig(**kw)
    old, new, ref, adv, mask, ent = _data()
    inputs = _inputs(cfg, old, ref, adv, mask)
    loss_fn = build_loss(cfg)
    loss, metrics = loss_fn(new, ent, inputs)
    assert abs(loss.item() - _total_ref(cfg, new, old, ref, adv, mask, ent)) < 1e-12
    assert metrics["loss"].item() == loss.item()
    assert not [k for k in metrics if "/" in k]  # bare names: the backend owns the `train/` prefix
    x = new.clone().requires_grad_()
    e = ent.clone().requires_grad_()
    if cfg.policy_loss != "cispo":
        assert torch.autograd.gradcheck(lambda x, e: loss_fn(x, e, inputs)[0], (x, e))
        return
    # CISPO's stop-gradient makes finite differences differ by design: check ∂L/∂logπ = −w·sg(clip(r))·A.
    loss_fn(x, e, inputs)[0].backward()
    r = torch.exp(new - old).clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    torch.testing.assert_close(x.grad, -inputs.token_weights * r * adv, rtol=0, atol=1e-15)
    torch.testing.assert_close(e.grad, -cfg.entropy_coef * inputs.token_weights, rtol=0, atol=1e-15)


def test_dual_clip_is_live():
    old, new, ref, adv, mask, ent = _data(3)
    a = build_loss(LossConfig(eps_clip=0.2))(new + 2.0, None, _inputs(LossConfig(), old, ref, -adv.abs(), mask))
    b = build_loss(LossConfig(eps_clip=0.2, eps_clip_c=2.0))(
        new + 2.0, None, _inputs(LossConfig(), old, ref, -adv.abs(), mask))
    assert b[0] < a[0] and b[1]["dual_clipfrac"] > 0
    with pytest.raises(ValueError, match="eps_clip_c=1.0"):
        LossConfig(eps_clip_c=1.0)


def test_metrics_reference_values():
    cfg = LossConfig(eps_clip=0.1, use_kl_loss=True, kl_loss_coef=0.1)
    old, new, ref, adv, mask, ent = _data(5)
    _, m = build_loss(cfg)(new, ent, _inputs(cfg, old, ref, adv, mask))
    clip, ppo_kl, kl, H, s = 0.0, 0.0, 0.0, 0.0, 0
    for n in LENGTHS:
        msum = max(1.0, sum(mask[s : s + n].tolist()))
        for i in range(s, s + n):
            lr, a, w = (new[i] - old[i]).item(), adv[i].item(), mask[i].item() / msum / len(LENGTHS)
            r = math.exp(lr)
            clip += w * float(-min(max(r, 0.9), 1.1) * a > -r * a)
            ppo_kl += w * -lr
            kl += w * (new[i] - ref[i]).item()
            H += w * ent[i].item()
        s += n
    for key, val in [("pg_clipfrac", clip), ("ppo_kl", ppo_kl), ("kl_loss", kl), ("entropy", H)]:
        assert abs(m[key].item() - val) < 1e-12, key
    assert m["ppo_kl_abs"] > abs(m["ppo_kl"])


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_new_equals_old_gives_exact_zero_ppo_kl_and_clipfrac(policy_loss):
    old, _, _, adv, mask, ent = _data(7)
    cfg = LossConfig(policy_loss=policy_loss, use_kl_loss=True, kl_loss_type="k3", use_opsm=True)
    _, m = build_loss(cfg)(old.float(), ent.float(), _inputs(cfg, old.float(), old.float(), adv.float(), mask))
    for key in ("ppo_kl", "ppo_kl_abs", "pg_clipfrac", "kl_loss", "opsm_clipfrac"):
        assert m[key].item() == 0.0, key


@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_estimators(kind):
    old, new, ref, *_ = _data(9)
    for unbiased in (False, True):
        got = approx_kl(new, ref, kind, old_log_probs=old if unbiased else None)
        exp = [_kl_ref(kind, new[i].item(), ref[i].item(), old[i].item(), unbiased) for i in range(len(new))]
        torch.testing.assert_close(got, torch.tensor(exp, dtype=D), rtol=1e-13, atol=1e-13)
    same = approx_kl(new.float(), new.float(), kind)
    assert torch.equal(same, torch.zeros_like(same))
    assert approx_kl(torch.tensor([30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0


def test_defaults_match_slime():
    cfg = LossConfig()
    assert (cfg.advantage_estimator, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c) == ("grpo", 0.2, 0.2, None)
    assert (cfg.use_kl_loss, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.kl_coef) == (False, 0.0, "k1", 0.0)
    assert (cfg.entropy_coef, cfg.gamma, cfg.lambd, cfg.opsm_delta) == (0.0, 1.0, 1.0, 1e-4)
    assert (cfg.use_tis, cfg.tis_clip, cfg.tis_clip_low, cfg.use_rollout_logprobs) == (False, 2.0, 0.0, False)
    assert cfg.mode == "standard" and cfg.loss_aggregation == "sample_mean"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(policy_loss="nope"), "policy_loss"),
        (dict(eps_clip=1.5), "eps_clip=1.5"),
        (dict(kl_loss_type="k4"), "kl_loss_type"),
        (dict(use_tis=True, use_rollout_logprobs=True), "exclusive"),
        (dict(loss_aggregation="seq_sum_constant"), "loss_aggregation_constant"),
        (dict(tis_clip_low=3.0), "tis_clip_low"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kw)


def test_missing_inputs_raise():
    old, new, ref, adv, mask, ent = _data()
    cfg = LossConfig(use_kl_loss=True)
    inputs = _inputs(cfg, old, None, adv, mask)
    with pytest.raises(ValueError, match="ref_log_probs"):
        build_loss(cfg)(new, None, inputs)
    with pytest.raises(ValueError, match="entropy_coef"):
        build_loss(LossConfig(entropy_coef=0.1))(new, None, inputs)
    with pytest.raises(ValueError, match="shape"):
        LossInputs(old[:-1], adv, mask, mask, LENGTHS)


def test_loss_inputs_to_device_keeps_everything():
    old, new, ref, adv, mask, ent = _data()
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.1)
    inputs = _inputs(cfg, old, ref, adv, mask)
    moved = inputs.to("cpu")
    assert torch.equal(moved.seq_ids, inputs.seq_ids) and moved.response_lengths == LENGTHS
    assert build_loss(cfg)(new, ent, moved)[0].item() == build_loss(cfg)(new, ent, inputs)[0].item()
