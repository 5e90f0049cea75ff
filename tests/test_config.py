"""RunConfig validation: every cross-field rule raises one clear ValueError naming the values and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from rlbench.configs import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    EvalConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TorchEngineConfig,
    TrainConfig,
    WeightSyncConfig,
)
from rlbench.presets import cpu_demo, cpu_test, qwen3_0p6b_gpu


def _cfg(**sections) -> RunConfig:
    base = dict(
        data=DataConfig(path="x.jsonl"),
        backend=TrainConfig(model="tiny", device="cpu", param_dtype="fp32"),
        rollout=RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=4),
        batch=BatchConfig(global_batch_size=8),
    )
    return RunConfig(**(base | sections))


def test_presets_validate():
    demo, test = cpu_demo(model="small", workdir="runs/x"), cpu_test(model="small")
    for cfg in (demo, test, qwen3_0p6b_gpu(model="qwen3-0.6b-shape", workdir="runs/x")):
        assert cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt % cfg.batch.global_batch_size == 0
    assert demo.optimizer_steps_per_rollout == 2 and test.optimizer_steps_per_rollout == 2
    assert _cfg().optimizer_steps_per_rollout == 2


@pytest.mark.parametrize(
    "sections, match",
    [
        ({"batch": BatchConfig(global_batch_size=12)}, r"rollout_batch_size=4 x n_samples_per_prompt=4 = 16 .* global_batch_size=12"),
        ({"loss": LossConfig(use_kl_loss=True, kl_loss_coef=0.1)}, r"need a reference model; set backend.ref_model"),
        ({"loss": LossConfig(entropy_coef=0.01)}, r"entropy_coef=0.01 needs backend.with_entropy=True"),
        ({"rollout": RolloutConfig(rollout_batch_size=8, n_samples_per_prompt=1)}, r"n_samples_per_prompt=1 gives zero advantages"),
        ({"eval": EvalConfig(interval=2)}, r"eval.interval is set but there is no eval data"),
        ({"batch": BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=16)},
         r"max_tokens_per_gpu=16 cannot hold one sequence of max_response_len=32"),
        ({"data": DataConfig(path="x.jsonl", max_prompt_length=2040)}, r"max_prompt_length=2040 \+ max_response_len=32 exceeds engine.max_seq_len=2048"),
    ],
)
def test_cross_field_rules(sections, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**sections)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: BatchConfig(global_batch_size=6, micro_batch_size=4), r"global_batch_size=6 must be divisible by micro_batch_size=4"),
        (lambda: BatchConfig(use_dynamic_batch_size=True), r"use_dynamic_batch_size=True needs max_tokens_per_gpu"),
        (lambda: LossConfig(use_rollout_logprobs=True, use_tis=True), r"use_rollout_logprobs=True .* use_tis=True .* exclusive"),
        (lambda: LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.1, kl_loss_coef=0.1),
         r"kl_coef=0.1 .* kl_loss_coef=0.1 .* cannot both be non-zero"),
        (lambda: RolloutConfig(dynamic_sampling=True, n_samples_per_prompt=1), r"dynamic_sampling needs n_samples_per_prompt >= 2"),
        (lambda: RolloutConfig(rollout_batch_size=8, over_sampling_batch_size=4), r"over_sampling_batch_size=4 must be >= rollout_batch_size=8"),
        (lambda: EvalConfig(n_samples_per_prompt=2, pass_k=(1, 4)), r"pass_k=\(1, 4\) has k=\[4\] outside \[1, n_samples_per_prompt=2\]"),
        (lambda: CheckpointConfig(save_interval=5), r"save_interval=5 needs save_dir"),
        (lambda: WeightSyncConfig(bucket_bytes=10), r"bucket_bytes=10 is below 1 KiB"),
        (lambda: TaskConfig(name="chess"), r"task name='chess'"),
        (lambda: TorchEngineConfig(num_slots=0), r"num_slots=0 must be >= 1"),
    ],
)
def test_component_rules(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_kl_reward_shaping_needs_a_reference_model():
    """KL-in-reward runs on the ranks (`RankStep.advantages_and_returns`): accepted with a reference model."""
    loss = LossConfig(advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True, kl_coef=0.05)
    with pytest.raises(ValueError, match=r"kl_coef=0.05 need a reference model; set backend.ref_model"):
        _cfg(loss=loss, backend=TrainConfig(model="tiny", device="cpu"))
    cfg = _cfg(loss=loss, backend=TrainConfig(model="tiny", device="cpu", ref_model="tiny"))
    assert cfg.loss.kl_coef == 0.05 and cfg.backend.critic is None


def test_gae_builds_a_critic_and_refuses_one_nothing_reads():
    cfg = _cfg(loss=LossConfig(advantage_estimator="gae"), backend=TrainConfig(model="tiny", device="cpu"))
    assert cfg.backend.critic == CriticConfig()  # slime: the estimator implies the critic
    critic = TrainConfig(model="tiny", device="cpu", critic=CriticConfig(lr=1e-5))
    assert _cfg(loss=LossConfig(advantage_estimator="gae"), backend=critic).backend.critic.lr == 1e-5
    with pytest.raises(ValueError, match=r"advantage_estimator='grpo' reads no values; use advantage_estimator='gae'"):
        _cfg(backend=critic)
    with pytest.raises(ValueError, match=r"advantage_estimator='ppo' is called 'gae'"):
        LossConfig(advantage_estimator="ppo")
    with pytest.raises(ValueError, match=r"--train-backend megatron: the critic runs on the FSDP backend only"):
        _cfg(loss=LossConfig(advantage_estimator="gae"), backend=TrainConfig(model="tiny", device="cpu"),
             train_backend="megatron")
    with pytest.raises(ValueError, match=r"context_parallel_size=2: the value head has no CP path"):
        TrainConfig(model="tiny", device="cpu", cp_size=2, critic=CriticConfig())
    optim = TrainConfig(model="tiny", device="cpu", critic=CriticConfig(lr=1e-7, lr_warmup_iters=3),
                        optim=OptimConfig(lr=1e-6, min_lr=5e-7)).critic_optim
    assert (optim.lr, optim.min_lr, optim.warmup_steps) == (1e-7, 1e-7, 3)  # min_lr capped at the critic's lr


def test_replace_revalidates():
    cfg = _cfg()
    with pytest.raises(ValueError, match="global_batch_size=5"):
        cfg.replace(batch=dataclasses.replace(cfg.batch, global_batch_size=5))


def test_local_backend_refuses_disaggregated():
    with pytest.raises(ValueError, match=r"backend='local' runs one colocated process .* set cluster.backend='ray'"):
        ClusterConfig(colocate=False)
