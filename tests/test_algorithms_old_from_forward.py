"""π_old from the training forward itself (`old_from_forward`): the loss, its gradient and every metric equal
those of a separate old-log-prob pass that returned the same values, bit for bit, for each loss variant."""

import dataclasses

import pytest
import torch

from rlbench.algorithms import (
    LossConfig,
    MISConfig,
    ResponseBatch,
    build_loss,
    build_loss_inputs,
    global_norm,
    old_from_forward_ok,
)

LENGTHS = [[4, 1, 6], [3, 5], [7]]  # three micro-batches of one optimizer step

CONFIGS = {
    "ppo": LossConfig(),
    "ppo_dual_clip": LossConfig(eps_clip_c=3.0),
    "gspo": LossConfig(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
    "cispo": LossConfig(policy_loss="cispo"),
    "opsm": LossConfig(use_opsm=True),
    "tis": LossConfig(use_tis=True),
    "mis_token_no_batch_norm": LossConfig(use_tis=True, mis=MISConfig(tis_batch_normalize=False)),
    "kl_k3_entropy": LossConfig(use_kl_loss=True, kl_loss_type="k3", entropy_coef=0.01),
    "seq_sum_constant": LossConfig(loss_aggregation="seq_sum_constant", loss_aggregation_constant=16.0),
}


def _micro_batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mbs, current = [], []
    for lengths in LENGTHS:
        R = sum(lengths)
        logp = -torch.rand(R, generator=g) * 3
        mbs.append(ResponseBatch(
            loss_mask=(torch.rand(R, generator=g) > 0.2).float(),
            advantages=torch.randn(R, generator=g),
            response_lengths=lengths,
            rollout_log_probs=logp + 0.3 * torch.randn(R, generator=g),  # an engine that differs a lot
            ref_log_probs=logp + 0.2 * torch.randn(R, generator=g),
        ))
        current.append(logp)
    return mbs, current


def _run(cfg, inputs, current):
    loss_fn = build_loss(cfg)
    out = []
    for x, logp in zip(inputs, current):
        lp = logp.clone().requires_grad_(True)
        ent = torch.rand_like(logp) if cfg.entropy_coef else None
        loss, metrics = loss_fn(lp, ent, x)
        loss.backward()
        out.append((loss.detach(), lp.grad, {k: v.detach() for k, v in metrics.items()}))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_bits_as_a_separate_pass(name):
    cfg = CONFIGS[name]
    mbs, current = _micro_batches()
    norm = global_norm(cfg, mbs)
    recomputed = [dataclasses.replace(mb, old_log_probs=logp.clone()) for mb, logp in zip(mbs, current)]
    torch.manual_seed(0)
    want = _run(cfg, build_loss_inputs(cfg, recomputed, norm=norm), current)
    torch.manual_seed(0)
    got = _run(cfg, build_loss_inputs(cfg, mbs, norm=norm, old_from_forward=True), current)
    for (wl, wg, wm), (gl, gg, gm) in zip(want, got):
        assert torch.equal(wl, gl)
        assert torch.equal(wg, gg)
        assert wm.keys() == gm.keys()
        for k in wm:
            assert torch.equal(wm[k], gm[k]) or (wm[k].isnan() and gm[k].isnan()), k
        assert gm["ppo_kl_abs"] == 0.0  # the policy is the sampling policy: first-micro-batch KL is exactly 0
    if cfg.use_tis:  # the per-micro-batch IS weights are not all 1: the engine differs, so this is a real check
        assert any(float(m.get("tis", m.get("mis_is_ratio_mean_final", torch.tensor(1.0)))) != 1.0
                   for _, _, m in got)


def test_refused_where_the_whole_batch_is_needed():
    mbs, _ = _micro_batches()
    for cfg in (LossConfig(use_rollout_logprobs=True), LossConfig(use_tis=True, mis=MISConfig())):
        assert not old_from_forward_ok(cfg)
        with pytest.raises(ValueError, match="recompute"):
            build_loss_inputs(cfg, mbs, old_from_forward=True)
    assert old_from_forward_ok(LossConfig())
