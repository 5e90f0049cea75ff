"""Named run configurations: functions returning a validated `RunConfig`.

    cfg = rlbench.presets.cpu_demo()                 # what `make run` trains (builds the SFT warm start once)
    cfg = rlbench.presets.cpu_test(model=sft_dir)    # seconds per step, for tests and notebooks
    cfg = rlbench.presets.qwen3_0p6b_gpu(model=dir)  # one H200, colocated
    cfg = rlbench.presets.cuda_demo()                # `rlbench demo --device cuda` (builds its GPU warm start once)
    cfg = rlbench.presets.quickstart(model=hf_dir, data="mine.jsonl")  # no preset: sizes from device and data

Change a field with `dataclasses.replace` on the section (`cfg.replace(batch=replace(cfg.batch, num_rollout=5))`).

What is built once and reused (the demo's SFT warm start, generated task data) lives in the user cache
(`cache_dir()`: $RLBENCH_CACHE, else $XDG_CACHE_HOME/rlbench, else ~/.cache/rlbench), so the presets work
from any directory. Each run writes its metrics to a fresh `runs/<name>-<time>/` under the current directory
(`new_run_dir`) unless given a `workdir`.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from rlbench.cache import cache_dir, recipe_key
from rlbench.configs import (
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TorchEngineConfig,
    TrainConfig,
)

if TYPE_CHECKING:
    from rlbench.sft import SFTConfig


def new_run_dir(name: str, root: str = "runs") -> str:
    """A run directory `root/name-YYYYmmdd-HHMMSS` that does not exist yet (`-2`, `-3`, ... on a clash).
    Not created here: the metric sinks create it when they first write."""
    base = os.path.join(root, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


# The SFT warm start the demo builds once and reuses: the small preset on arithmetic level 1, a fixed number of
# steps (a stop at the first eval above a target made the start depend on the CPU's rounding), evaluated on the
# demo's 128 eval prompts. The name carries the step count, so a cache from another recipe is not reused.
DEMO_SFT_STEPS = 100
DEMO_SFT_NAME = f"sft-small-arith1-{DEMO_SFT_STEPS}steps"
DEMO_SFT = dict(preset="small", task="arithmetic", task_kwargs={"level": 1}, batch_size=32, eval_every=50,
                num_eval=128, max_steps=DEMO_SFT_STEPS, target_pass_at_1=None)

# SFT on one GPU as `rlbench bench` and tests/test_e2e_gpu.py ran it on the H100 / H200 (bf16 autocast over fp32
# weights, AdamW at 3e-4, 64 sequences a step): the model shape keeps its own 151,936-row embedding, so every GPU
# kernel (the engine's head and sampler, the megakernel, the trainer's chunked log-probs) runs at the verified
# shapes; the tokenizer is the CPU demo's char-level one (128 ids), and the ids above it are never trained on.
GPU_SFT = dict(device="cuda", tokenizer_vocab=False, batch_size=64, lr=3e-4)

# The warm start of `rlbench demo --device cuda` (`cuda_demo`): the Qwen3-0.6B shape from random init on the CPU
# demo's task (1-digit addition, the same 128 eval prompts). It stops at the first eval (every 20 steps, 128
# prompts x 1 sample, s.e. ~0.04) whose sampled pass@1 reaches 0.3, at most 400 steps: how fast this shape learns
# level 1 at 3e-4 is not measured (level 3 took 500 steps to 0.19, 2026-12-02), and a fixed count could land near
# 0 or near 1; 0.3 is where the CPU study saw GRPO rise fastest (docs/log/2026-12.md, 2026-12-07, make run).
# Time on one H100, estimated from the 500-step level-3 SFT (66 s on an H200 with one eval and the save): ~0.1 s a
# step at 64 x ~35 tokens, ~1 s an eval (two HF generates of <= 24 tokens on 128 prompts), ~5 s to save 2.4 GB of
# fp32 weights: 20-30 s if it stops at 100-200 steps, ~65 s at the 400-step cap.
DEMO_SFT_CUDA = GPU_SFT | dict(preset="qwen3-0.6b-shape", task="arithmetic", task_kwargs={"level": 1},
                               warmup_steps=20, max_steps=400, eval_every=20, num_eval=128, target_pass_at_1=0.3)
DEMO_SFTS = {"cpu": DEMO_SFT, "cuda": DEMO_SFT_CUDA}
"""The demo's warm start per device (`SFTConfig` fields): `cpu_demo` starts from "cpu", `cuda_demo` from "cuda"."""
DEMO_SFT_TIME = {"cpu": "about 40 s on 2 CPU cores", "cuda": "about 1 min on one H100 (estimated, not yet measured)"}
"""What a first build costs, for the announcement."""


def demo_sft_name(device: str = "cpu") -> str:
    """The cache directory name of the demo's warm start on `device` ("cpu" or "cuda"). The CPU one carries its step
    count (`DEMO_SFT_NAME`); the GPU one the preset, the task and `rlbench.cache.recipe_key` of `DEMO_SFT_CUDA`, so a
    cache from another recipe is never reused."""
    if device not in DEMO_SFTS:
        raise ValueError(f"no demo warm start for device {device!r}; use one of {sorted(DEMO_SFTS)}")
    if device == "cpu":
        return DEMO_SFT_NAME
    spec = DEMO_SFTS[device]
    return f"sft-{spec['preset']}-arith{spec['task_kwargs']['level']}-{device}-{recipe_key(spec)}"


def demo_sft_dir(device: str = "cpu") -> str:
    """The directory of the demo's SFT warm start on `device` in the cache (it may not exist yet: `demo_warm_start`)."""
    return os.path.join(cache_dir(), demo_sft_name(device))


def demo_warm_start(out: str | None = None, max_steps: int | None = None, device: str = "cpu") -> str:
    """The demo's SFT warm start on `device`: `out` (default `demo_sft_dir(device)`) when a finished one is there,
    else trained into it first (`DEMO_SFTS[device]`; announced on stdout with its cost, `DEMO_SFT_TIME`). Returns
    the HF directory.

    The model is trained into a temporary sibling and renamed, so an interrupted build leaves no half model.
    `max_steps` caps the SFT (tests use a few steps; the cap only matters when it is built).
    """
    out = out or demo_sft_dir(device)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out!r} exists but holds no finished model (no config.json); remove it and run again")
    from rlbench.sft import SFTConfig, run_sft

    print(f"[rlbench] SFT warm start -> {out} (built once, {DEMO_SFT_TIME[device]})", flush=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    steps = {"max_steps": max_steps} if max_steps else {}
    run_sft(SFTConfig(**(DEMO_SFTS[device] | steps), out=tmp))
    if os.path.exists(out):
        os.rmdir(out)  # empty (checked above)
    os.replace(tmp, out)
    return out


def gpu_sft(preset: str = "qwen3-0.6b-shape", out: str | None = None, steps: int = 150) -> SFTConfig:
    """A short SFT warm start of a model shape on one GPU (`rlbench bench`, tests/test_e2e_gpu.py): 3-digit
    arithmetic, `steps` AdamW steps at 3e-4 (`GPU_SFT`), the preset's own 152k vocabulary, one pass@1 eval at the
    end."""
    from rlbench.sft import SFTConfig

    return SFTConfig(**GPU_SFT, preset=preset, task="arithmetic", task_kwargs={"level": 3}, out=out,
                     warmup_steps=max(1, steps // 10), max_steps=steps, eval_every=steps, target_pass_at_1=None)


def _task_run(model: str, task: TaskConfig, *, device: str, param_dtype: str, workdir: str, **sections) -> RunConfig:
    """A GRPO run on a synthetic task; `sections` override whole sections."""
    rollout = sections.pop("rollout", RolloutConfig())
    backend = TrainConfig(model=model, device=device, param_dtype=param_dtype, seed=task.seed, optim=sections.pop("optim", OptimConfig()))
    parts = dict(
        data=DataConfig(path=task.train_path, input_key="prompt", label_key="label", seed=rollout.seed),
        backend=backend,
        rollout=rollout,
        task=task,
        logging=LoggingConfig(jsonl_path=os.path.join(workdir, "metrics.jsonl")),
        checkpoint=CheckpointConfig(),
    )
    return RunConfig(**(parts | sections))


def cpu_demo(model: str | None = None, workdir: str | None = None, *, seed: int = 0) -> RunConfig:
    """GRPO on 1-digit arithmetic from the SFT-warmed `small` model (`make run`): 60 steps, ~3 s each on 2 CPU cores.

    Args:
        model: HF directory or model preset; None: the demo's warm start (`demo_warm_start()`, built on first use).
        workdir: where the metrics go (`metrics.jsonl`); None: a fresh `new_run_dir("demo")`.
        seed: the RL's sampling seeds and prompt order (`rollout.seed`, `data.seed`). The warm start, the eval
            prompts and the eval draws are the same for every seed: seeds compare RL runs from one start.

    The eval prompts are the SFT's held-out split (`DEMO_SFT` uses the same task, level, n_eval, seed); the task
    files are generated once into the cache.
    """
    model = model or demo_warm_start()
    workdir = workdir or new_run_dir("demo")
    task = TaskConfig(name="arithmetic", level=1, n_eval=DEMO_SFT["num_eval"], out_dir=os.path.join(cache_dir(), "data"))
    return _task_run(
        model, task, device="cpu", param_dtype="fp32", workdir=workdir,
        rollout=RolloutConfig(rollout_batch_size=16, n_samples_per_prompt=8, max_response_len=12, temperature=1.0,
                              seed=seed),
        batch=BatchConfig(global_batch_size=64, use_dynamic_batch_size=True, max_tokens_per_gpu=1024, num_rollout=60),
        loss=LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28),
        # At 2e-4 Adam's first, sign-sized step moved the policy by a KL of 0.05 and held-out pass@8 collapsed
        # within 20 steps; 1e-4 rose in every seed measured (docs/log/2026-12.md, 2026-12-07, make run).
        optim=OptimConfig(lr=1e-4, betas=(0.9, 0.98), clip_grad=1.0),
        engine=TorchEngineConfig(max_seq_len=48, num_slots=128),
        eval=EvalConfig(interval=20, n_samples_per_prompt=8, pass_k=(1, 8), temperature=1.0),
    )


def cpu_test(model: str | None = None, workdir: str = "runs/test", *, level: int = 3, seed: int = 0,
             n_eval: int = 64) -> RunConfig:
    """A smaller, faster version of `cpu_demo` for tests and notebooks (seconds per step).

    `model` None: the demo's warm start (`demo_warm_start()`, built on first use).

    `seed` changes the sampling seeds (rollout and eval) and the prompt order, not the task split.
    """
    model = model or demo_warm_start()
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


def cpu_vlm_shapes(model: str, data: str, eval_data: str, workdir: str = "runs/vlm-shapes", *, seed: int = 0,
                   num_rollout: int = 30) -> RunConfig:
    """GRPO of a tiny VLM on the synthetic shapes task (`rlbench.data.shapes`) on a CPU: 8 prompts x 8 samples per
    rollout, one optimizer step each at lr 6e-4, exact-match reward, held-out pass@1 at temperature 1 every 5.

    Args:
        model: the HF directory of a VLM warm start (`rlbench.vlm_sft.shapes_warm_start`).
        data, eval_data: the task's train and held-out jsonl (`write_shapes_task`).
        seed: the rollout sampling seed and the prompt order.

    About 1.5 s a rollout on 2 CPU cores for tiny-vl at 28 x 28 (4 image tokens; prompts are 32 tokens).
    """
    return RunConfig(
        data=DataConfig(path=data, seed=seed),
        backend=TrainConfig(model=model, device="cpu", param_dtype="fp32", seed=seed,
                            optim=OptimConfig(lr=6e-4, betas=(0.9, 0.98), clip_grad=1.0)),
        rollout=RolloutConfig(rollout_batch_size=8, n_samples_per_prompt=8, max_response_len=8, temperature=1.0,
                              rm_type="exact", seed=seed),
        batch=BatchConfig(global_batch_size=64, use_dynamic_batch_size=True, max_tokens_per_gpu=1024,
                          num_rollout=num_rollout),
        loss=LossConfig(advantage_estimator="grpo"),
        engine=TorchEngineConfig(max_seq_len=48, num_slots=64),
        eval=EvalConfig(interval=5, data_path=eval_data, n_samples_per_prompt=4, pass_k=(1, 4), temperature=1.0),
        logging=LoggingConfig(jsonl_path=os.path.join(workdir, "metrics.jsonl"), console=False),
    )


def qwen3_0p6b_gpu(model: str, workdir: str | None = None, *, num_rollout: int = 4) -> RunConfig:
    """The Qwen3-0.6B shape on one H200, colocated: rbs 32 x n 8 = 256 samples, gbs 128, bf16, dynamic batches.

    `workdir` None: a fresh `new_run_dir("qwen3-0.6b")`; the task files are generated once into the cache.
    """
    workdir = workdir or new_run_dir("qwen3-0.6b")
    task = TaskConfig(name="arithmetic", level=3, out_dir=os.path.join(cache_dir(), "data"))
    return _task_run(
        model, task, device="cuda", param_dtype="bf16", workdir=workdir,
        rollout=RolloutConfig(rollout_batch_size=32, n_samples_per_prompt=8, max_response_len=64, temperature=1.0),
        batch=BatchConfig(global_batch_size=128, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                          num_rollout=num_rollout),
        loss=LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28),
        optim=OptimConfig(lr=1e-6, betas=(0.9, 0.98), weight_decay=0.1),
        engine=TorchEngineConfig(max_seq_len=256),
        eval=EvalConfig(interval=2, n_samples_per_prompt=4, pass_k=(1, 4), temperature=1.0),
    )


# GRPO steps of `cuda_demo`. Time on one H100, estimated from the 0.6B-shape loop measured there (docs/LOG.md: a
# 1.4 s step at 64 x (510 + 256) tokens, rollout 0.74 s for 256 decode steps; first step 34 s, 22 s of it compile):
# here 256 samples of ~35 tokens, so a rollout of ~16 decode steps ~0.2 s, two optimizer steps on ~4.5k tokens
# ~0.4 s, the sync ~0.1 s: ~0.8 s a step, 100 steps ~80 s; 11 evals of 1,024 samples ~1.5 s each ~15 s; the engine
# and layer compiles ~40-60 s cold (the first rollout and the first packs of each new bucketed length). With the
# build (~15 s) and the SFT (~20-65 s): ~3-4 min cold, ~2 min once the warm start and compile caches exist.
CUDA_DEMO_STEPS = 100


def cuda_demo(model: str | None = None, workdir: str | None = None, *, seed: int = 0) -> RunConfig:
    """`rlbench demo --device cuda`: the CPU demo's task and evaluation at the Qwen3-0.6B shape on one GPU, as
    `qwen3_0p6b_gpu` runs it (colocated, bf16, compiled engine and layers, 32 prompts x 8 samples, two optimizer
    steps of 128 per rollout) for 100 GRPO steps at lr 2e-5, evaluated every 10 (128 prompts x 8 samples).

    Args:
        model: HF directory; None: the GPU warm start (`demo_warm_start(device="cuda")`, built on first use).
        workdir: where the metrics go; None: a fresh `new_run_dir("demo-cuda")`.
        seed: the RL's sampling seeds and prompt order, as in `cpu_demo` (warm start and eval draws are shared).
    """
    model = model or demo_warm_start(device="cuda")
    base = qwen3_0p6b_gpu(model, workdir or new_run_dir("demo-cuda"), num_rollout=CUDA_DEMO_STEPS)
    task = TaskConfig(name="arithmetic", level=1, n_eval=DEMO_SFT_CUDA["num_eval"],
                      out_dir=os.path.join(cache_dir(), "data"))
    return base.replace(
        task=task,
        data=replace(base.data, path=task.train_path, seed=seed),
        # 1-digit answers are `\boxed{N}` + <|im_end|>, 9-10 tokens: 16 leaves room without long truncated tails
        rollout=replace(base.rollout, max_response_len=16, seed=seed),
        # The CPU demo's lr 1e-4 (its SFT's last lr; 2e-4 collapsed) scaled by the two shapes' SFT lrs (small 1e-3,
        # this shape 3e-4, taken as equally effective per step: not measured) is ~3e-5, so ~6e-5 would collapse;
        # 2e-5 keeps a 3x margin. A wider layer moves its output more per Adam step (fan-in 1024 / 3072 against
        # 256 / 768), which points the same way. The warm-up keeps Adam's first, sign-sized steps small.
        backend=replace(base.backend, optim=OptimConfig(lr=2e-5, betas=(0.9, 0.98), clip_grad=1.0, warmup_steps=10)),
        eval=EvalConfig(interval=10, n_samples_per_prompt=8, pass_k=(1, 8), temperature=1.0),
    )


QUICKSTART_MAX_RESPONSE_LEN = {"cpu": 64, "cuda": 512}
"""Default new tokens per response of `quickstart`, by device."""


def quickstart(model: str, data: str, *, eval_data: str | None = None, workdir: str | None = None,
               device: str | None = None, input_key: str = "prompt", label_key: str = "label",
               max_prompt_len: int | None = None, max_response_len: int | None = None,
               max_seq_len: int | None = None, prompt_len: int | None = None) -> RunConfig:
    """GRPO on your HF model directory and your prompt file, without a preset (`rlbench quickstart`).

    Args:
        model: a Hugging Face model directory (config.json, weights, tokenizer files).
        data: training rows (.jsonl/.parquet) with `input_key` (the prompt) and `label_key` (the answer).
        eval_data: held-out rows with the same keys, evaluated every 5 rollouts; None: no evaluation.
        workdir: where the metrics go; None: a fresh `new_run_dir("quickstart")`.
        device: "cuda" or "cpu"; None: cuda when available. bf16 parameters on cuda, fp32 on cpu.
        max_prompt_len: drop longer prompts (tokens); None keeps all.
        max_response_len: new tokens per response; None: `QUICKSTART_MAX_RESPONSE_LEN[device]`.
        max_seq_len: the engine's sequence length; None: the longest prompt of `data` (and of `eval_data`)
            in the model's tokens (or `max_prompt_len`) + `max_response_len`, rounded up to 16.
        prompt_len: that longest prompt when the caller has measured it already (`quickstart_prompt_len`, as
            `rlbench quickstart` does to explain the choice); None: measured here when `max_seq_len` needs it.

    The reward is `exact`: the last `\\boxed{}` content (or the whole response) equals the label.
    """
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    workdir = workdir or new_run_dir("quickstart")
    max_response_len = max_response_len or QUICKSTART_MAX_RESPONSE_LEN[device]
    data_cfg = DataConfig(path=data, input_key=input_key, label_key=label_key, max_prompt_length=max_prompt_len)
    if max_seq_len is None:
        prompt_len = max_prompt_len or prompt_len or quickstart_prompt_len(model, data, eval_data,
                                                                           input_key=input_key, label_key=label_key)
        max_seq_len = prompt_len + max_response_len
    gpu = device == "cuda"
    rollout = RolloutConfig(rollout_batch_size=32 if gpu else 4, n_samples_per_prompt=8 if gpu else 4,
                            max_response_len=max_response_len, rm_type="exact", temperature=1.0)
    return RunConfig(
        data=data_cfg,
        backend=TrainConfig(model=model, device=device, param_dtype="bf16" if gpu else "fp32", optim=OptimConfig(lr=1e-6 if gpu else 1e-5, betas=(0.9, 0.98), clip_grad=1.0)),
        rollout=rollout,
        batch=BatchConfig(global_batch_size=128 if gpu else 16, use_dynamic_batch_size=True,
                          max_tokens_per_gpu=max(16384 if gpu else 1024, max_seq_len), num_rollout=10),
        loss=LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28),
        engine=TorchEngineConfig(max_seq_len=max_seq_len),
        eval=EvalConfig(interval=5 if eval_data else None, data_path=eval_data, n_samples_per_prompt=1),
        logging=LoggingConfig(jsonl_path=os.path.join(workdir, "metrics.jsonl")),
    )


def quickstart_prompt_len(model: str, data: str, eval_data: str | None = None, *, input_key: str = "prompt",
                          label_key: str = "label") -> int:
    """The longest prompt of `data` and `eval_data` in `model`'s tokens, as `quickstart` renders them."""
    data_cfg = DataConfig(path=data, input_key=input_key, label_key=label_key)
    return max(longest_prompt(model, data_cfg, path) for path in (data, eval_data) if path)


def longest_prompt(model: str, data: DataConfig, path: str) -> int:
    """Tokens of the longest prompt in `path` as the run renders it (`data`'s keys, chat template and image key,
    `model`'s tokenizer; a vision-language model's image placeholders expanded by its processor to the tokens the
    engine holds). The whole file is validated on the way (`PromptDataset`: every bad line at once)."""
    from rlbench.data.datasets import PromptDataset
    from rlbench.models import load_tokenizer
    from rlbench.models.vlm import load_processor

    tokenizer = load_tokenizer(model)
    dataset = PromptDataset(DataConfig(path=path, input_key=data.input_key, label_key=data.label_key,
                                       apply_chat_template=data.apply_chat_template, image_key=data.image_key),
                            tokenizer, load_processor(model, tokenizer))
    return max(len(item.prompt_token_ids) for item in dataset.items)
