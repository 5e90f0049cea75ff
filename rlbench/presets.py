"""Named run configurations: functions returning a validated `RunConfig`.

    cfg = rlbench.presets.cpu_demo()                 # what `make run` trains (after the SFT warm start)
    cfg = rlbench.presets.cpu_test(model=sft_dir)    # seconds per step, for tests and notebooks
    cfg = rlbench.presets.qwen3_0p6b_gpu(model=dir)  # one H200, colocated

Change a field with `dataclasses.replace` on the section (`cfg.replace(batch=replace(cfg.batch, num_rollout=5))`).
"""

from __future__ import annotations

import os

from rlbench.config import (
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    FSDPConfig,
    LoggingConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TorchEngineConfig,
)
from rlbench.sft import SFTConfig

# The SFT warm start `make run` caches and reuses (small preset, arithmetic level 1, 32 held-out prompts).
DEMO_SFT_DIR = os.path.join("runs", "sft-small-arith1")
DEMO_SFT = dict(preset="small", task="arithmetic", task_kwargs={"level": 1}, batch_size=32, eval_every=20,
                num_eval=32, max_steps=600, target_pass_at_1=0.3)


def gpu_sft(preset: str = "qwen3-0.6b-shape", out: str | None = None, steps: int = 150) -> SFTConfig:
    """A short SFT warm start of a model shape on one GPU (`rlbench bench`, tests/test_e2e_gpu.py): 3-digit
    arithmetic, `steps` AdamW steps at 3e-4, the preset's own 152k vocabulary, one pass@1 eval at the end."""
    return SFTConfig(preset=preset, task="arithmetic", task_kwargs={"level": 3}, out=out, device="cuda",
                     tokenizer_vocab=False, batch_size=64, lr=3e-4, warmup_steps=max(1, steps // 10),
                     max_steps=steps, eval_every=steps, target_pass_at_1=None)


def _task_run(model: str, task: TaskConfig, *, device: str, param_dtype: str, workdir: str, **sections) -> RunConfig:
    """A GRPO run on a synthetic task; `sections` override whole sections."""
    rollout = sections.pop("rollout", RolloutConfig())
    backend = FSDPConfig(
        model=model, device=device, param_dtype=param_dtype, seed=task.seed, optim=sections.pop("optim", OptimConfig()),
    )
    parts = dict(
        data=DataConfig(path=task.train_path, input_key="prompt", label_key="label", seed=rollout.seed),
        backend=backend,
        rollout=rollout,
        task=task,
        logging=LoggingConfig(jsonl_path=os.path.join(workdir, "metrics.jsonl")),
        checkpoint=CheckpointConfig(),
    )
    return RunConfig(**(parts | sections))


def cpu_demo(model: str = DEMO_SFT_DIR, workdir: str = "runs/demo") -> RunConfig:
    """GRPO on 1-digit arithmetic from the SFT-warmed `small` model (`make run`): 60 steps, a few s each on 2 CPU cores.

    The eval prompts are the SFT's held-out split (`DEMO_SFT` below uses the same task, level, n_eval, seed).
    """
    task = TaskConfig(name="arithmetic", level=1, n_eval=32, out_dir="runs/data")
    return _task_run(
        model, task, device="cpu", param_dtype="fp32", workdir=workdir,
        rollout=RolloutConfig(rollout_batch_size=16, n_samples_per_prompt=8, max_response_len=12, temperature=1.0),
        batch=BatchConfig(global_batch_size=64, use_dynamic_batch_size=True, max_tokens_per_gpu=1024, num_rollout=60),
        loss=LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28),
        optim=OptimConfig(lr=2e-4, betas=(0.9, 0.98), clip_grad=1.0),
        engine=TorchEngineConfig(max_seq_len=48, num_slots=128),
        eval=EvalConfig(interval=20, n_samples_per_prompt=8, pass_k=(1, 8), temperature=1.0),
    )


def cpu_test(model: str = DEMO_SFT_DIR, workdir: str = "runs/test", *, level: int = 3, seed: int = 0,
             n_eval: int = 64) -> RunConfig:
    """A smaller, faster version of `cpu_demo` for tests and notebooks (seconds per step).

    `seed` changes the sampling seeds (rollout and eval) and the prompt order, not the task split.
    """
    task = TaskConfig(name="arithmetic", level=level, n_eval=n_eval, out_dir=os.path.join(workdir, "data"))
    return _task_run(
        model, task, device="cpu", param_dtype="fp32", workdir=workdir,
        rollout=RolloutConfig(rollout_batch_size=8, n_samples_per_prompt=8, max_response_len=12, seed=seed),
        batch=BatchConfig(global_batch_size=32, use_dynamic_batch_size=True, max_tokens_per_gpu=1024, num_rollout=10),
        loss=LossConfig(advantage_estimator="grpo"),
        optim=OptimConfig(lr=2e-4, betas=(0.9, 0.98)),
        engine=TorchEngineConfig(max_seq_len=48, num_slots=64),
        eval=EvalConfig(interval=5, max_prompts=64, n_samples_per_prompt=4, pass_k=(1, 4), temperature=1.0),
        logging=LoggingConfig(console=False),
    )


def qwen3_0p6b_gpu(model: str, workdir: str = "runs/qwen3-0.6b", *, num_rollout: int = 4) -> RunConfig:
    """The Qwen3-0.6B shape on one H200, colocated: rbs 32 x n 8 = 256 samples, gbs 128, bf16, dynamic batches."""
    task = TaskConfig(name="arithmetic", level=3, out_dir=os.path.join(workdir, "data"))
    return _task_run(
        model, task, device="cuda", param_dtype="bf16", workdir=workdir,
        rollout=RolloutConfig(rollout_batch_size=32, n_samples_per_prompt=8, max_response_len=64, temperature=1.0),
        batch=BatchConfig(global_batch_size=128, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                          num_rollout=num_rollout),
        loss=LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28),
        optim=OptimConfig(lr=1e-6, betas=(0.9, 0.98), weight_decay=0.1),
        engine=TorchEngineConfig(max_seq_len=256, compile=False),
        eval=EvalConfig(interval=2, n_samples_per_prompt=4, pass_k=(1, 4), temperature=1.0),
        logging=LoggingConfig(),
    )
