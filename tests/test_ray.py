"""rlbench on Ray, on CPU: 2 trainer ranks (gloo) + engines as Ray actors, against the single-process run.

One Ray cluster per module. Proven here:
- colocated (2 ranks + 2 engines on 2 bundles, shared-memory "IPC" weight sync) and disaggregated (2 ranks +
  1 engine on its own bundle, gloo broadcast-group weight sync) give the single-process training curve
  for the same seed (same samples; losses, grad norms, log-probs to float tolerance);
- every weight sync is verified bit-exactly on the engines (checksums), with versions;
- async (one-step off-policy) trains: staleness 1 recorded per sample, TIS active, versions advance;
- a dead actor and a hung collective become RuntimeErrors within the timeout; startup errors name the fix;
- SGLang engines: the layout (bundles of tp_size GPUs, weight-group ranks) and one disaggregated step with the
  engine actor building the SGLang adapter over `sglang.Engine` (a fake `sglang` package on the actors' path).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace

import pytest
import torch
from dist_utils import local_ray
from fake_sglang import write_sglang_package

from rlbench import presets
from rlbench.configs import EvalConfig, RunConfig, SGLangEngineConfig, WeightSyncConfig
from rlbench.configs.cluster import (
    ClusterConfig,
    placement_plan,
    weight_group_ranks,
)
from rlbench.configs.data import DataConfig
from rlbench.metrics import LoggingConfig
from rlbench.orchestration.ray_dp import split_steps_by_dp
from rlbench.orchestration.ray_weights import flatten_bucket, from_ipc, to_ipc, unflatten
from rlbench.rewards import REWARDS
from rlbench.types import Sample

STEPS = 3
# Not compared: timings, staleness (Ray only), sync sizes (colocated: every rank sends to its own engine).
SKIP = ("rollout/staleness", "weights/", "perf/")


def digit_reward(response: str, label) -> float:
    """Varies across the random tiny model's samples, so advantages and gradients are non-zero."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def tiny_cfg(workdir: str):
    cfg = presets.cpu_test(model="tiny", workdir=workdir, level=1, n_eval=8)
    task = replace(cfg.task, n_train=64, n_eval=8)
    return cfg.replace(
        task=task, data=replace(cfg.data, path=task.train_path, metadata_key=None),
        rollout=replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8, rm_type="ray_digits"),
        batch=replace(cfg.batch, global_batch_size=8, num_rollout=STEPS, max_tokens_per_gpu=256, balance_data=True),
        loss=replace(cfg.loss, use_tis=True),
        engine=replace(cfg.engine, max_seq_len=48, num_slots=16),
        eval=EvalConfig(), weights=WeightSyncConfig(verify=True), logging=LoggingConfig(console=False),
    )


# ---------------------------------------------------------------------------------------------- pure parts
def test_cluster_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="rollout_num_gpus"):
        ClusterConfig(backend="ray", colocate=False)
    with pytest.raises(ValueError, match="colocate=False"):
        ClusterConfig(backend="ray", async_rollout=True)
    with pytest.raises(ValueError, match="backend='ray'"):
        ClusterConfig(actor_num_gpus_per_node=2)
    with pytest.raises(ValueError, match="backend='ray'"):
        ClusterConfig(rollout_num_gpus_per_engine=2)
    with pytest.raises(ValueError, match="rollout_num_gpus=3 is not a multiple of rollout_num_gpus_per_engine=2"):
        ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=3, rollout_num_gpus_per_engine=2)
    with pytest.raises(ValueError, match="torch engine has no tensor parallelism"):  # the engine's GPU count is 1
        RunConfig(data=DataConfig(path="x.jsonl"), cluster=ClusterConfig(backend="ray", rollout_num_gpus_per_engine=2))


def test_placement_plan_bundles():
    colo = placement_plan(ClusterConfig(backend="ray", actor_num_nodes=2, actor_num_gpus_per_node=2))
    assert (colo.num_bundles, colo.train_bundles, colo.engine_bundles) == (4, (0, 1, 2, 3), (0, 1, 2, 3))
    assert colo.train_gpu_fraction + colo.engine_gpu_fraction <= 1.0
    dis = placement_plan(ClusterConfig(backend="ray", actor_num_gpus_per_node=2, colocate=False, rollout_num_gpus=3))
    assert (dis.num_bundles, dis.train_bundles, dis.engine_bundles) == (5, (0, 1), (2, 3, 4))


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_layout_of_tp_engines(tp):
    """Disaggregated engines of TP size tp: one bundle of tp GPUs per engine (the actor reserves all of them), and
    the weight-broadcast group counts tp ranks per engine after trainer rank 0."""
    cluster = ClusterConfig(backend="ray", actor_num_gpus_per_node=2, colocate=False, rollout_num_gpus=2 * tp,
                            rollout_num_gpus_per_engine=tp)
    plan = placement_plan(cluster)
    assert (plan.num_bundles, plan.train_bundles, plan.engine_bundles) == (4, (0, 1), (2, 3))
    assert plan.bundle_gpus == (1, 1, tp, tp) and plan.engine_gpu_fraction == 1.0  # GPUs requested: 1.0 x tp
    assert weight_group_ranks([tp, tp]) == ([1, 1 + tp], 1 + 2 * tp)
    assert weight_group_ranks([1, 2, 1]) == ([1, 2, 4], 5)


def test_split_steps_by_dp_keeps_each_global_batch():
    samples = [Sample(tokens=[1] * (3 + i % 5), response_length=2, index=i) for i in range(16)]
    shards = split_steps_by_dp(samples, gbs=8, dp_size=2, balance=True)
    for s in range(2):
        ids = sorted(x.index for r in range(2) for x in shards[r][s])
        assert ids == list(range(8 * s, 8 * s + 8))  # the single-process step's samples, nothing else
        assert len(shards[0][s]) == len(shards[1][s]) == 4
        tokens = [sum(x.total_length for x in shards[r][s]) for r in range(2)]
        assert abs(tokens[0] - tokens[1]) <= 1  # balanced (lengths 3..7 allow a perfect or off-by-one split)


def test_flat_buckets_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g).bfloat16()),
              ("c", torch.randn(2, 2, generator=g))]
    flats = flatten_bucket(bucket)
    assert [f.buffer.dtype for f in flats] == [torch.float32, torch.bfloat16]  # one buffer per dtype
    out = dict(kv for f in flats for kv in unflatten(from_ipc(to_ipc(f.buffer)), f.meta()))
    for name, t in bucket:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_missing_ray_names_the_extra(monkeypatch):
    from rlbench.orchestration.ray_placement import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"rlbench\[dist\]"):
        import_ray()


@pytest.fixture(scope="module")
def ray_digits():
    """`rm_type="ray_digits"` (tiny_cfg's reward) registered for the tests that build a config from it."""
    REWARDS["ray_digits"] = digit_reward
    yield
    REWARDS.pop("ray_digits", None)


# ---------------------------------------------------------------------------------------------- on Ray
@pytest.fixture(scope="module")
def ray_cluster(ray_digits, tmp_path_factory):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'rlbench[dist]')")
    stub = tmp_path_factory.mktemp("raystub")
    write_sglang_package(stub)  # the actors' `import sglang` finds fake_sglang.Engine (the driver's does not)
    with local_ray(stub) as ray:
        yield ray


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ray_run"))


@pytest.fixture(scope="module")
def local_history(ray_cluster, workdir):
    """The single-process reference curve (same config and seed)."""
    import torch.distributed as dist

    from rlbench import Trainer

    was_init = dist.is_initialized()
    trainer = Trainer(tiny_cfg(workdir))
    history = trainer.fit()
    trainer.close()
    if not was_init and dist.is_initialized():
        dist.destroy_process_group()
    return history


def _ray_trainer(workdir, **cluster):
    from rlbench.orchestration.ray_trainer import RayTrainer

    return RayTrainer(tiny_cfg(workdir), cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=2, timeout_s=120, **cluster))


def assert_same_curve(ray_history, local_history, mismatch_abs_tol: float = 1e-6):
    """Every rollout/train metric within rel 1e-4 (abs 1e-6). The train/rollout mismatch metrics are differences
    of near-equal log-probs (rounding noise, ~1e-6 in fp32): `mismatch_abs_tol` bounds them where the trainer's
    reductions run in another order than the reference's (megatron TP)."""
    assert len(ray_history) == len(local_history) == STEPS
    for step, (got, ref) in enumerate(zip(ray_history, local_history)):
        keys = [k for k in ref if k.startswith(("rollout/", "train/")) and not k.startswith(SKIP)]
        assert "train/grad_norm" in keys and "train/pg_loss" in keys and "rollout/log_probs" in keys
        assert ref["train/grad_norm"] > 0 and ref["rollout/advantages"] != 0  # a real training signal
        for k in keys:
            noise = k.startswith(("train/mismatch_", "train/train_rollout_logprob"))
            assert math.isclose(got[k], ref[k], rel_tol=1e-4, abs_tol=mismatch_abs_tol if noise else 1e-6), \
                f"step {step} {k}: ray {got[k]} local {ref[k]}"
        assert got["weights/verified"] == 1.0 and got["weights/version"] == ref["weights/version"] == (step + 1) * ref["train/optimizer_steps"]


def test_colocated_matches_single_process(ray_cluster, workdir, local_history):
    trainer = _ray_trainer(workdir, colocate=True)
    try:
        history = trainer.fit()
        assert trainer.cluster.plan.engine_bundles == (0, 1) and len(trainer.cluster.engines) == 2
        assert all(h["rollout/staleness_max"] == 0.0 for h in history)
        assert history[0]["weights/num_buckets"] == 2.0  # one bucket per rank, each to its own engine
    finally:
        trainer.close()
    assert_same_curve(history, local_history)


@pytest.fixture(scope="module")
def disaggregated(ray_cluster, workdir):
    trainer = _ray_trainer(workdir, colocate=False, rollout_num_gpus=1)
    yield trainer
    trainer.close()


def test_disaggregated_matches_single_process(disaggregated, local_history, tmp_path):
    history = disaggregated.fit()
    assert disaggregated.cluster.plan.engine_bundles == (2,)
    assert_same_curve(history, local_history)
    # save / load fan out to every rank (sharded checkpoint), and the engine gets the restored weights
    path = disaggregated.save(str(tmp_path / "ckpt"))
    assert disaggregated.load(path) == STEPS and disaggregated.version == disaggregated.policy_version
    files = os.listdir(path)  # one committed dir holds the loop state too (loop_state.pt)
    assert "latest_checkpointed_iteration.txt" in files and any(f.startswith("iter_") for f in files)


def test_async_rollout_trains(disaggregated):
    trainer = disaggregated
    trainer.async_rollout = True  # continue the same run one-step off-policy
    start, v0 = trainer.rollout_id, trainer.version
    history = trainer.fit(start + 3)
    k = history[start]["train/optimizer_steps"]  # policy versions count optimizer steps
    versions = [h["rollout/weight_version"] for h in history[start:]]
    assert versions == [v0, v0, v0 + k]  # the first async batch was generated before the step
    assert [h["rollout/staleness_max"] for h in history[start:]] == [0.0, k, k]
    assert all(s.metadata["staleness"] == k for s in trainer.last_rollout.samples)
    for h in history[start + 1 :]:
        assert h["train/grad_norm"] > 0 and math.isfinite(h["train/loss"]) and h["weights/verified"] == 1.0
        assert h["train/train_rollout_logprob_abs_diff"] > 1e-4  # off-policy: the trained policy moved on
        assert h["train/tis"] != 1.0  # TIS weights correct for it
    assert history[-1]["weights/version"] == v0 + 3 * k


def test_ref_update_interval_on_every_rank(ray_cluster, tmp_path):
    """ref_update_interval=2 on 2 ranks: rollout 1's ref/old log-probs differ (the actor trained once), the update
    after rollout 1 copies every rank's shards, so rollout 2's ref log-probs equal the old ones exactly."""
    from rlbench.orchestration.ray_trainer import RayTrainer

    cfg = tiny_cfg(str(tmp_path))
    cfg = cfg.replace(backend=replace(cfg.backend, ref_model="tiny", ref_update_interval=2),
                      loss=replace(cfg.loss, use_kl_loss=True, kl_loss_coef=0.01))
    trainer = RayTrainer(cfg, cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=2, colocate=True,
                                                    timeout_s=120))
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert ["perf/ref_update_time" in h for h in history] == [False, True, False]
    assert history[1]["rollout/ref_log_probs"] != history[1]["rollout/log_probs"]
    assert history[2]["rollout/ref_log_probs"] == history[2]["rollout/log_probs"]


def test_sglang_engine_actor_trains_disaggregated(ray_cluster, tmp_path):
    """rollout_engine='sglang' on Ray: the engine actor builds the SGLang adapter (`local.build_engine`) over
    `sglang.Engine(**engine_kwargs)`; the trainer casts to SGLang's parameter dtype (read from the checkpoint),
    forms the broadcast group with the adapter (1 + tp_size ranks) and trains a step; the engine samples with the
    trainer's weights, and each sync is verified by reading the engine's weights back."""
    from rlbench.models import build_model
    from rlbench.orchestration.ray_trainer import RayTrainer

    model = build_model("tiny")
    with torch.no_grad():
        model.model.norm.weight.fill_(0.5)  # the fake samples int(sum(norm)) as its 2nd token: 32 here, 64 trained
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")  # config.json: bfloat16, SGLang's load dtype
    cfg = tiny_cfg(str(tmp_path))
    cfg = cfg.replace(rollout_engine="sglang", sglang=SGLangEngineConfig(model_path=str(tmp_path / "hf")),
                      batch=replace(cfg.batch, num_rollout=1))
    assert cfg.weights.dtype is None
    cluster = ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=1, timeout_s=120)
    trainer = RayTrainer(cfg, cluster=cluster)
    try:
        assert trainer.cluster.cfg.weights.dtype == "bfloat16"
        assert trainer.cluster.call_engines("group_ranks") == [1] and trainer.cluster.plan.bundle_gpus == (1, 1)
        shapes, dtype = trainer.cluster.call_engines("weight_layout")[0]
        assert dtype == "bfloat16" and shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"]  # tied
        history = trainer.fit()
        versions = trainer.cluster.call_engines("weight_version")
    finally:
        trainer.close()
    h = history[0]
    assert h["weights/verified"] == 1.0 and math.isfinite(h["train/loss"])
    assert versions == [h["weights/version"]] == [h["train/optimizer_steps"]]  # bumped after a verified receive
    samples = trainer.last_rollout.samples
    assert {s.tokens[-s.response_length:][1] for s in samples} == {64}  # the trainer's norm (ones), not the file's


def test_hung_collective_and_dead_actor_surface_within_timeout(disaggregated):
    from rlbench.orchestration.ray_placement import gather

    trainers = disaggregated.cluster.trainers
    # Rank 0 alone enters the DP all-reduce of pack(): its peer never comes, so it hangs -> timeout error.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no result from trainer rank 0 within timeout_s=3s"):
        gather([trainers[0].pack.remote([[Sample(tokens=[5, 6, 7], response_length=1)]])], 3.0, "trainer.pack",
               ["trainer rank 0"])
    assert time.monotonic() - start < 20
    disaggregated.cluster.ray.kill(trainers[1])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="trainer rank 1"):
        disaggregated.step()
    assert time.monotonic() - start < 60


def test_not_enough_gpus_names_the_fix(ray_cluster):
    from rlbench.orchestration.ray_placement import create_placement

    plan = placement_plan(ClusterConfig(backend="ray", actor_num_gpus_per_node=2))
    with pytest.raises(ValueError, match="not enough resources.*GPU: need 2, cluster has 0"):
        create_placement(plan, "cuda", timeout_s=5)


def test_build_trainer_picks_the_class_of_the_cluster_backend(ray_digits, tmp_path):
    import rlbench
    from rlbench.configs.cluster import BACKENDS
    from rlbench.orchestration import TRAINERS, build_trainer, trainer_class
    from rlbench.orchestration.local import LocalTrainer
    from rlbench.orchestration.ray_trainer import RayTrainer
    from rlbench.trainer import Trainer as Loop

    assert sorted(TRAINERS) == sorted(BACKENDS) and rlbench.build_trainer is build_trainer
    cfg = tiny_cfg(str(tmp_path))
    assert trainer_class(cfg.cluster.backend) is LocalTrainer is rlbench.Trainer
    assert issubclass(LocalTrainer, Loop) and issubclass(RayTrainer, Loop)  # one loop over built components
    Trainer = rlbench.Trainer
    ray_cfg = cfg.replace(cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=2))
    assert trainer_class(ray_cfg.cluster.backend) is RayTrainer  # building it would start the actors
    with pytest.raises(ValueError, match=r"rlbench.build_trainer\(cfg\)"):
        Trainer(ray_cfg)  # refused before anything is built
    with pytest.raises(ValueError, match="global_batch_size=8 must be divisible by dp_size=3"):
        cfg.replace(cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=3))


# ---------------------------------------------------------------------------------------------- megatron on Ray
def megatron_cfg(workdir: str, tp: int = 1, cluster: ClusterConfig | None = None):
    pytest.importorskip("megatron.core")
    from rlbench.backends.megatron import MegatronConfig

    return tiny_cfg(workdir).replace(train_backend="megatron", megatron=MegatronConfig(tensor_model_parallel_size=tp),
                                     cluster=cluster or ClusterConfig())


@pytest.fixture(scope="module")
def megatron_local_history(ray_cluster, tmp_path_factory):
    """The single-process megatron (TP1) curve, in a child process: megatron's CPU redirect and parallel state
    stay out of this one."""
    import json
    import subprocess

    workdir = str(tmp_path_factory.mktemp("megatron_local"))
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_ray as t; from rlbench.rewards import REWARDS; "
            "from rlbench import Trainer; REWARDS['ray_digits'] = t.digit_reward; "
            f"tr = Trainer(t.megatron_cfg({workdir!r})); print('HISTORY', json.dumps(tr.fit()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("HISTORY "))[8:])


@pytest.mark.parametrize("tp, colocate", [(2, True), (1, False)])
def test_megatron_on_ray_matches_single_process(ray_cluster, megatron_local_history, tmp_path, tp, colocate):
    """`train_backend="megatron"` in the trainer actors: TP2 on 2 colocated ranks (both ranks train the same
    samples; each pushes the TP-gathered HF weights to its own engine) and TP1 x DP2 disaggregated (gloo broadcast
    to one engine) give the single-process megatron curve; every sync is verified on the engines, and the engine's
    weights after the last step are bit for bit the HF export of the same step."""
    from safetensors.torch import load_file

    from rlbench.orchestration.ray_trainer import RayTrainer
    from rlbench.weights import checksum

    cluster = ClusterConfig(backend="ray", actor_num_gpus_per_node=2, timeout_s=180, colocate=colocate,
                            rollout_num_gpus=None if colocate else 1)
    trainer = RayTrainer(megatron_cfg(str(tmp_path), tp, cluster))
    try:
        assert trainer.cluster.dp_ranks == ([0, 0] if tp == 2 else [0, 1])
        history = trainer.fit()
        trainer.cluster.call_trainers("export_hf", str(tmp_path / "hf"), "float32")
        exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
        on_engines = trainer.cluster.call_engines("checksums", sorted(exported))
    finally:
        trainer.close()
    assert_same_curve(history, megatron_local_history, mismatch_abs_tol=1e-5)  # TP splits the GEMM reductions
    assert len(on_engines) == (2 if colocate else 1)
    for got in on_engines:
        assert got == {n: checksum(t) for n, t in exported.items() if n in got}
        assert set(exported) - set(got) <= {"lm_head.weight"}  # tied to the embedding: the engine names it once


def ppo_cfg(workdir: str):
    """PPO with a critic and adaptive KL-in-reward on tiny_cfg's run."""
    cfg = tiny_cfg(workdir)
    return cfg.replace(backend=replace(cfg.backend, ref_model="tiny"),
                       loss=replace(cfg.loss, advantage_estimator="gae", normalize_advantages=True, lambd=0.95,
                                    kl_coef=0.05, kl_ctl_type="adaptive", kl_target=1e-3, kl_horizon=100.0))


def test_ppo_with_a_critic_on_ray_matches_single_process(ray_cluster, tmp_path):
    """Both ranks build the critic and run the same RankStep: values, GAE whitened over DP, the critic's update,
    the KL controller's β: the curve of one process (critic/* included); save / load carry the critic."""
    import torch.distributed as dist

    from rlbench import Trainer
    from rlbench.orchestration.ray_trainer import RayTrainer

    was_init = dist.is_initialized()
    local = Trainer(ppo_cfg(str(tmp_path / "local")))
    ref = local.fit()
    local.close()
    if not was_init and dist.is_initialized():
        dist.destroy_process_group()
    trainer = RayTrainer(ppo_cfg(str(tmp_path / "ray")), cluster=ClusterConfig(
        backend="ray", actor_num_gpus_per_node=2, colocate=True, timeout_s=120))
    try:
        got = trainer.fit()
        path = trainer.save(str(tmp_path / "ckpt"))
        assert trainer.load(path) == STEPS and os.path.isdir(os.path.join(path, f"iter_{2 * STEPS:07d}", "critic"))
    finally:
        trainer.close()
    assert_same_curve(got, ref)
    for step, (g, r) in enumerate(zip(got, ref)):
        keys = [k for k in r if k.startswith("critic/") or k in ("rollout/kl_coef", "rollout/reward_kl")]
        assert "critic/vf_loss" in keys and "critic/values_mean" in keys and r["critic/grad_norm"] > 0
        for k in keys:
            assert math.isclose(g[k], r[k], rel_tol=1e-4, abs_tol=1e-6), f"step {step} {k}: ray {g[k]} local {r[k]}"
    assert ref[-1]["rollout/kl_coef"] != ref[0]["rollout/kl_coef"]  # the adaptive β moved, on both
