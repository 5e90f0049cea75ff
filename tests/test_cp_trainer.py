"""The RL loop at context_parallel_size=2 (Ray, CPU/gloo) against the one-process cp=1 run, step for step.

`build_trainer` with `cluster.backend="ray"` is rlbench's multi-process Trainer (the local Trainer is one
process, so it refuses cp > 1). Two trainer ranks form one CP group (dp=1) with an engine each; every step runs
rollout on the embedded engines, scoring, packing (slots aligned to 2·cp), old log-probs, two optimizer steps
and the weight sync. Same seeds, fp32 weights on both sides: the samples are identical, the metrics (loss, grad
norm, rollout/train log-prob gap, rewards) and the parameters after 3 steps agree to fp32 rounding, and both CP
peers push bit-identical weights. AdamW eps=1 keeps the update linear in the gradient (with eps=1e-8 rounding
noise in near-zero gradients becomes +-lr updates, see docs/LOG.md); lr is large enough to move the policy.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
from dist_utils import local_ray

from rlbench import presets
from rlbench.configs import EvalConfig, WeightSyncConfig
from rlbench.configs.backend import OptimConfig
from rlbench.configs.cluster import ClusterConfig
from rlbench.metrics import LoggingConfig
from rlbench.rewards import REWARDS

STEPS = 3
SKIP = ("rollout/staleness", "weights/", "perf/")  # timings, Ray-only staleness, per-rank sync sizes
REL = 2e-6  # measured up to 1.2e-6 on the 2-core AMD EPYC box (2026-12-02), 3e-7 on the earlier one
# Metrics that are sums of cancelling terms (the loss: GRPO advantages sum to ~0; the signed ppo_kl) or that
# measure fp32 rounding itself (train_rollout_logprob_abs_diff, tis_abs, mismatch_*: ~1e-7 between the fp32
# engine and trainer) have no meaningful relative error; their absolute error is held to REL times the O(1)
# scale of the inputs (advantages ~1, log-probs ~5). Measured: at most 2.1e-7 (mismatch_chi2_seq).
ABS = 1e-6


def digit_reward(response: str, label) -> float:
    """Varies across the random tiny model's samples, so advantages and gradients are non-zero."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def run_cfg(workdir: str, cp: int):
    cfg = presets.cpu_test(model="tiny", workdir=workdir, level=1, n_eval=8)
    task = replace(cfg.task, n_train=64, n_eval=8)
    cluster = ClusterConfig(backend="ray", actor_num_gpus_per_node=cp, timeout_s=120) if cp > 1 else ClusterConfig()
    return cfg.replace(
        task=task, data=replace(cfg.data, path=task.train_path, metadata_key=None),
        rollout=replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8,
                        rm_type="cp_digits"),
        batch=replace(cfg.batch, global_batch_size=8, num_rollout=STEPS, max_tokens_per_gpu=64),
        backend=replace(cfg.backend, cp_size=cp, fsdp=replace(cfg.backend.fsdp, checkpoint_format="full"),
                        optim=OptimConfig(lr=0.5, eps=1.0, betas=(0.9, 0.98))),
        loss=replace(cfg.loss, use_tis=True),
        engine=replace(cfg.engine, max_seq_len=48, num_slots=16),
        eval=EvalConfig(), weights=WeightSyncConfig(verify=True), logging=LoggingConfig(console=False),
        cluster=cluster,
    )


def run(trainer, path: str, before: str | None = None) -> dict:
    """`STEPS` steps; per step the metrics and the sampled token ids; the full checkpoint's model state after."""
    if before is not None:
        trainer.save(before)
    out = {"history": [], "tokens": []}
    for _ in range(STEPS):
        out["history"].append(trainer.step())
        out["tokens"].append([list(s.tokens) for s in trainer.last_rollout.samples])
    trainer.save(path)
    out["params"] = read_params(path)
    return out


def read_params(path: str) -> dict[str, torch.Tensor]:
    (step_dir,) = [d for d in os.listdir(path) if d.startswith("iter_") and not d.endswith(".tmp")]
    return torch.load(os.path.join(path, step_dir, "full.pt"), weights_only=False)["model"]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'rlbench[dist]')")
    REWARDS["cp_digits"] = digit_reward
    with local_ray(tmp_path_factory.mktemp("raystub")) as ray:
        yield ray
    REWARDS.pop("cp_digits", None)


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    import torch.distributed as dist

    from rlbench import build_trainer
    from rlbench.weights import engine_named_weights

    root = tmp_path_factory.mktemp("cp_trainer")
    workdir = str(root / "work")
    was_init = dist.is_initialized()
    local = build_trainer(run_cfg(workdir, 1))
    names = sorted(n for n, _ in engine_named_weights(local.engine))
    ref = run(local, str(root / "cp1"), before=str(root / "start"))
    ref["start"] = read_params(str(root / "start"))
    local.close()
    if not was_init and dist.is_initialized():
        dist.destroy_process_group()
    trainer = build_trainer(run_cfg(workdir, 2))
    try:
        got = run(trainer, str(root / "cp2"))
        refs = [e.checksums.remote(names) for e in trainer.cluster.engines]
        got["engine_checksums"] = ray_session.get(refs, timeout=120)
        got["num_engines"] = len(trainer.cluster.engines)
    finally:
        trainer.close()
    return ref, got


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_same_samples_every_step(runs):
    ref, got = runs
    assert len(got["tokens"]) == STEPS and got["tokens"] == ref["tokens"]
    assert len(ref["tokens"][0]) == 16


def test_metrics_match_cp1_step_for_step(runs):
    ref, got = runs
    for step, (g, r) in enumerate(zip(got["history"], ref["history"])):
        keys = [k for k in r if k.startswith(("rollout/", "train/")) and not k.startswith(SKIP)]
        for k in ("train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "rollout/raw_reward"):
            assert k in keys
        assert r["train/grad_norm"] > 0 and r["rollout/advantages"] != 0  # a real training signal
        assert set(keys) <= set(g)
        for k in keys:
            assert math.isclose(g[k], r[k], rel_tol=REL, abs_tol=ABS), f"step {step} {k}: cp2 {g[k]} cp1 {r[k]}"
        for k in ("train/grad_norm", "train/ppo_kl_abs", "rollout/log_probs"):  # no cancellation: relative
            assert math.isclose(g[k], r[k], rel_tol=REL), f"step {step} {k}: cp2 {g[k]} cp1 {r[k]}"
        # the CP recompute of the old log-probs equals the fp32 engine's to fp32 rounding
        assert g["train/train_rollout_logprob_abs_diff"] < 1e-6
        assert g["weights/verified"] == 1.0 and g["weights/version"] == r["weights/version"] == 2 * (step + 1)


def test_parameters_match_cp1_after_the_run(runs):
    ref, got = runs
    assert got["params"].keys() == ref["params"].keys()
    moved = max(rel(ref["params"][n] - ref["start"][n], ref["start"][n]) for n in ref["start"])
    assert moved > 1e-2  # training moved the policy: the later rollouts depend on the synced weights
    for n, p in ref["params"].items():
        assert rel(got["params"][n], p) <= REL, n  # measured: 3.3e-7 at most
        update, ref_update = got["params"][n] - ref["start"][n], p - ref["start"][n]
        # the 6 updates themselves, relative to their own size (measured 2.1e-6 at most: errors of 1e-7 in each
        # step's gradient compound through the later rollouts' log-probs; 2.2e-5 on the AMD EPYC box, 2026-12-02),
        # plus the fp32 spacing of the weights they were added to: a norm weight near 1 moved by 6e-4 carries a
        # rounding of 6e-8 = 1e-4 of its update (9.4e-5 measured there, 2026-12-06)
        ulps = 2 * torch.finfo(torch.float32).eps * float(p.abs().max())
        assert float((update - ref_update).abs().max()) <= 5e-5 * float(ref_update.abs().max()) + ulps, n


def test_cp_peers_push_identical_weights(runs):
    _, got = runs
    first, second = got["engine_checksums"]
    assert got["num_engines"] == 2 and len(first) > 0 and first == second


def test_bad_cp_layouts_are_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "cp_digits", digit_reward)
    cfg = run_cfg(str(tmp_path), 2)
    with pytest.raises(ValueError, match="context_parallel_size=2 needs 2 .* cluster.backend='local' runs one process"):
        cfg.replace(cluster=ClusterConfig())
    with pytest.raises(ValueError, match="3 trainer ranks are not divisible by cp_size=2"):
        cfg.replace(cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=3))
    # a 9-token sequence (max_response_len 8 + a prompt token) fits 5 x 2 = 10 tokens, but not once its slot is
    # aligned to 2·cp = 4 (12 tokens; the budget rounds down to 8)
    with pytest.raises(ValueError, match="holds 8 tokens .* raise max_tokens_per_gpu to at least 6"):
        cfg.replace(batch=replace(cfg.batch, max_tokens_per_gpu=5))
    assert cfg.replace(batch=replace(cfg.batch, max_tokens_per_gpu=6)).batch.max_tokens_per_gpu == 6
