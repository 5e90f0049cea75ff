"""Single-process composition: build every part of a run (tokenizer, datasets, train backend, rollout engine,
rollout manager, weight sync) and the local Trainer over them.

This is the only place that names concrete classes (`FSDPBackend` / `MegatronBackend`, `TorchEngine`); the Trainer receives
the built `Components` and talks to them through their protocols.

    trainer = LocalTrainer(cfg)        # = rlbench.Trainer(cfg): build_run(cfg), then the Trainer
    cfg, parts = build_run(cfg)        # or build (or fake) the parts yourself: cfg as the memory plan sized it
    trainer = LocalTrainer(cfg, components=parts)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from rlbench.configs import RunConfig, SGLangEngineConfig, TaskConfig
from rlbench.data import PromptDataset, build_tokenizer, write_jsonl
from rlbench.models import build_config, load_tokenizer
from rlbench.models.build import materialize, params_on_meta
from rlbench.models.vlm import auto_model_class, is_vlm_config, load_processor
from rlbench.rewards import get_reward_fn
from rlbench.rollout.manager import RolloutManager
from rlbench.rollout.reward_pool import default_workers as default_reward_workers
from rlbench.trainer import Components, Trainer, prepare_run
from rlbench.weights import WeightSync


class LocalTrainer(Trainer):
    """The one-process Trainer built from its config: `rlbench.Trainer(cfg)`, the REPL and notebook entry.

    Args:
        cfg: the run config (`cfg.cluster.backend == "local"`; `rlbench.build_trainer(cfg)` builds any backend).
        components: pre-built parts; None builds them with `build_components(cfg)`.
        sinks: metric sinks; None builds them from `cfg.logging`.
    """

    def __init__(self, cfg: RunConfig, *, components: Components | None = None, sinks=None) -> None:
        if cfg.cluster.backend != "local":
            raise ValueError(
                f"Trainer runs cluster.backend='local', got {cfg.cluster.backend!r}; build the trainer with "
                "rlbench.build_trainer(cfg), which picks the class of cfg.cluster.backend"
            )
        if components is None:
            cfg, components = build_run(cfg)
        super().__init__(cfg, components, sinks=sinks)


def materialize_task(task: TaskConfig) -> tuple[str, str]:
    """Write the task's train/eval jsonl files if they are missing; returns their paths.

    The split is `rlbench.sft.split_rows`: with the same (task, level, n_train, n_eval, seed) as the SFT
    warm start, the eval prompts are exactly the SFT's held-out prompts, and no eval prompt is in either
    training set.
    """
    from rlbench.sft import SFTConfig, split_rows

    if not (os.path.isfile(task.train_path) and os.path.isfile(task.eval_path)):
        kwargs = {"level": task.level} if task.name == "arithmetic" and task.level is not None else {}
        sft = SFTConfig(task=task.name, task_kwargs=kwargs, num_train=task.n_train, num_eval=task.n_eval, seed=task.seed)
        train_rows, eval_rows = split_rows(sft)
        write_jsonl(train_rows, task.train_path)
        write_jsonl(eval_rows, task.eval_path)
    return task.train_path, task.eval_path


def build_tokenizer_for(model: str, overrides: dict | None = None):
    """The tokenizer saved in an HF directory, or for a preset name the char-level tokenizer padded to the preset's
    vocabulary (so every id a randomly initialised 152k-vocabulary shape samples decodes)."""
    if os.path.isdir(model):
        return load_tokenizer(model)
    config = hf_config_for(model, overrides or {})
    return build_tokenizer(config.get_text_config().vocab_size, vision=is_vlm_config(config))


def hf_config_for(model: str, overrides: dict) -> PretrainedConfig:
    """HF config of a model directory or preset (the engine is built with the same architecture)."""
    return AutoConfig.from_pretrained(model) if os.path.isdir(model) else build_config(model, **overrides)


def build_engine(cfg: RunConfig, device: torch.device, tokenizer):
    """The torch engine over an uninitialised copy of the architecture (the Trainer's first weight sync fills it),
    in `engine.dtype` (None: the backend's param dtype). Its buffers (rotary `inv_freq`) are computed on the CPU,
    like the trainer's, so both sides apply the same RoPE. `rollout_engine="sglang"`: an `sglang.Engine` loading
    `sglang.model_path` (None: the trainer's model directory)."""
    if cfg.rollout_engine == "sglang":
        from rlbench.engine.sglang_engine import SGLangEngine

        return SGLangEngine(sglang_config(cfg))
    from rlbench.configs.backend import PARAM_DTYPES
    from rlbench.engine.torch_engine import TorchEngine

    hf_config = hf_config_for(cfg.backend.model, cfg.backend.model_overrides)
    dtype = getattr(torch, PARAM_DTYPES[cfg.engine.dtype]) if cfg.engine.dtype else cfg.backend.torch_param_dtype
    with params_on_meta():
        model = auto_model_class(hf_config).from_config(hf_config, dtype=dtype)
    model = materialize(model, device)
    return TorchEngine(model, engine_config(cfg, device), tokenizer=tokenizer)


def engine_config(cfg: RunConfig, device: torch.device):
    """`cfg.engine` sized for the run when `num_slots` is None: a CPU gets one slot per sample of a rollout round; a
    GPU sizes its cache from free memory (`mem_fraction`) but at most to that many slots, so the memory a rollout
    never fills stays free for training (and the memory plan need not offload for it)."""
    engine_cfg = cfg.engine
    if engine_cfg.num_slots is not None:
        return engine_cfg
    if device.type == "cpu":
        return dataclasses.replace(engine_cfg, num_slots=rollout_slots(cfg))
    return dataclasses.replace(engine_cfg, max_slots=rollout_slots(cfg))


def sglang_config(cfg: RunConfig) -> SGLangEngineConfig:
    """`cfg.sglang` with its model directory filled in (`sglang.model_path`, else the trainer's `backend.model`)."""
    return dataclasses.replace(cfg.sglang, model_path=cfg.sglang.model_path or cfg.backend.model)


def rollout_slots(cfg: RunConfig) -> int:
    """Slots that decode one rollout round's samples at once (at most `engine.max_slots`): on a CPU a decode
    step's cost is per row plus a fixed part, so the fewer the steps, the shorter the rollout; on a GPU more
    slots than this are never filled by the loop (eval rounds larger than this run in waves)."""
    return min(cfg.engine.max_slots, cfg.rollout.prompts_per_round * cfg.rollout.n_samples_per_prompt)


def build_backend(cfg: RunConfig, env=None):
    """The training backend of `cfg.train_backend` (FSDP, with its critic when `backend.critic` is set, or
    megatron-core), initialised (process group, model(s), optimizer(s)); log-probs at the sampling temperature. `env`: a process group set up by the caller (a Ray trainer
    rank's `DistEnv`); None: the backend makes one (torchrun's environment or a world of one)."""
    backend_cfg = cfg.backend
    if cfg.checkpoint.save_dir and not backend_cfg.checkpoint_dir:
        backend_cfg = dataclasses.replace(backend_cfg, checkpoint_dir=cfg.checkpoint.save_dir)
    if cfg.train_backend == "megatron":
        from rlbench.backends.megatron.backend import MegatronBackend

        backend = MegatronBackend(backend_cfg, cfg.megatron, env=env, temperature=cfg.rollout.temperature)
    elif backend_cfg.critic is not None:  # PPO: the actor backend that owns the critic
        from rlbench.backends.fsdp.critic import FSDPActorCritic

        backend = FSDPActorCritic(backend_cfg, env=env, temperature=cfg.rollout.temperature)
    else:
        from rlbench.backends.fsdp.actor import FSDPBackend

        backend = FSDPBackend(backend_cfg, env=env, temperature=cfg.rollout.temperature)
    backend.init()
    return backend


def build_data(cfg: RunConfig) -> tuple[Any, PromptDataset, list]:
    """The driver-side data of a run: `(tokenizer, training prompts, eval items)`, lengths and per-row rewards
    checked."""
    eval_path = cfg.eval.data_path
    if cfg.task is not None:
        _, task_eval = materialize_task(cfg.task)
        eval_path = eval_path or task_eval
    tokenizer = build_tokenizer_for(cfg.backend.model, getattr(cfg.backend, "model_overrides", None))
    processor = load_processor(cfg.backend.model, tokenizer)
    dataset = PromptDataset(cfg.data, tokenizer, processor)
    eval_items = []
    if cfg.eval.interval is not None:
        eval_cfg = dataclasses.replace(cfg.data, path=eval_path, shuffle=False)
        eval_items = PromptDataset(eval_cfg, tokenizer, processor).items[: cfg.eval.max_prompts]
    check_lengths(cfg, dataset.items + eval_items)
    check_row_rewards(dataset.items + eval_items)
    return tokenizer, dataset, eval_items


def build_rollouts(cfg: RunConfig, engine, dataset, tokenizer, device: torch.device | str = "cpu") -> RolloutManager:
    """The rollout manager over `engine` (reward worker processes: `rollout.reward_workers`, None: by device), with
    the reward model of `rollout.reward_model` on `rollout.reward_model_device`, else on `device` (the engine's)."""
    workers = cfg.rollout.reward_workers
    return RolloutManager(cfg.rollout, engine, dataset, tokenizer, reward_workers=(
        default_reward_workers(cfg.backend.device) if workers is None else workers),
        reward_model=build_reward_model(cfg, device))


def build_reward_model(cfg: RunConfig, device: torch.device | str):
    """The `RewardModel` of `rollout.reward_model` (None when unset), announced with its version."""
    path = cfg.rollout.reward_model
    if path is None:
        return None
    from rlbench.reward_model.serve import RewardModel

    rm = RewardModel(path, device=cfg.rollout.reward_model_device or device)
    if cfg.logging.console:
        print(f"[rlbench] reward model {path} version {rm.version} on {rm.device}", flush=True)
    return rm


def build_run(cfg: RunConfig) -> tuple[RunConfig, Components]:
    """`cfg` with the start-up memory plan's decisions filled in (`rlbench.memory_start`: made after the data is
    read, before any weights load; printed on CUDA), and the parts built from it."""
    prepare_run(cfg)
    data = build_data(cfg)
    plan = start_plan(cfg, data[1])
    if plan is not None:
        cfg = plan.config
        if cfg.logging.console and plan.choice is not None:
            print("\n".join(f"[rlbench] {line}" for line in plan.lines()), flush=True)
    return cfg, build_components(cfg, data=data, start_plan=plan)


def start_plan(cfg: RunConfig, dataset):
    """The start-up memory plan of a one-process run (None where it does not apply: the megatron backend, an
    SGLang engine, both of which manage their own memory). Raises `ValueError` when nothing fits."""
    if cfg.train_backend != "fsdp" or cfg.rollout_engine != "torch":
        return None
    from rlbench.memory_start import device_memory, plan_at_start

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cfg.backend.device == "cuda" else (
        torch.device("cpu"))
    shortest = min((len(it.prompt_token_ids) for it in dataset.items), default=None)
    return plan_at_start(cfg, hf_config_for(cfg.backend.model, cfg.backend.model_overrides), device_memory(device),
                         shortest_prompt=shortest, world=int(os.environ.get("WORLD_SIZE", 1)))


def build_components(cfg: RunConfig, *, data=None, start_plan=None) -> Components:
    """Everything a `Trainer` needs for `cfg`, in this process (seeded first: `prepare_run`). `data`: the
    `build_data(cfg)` triple when already read (then the caller seeded); `start_plan`: the plan that sized `cfg`."""
    if data is None:
        prepare_run(cfg)
        data = build_data(cfg)
    tokenizer, dataset, eval_items = data
    backend = build_backend(cfg)
    device = backend.env.device
    engine = build_engine(cfg, device, tokenizer)
    model = getattr(engine, "model", None) or backend.model  # an SGLang engine holds no torch model here
    num_params = sum(p.numel() for p in model.parameters())
    return Components(tokenizer, dataset, eval_items, backend, engine,
                      build_rollouts(cfg, engine, dataset, tokenizer, device),
                      WeightSync(cfg.weights, backend, engine), device, num_params, start_plan)


def check_row_rewards(items) -> None:
    """Resolve every per-row `metadata["rm_type"]` of the data now, not at the first rollout."""
    names = {it.metadata.get("rm_type") for it in items if isinstance(getattr(it, "metadata", None), dict)}
    for name in sorted(n for n in names if n):
        try:
            get_reward_fn(name)
        except ValueError as exc:
            raise ValueError(f"the data's metadata rm_type={name!r}: {exc}") from exc


def check_lengths(cfg: RunConfig, items: list) -> None:
    """Every prompt + the response budget must fit the engine's sequence length."""
    longest = max(len(it.prompt_token_ids) for it in items)
    budget = max(cfg.rollout.max_response_len, cfg.eval.max_response_len or 0)
    if longest + budget > cfg.engine.max_seq_len:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max response ({budget}) exceeds engine.max_seq_len="
            f"{cfg.engine.max_seq_len}; raise max_seq_len or set data.max_prompt_length to drop long prompts"
        )
