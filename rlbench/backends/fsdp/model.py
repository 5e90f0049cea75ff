"""Build an FSDP2-sharded Hugging Face causal LM without materialising it whole on any device.

Order (fixed, torchtitan-style): meta-device construction -> activation checkpointing per decoder layer
-> optional `torch.compile` per layer -> `fully_shard` per layer -> `fully_shard` root -> `to_empty`
-> weights: each rank reads only its own rows of every tensor from the safetensors files
(`safe_open(...).get_slice`), or a world-size-invariant random init from a preset.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForTokenClassification, PretrainedConfig, PreTrainedModel

from rlbench.backends.hf_weights import load_hf_weights, model_config, random_init
from rlbench.configs.backend import TrainConfig
from rlbench.distributed.mesh import DistEnv
from rlbench.models.build import params_on_meta, restore_buffers
from rlbench.models.capabilities import TRUE_ON_POLICY_TRAINER, check_model, trainer
from rlbench.models.value_head import VALUE_HEAD, value_config, zero_head_
from rlbench.models.vlm import auto_model_class, is_vlm_config

_RECOMPILE_LIMIT = 64  # compiled variants kept per decoder-layer code object (grad modes x bucketed pack lengths)
# `torch.compile` kwargs of every decoder layer (tests swap the backend). Static shapes, one graph per pack length T,
# bounded by RankStep padding packs to a few bucketed lengths (`FSDPBackend.pack_buckets`, `bucket_length`): static
# kernels are the flex_attention/BlockMask ones measured and bitwise-checked on the H200. `dynamic=True` also gives
# one graph (CPU/SDPA) but its CUDA flex kernels are untested, and its first compile took 1.7x longer on CPU.
_COMPILE_OPTIONS: dict = {"dynamic": False}


def _compile_options(cfg: TrainConfig) -> dict:
    """`_COMPILE_OPTIONS`, with eager's rounding for the batch-invariant layers (the engine's bits)."""
    if not cfg.batch_invariant or _COMPILE_OPTIONS.get("backend", "inductor") != "inductor":
        return _COMPILE_OPTIONS
    from rlbench import numerics

    extra = _COMPILE_OPTIONS.get("options") or {}
    return _COMPILE_OPTIONS | {"options": {**extra, **numerics.compile_options()}}


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The blocks FSDP shards one by one (HF's `_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} lists no `_no_split_modules`; cannot find its decoder layers")
    return layers


def frozen_prefixes(model: nn.Module, cfg: TrainConfig) -> tuple[str, ...]:
    """Parameter-name prefixes not trained: the vision tower (`cfg.freeze_vision`, the module named `visual`) and
    `cfg.freeze_modules`, each of which must match a parameter."""
    names = [n for n, _ in model.named_parameters()]
    for prefix in cfg.freeze_modules:
        if not any(n.startswith(prefix) for n in names):
            near = sorted({n.rsplit(".", 2)[0] for n in names if n.split(".")[0] == prefix.split(".")[0]})[:3]
            raise ValueError(f"freeze_modules prefix {prefix!r} matches no parameter of {type(model).__name__}; "
                             f"parameter names look like {near or names[:3]}")
    vision = tuple(n + "." for n, _ in model.named_modules() if n.split(".")[-1] == "visual") if cfg.freeze_vision \
        else ()
    return vision + tuple(cfg.freeze_modules)


def freeze(model: nn.Module, cfg: TrainConfig) -> int:
    """Turn off `requires_grad` of the `frozen_prefixes` parameters (the optimizer skips them); returns how many."""
    prefixes = frozen_prefixes(model, cfg)
    frozen = [p for n, p in model.named_parameters() if prefixes and n.startswith(prefixes)]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def _checkpoint_forward(layer: nn.Module) -> None:
    # Checkpoint `forward`, not `__call__`: FSDP's hooks stay outside, so recompute reuses the gathered params.
    forward = layer.forward

    @functools.wraps(forward)
    def forward_with_recompute(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = forward_with_recompute


def with_model_attention(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the attention its model class supports: where the device default (flex_attention on CUDA) was not
    chosen by the user and the model's class has no flex path (Qwen2.5-VL), sdpa, said in one line. A user's explicit
    `attn_implementation` is kept (transformers refuses it with the model's name if unsupported)."""
    if cfg.fsdp.attn_implementation is not None or cfg.attention != "flex_attention":
        return cfg
    hf_config = model_config(cfg.model, cfg.model_overrides)
    cls = auto_model_class(hf_config)._model_mapping[type(hf_config)]
    if getattr(cls, "_supports_flex_attn", True):
        return cfg
    print(f"[rlbench] {cls.__name__} has no flex_attention path in transformers: the trainer uses sdpa "
          "(--attn-implementation to choose)", flush=True)
    return dataclasses.replace(cfg, fsdp=dataclasses.replace(cfg.fsdp, attn_implementation="sdpa"))


def build_sharded_model(
    name: str, cfg: TrainConfig, env: DistEnv, *, offload: bool = False, value_head: bool = False
) -> tuple[PreTrainedModel, PretrainedConfig]:
    """An FSDP2 model on `env.device` (sharded params on CPU when `offload`), weights loaded or random.

    Args:
        name: a local HF directory (weights loaded) or a preset name (random init with `cfg.seed`).
        cfg: sharding/precision/attention options.
        env: the process's mesh; FSDP shards over `env.shard_mesh` (dp x cp flattened).
        offload: FSDP CPUOffloadPolicy (params, grads and optimizer state on CPU).
        value_head: a value model instead of the causal LM (`rlbench.models.value_head`: the same decoder with
            `score`, Linear(hidden, 1) over the last hidden state, transformers' token-classification layout) and no
            LM head. A value-model directory (a saved critic, `rlbench rm`'s output) loads its head; from a
            causal-LM directory or a preset the head starts at zero (`zero_head_`).
    """
    hf_config = model_config(name, cfg.model_overrides)
    check_model(hf_config, trainer(cfg.attention, cfg.cp_size), max_seq_len=None)
    if cfg.batch_invariant:
        check_model(hf_config, TRUE_ON_POLICY_TRAINER, max_seq_len=None)
    hf_config._attn_implementation = cfg.attention
    hf_config.use_cache = False
    if value_head:
        if is_vlm_config(hf_config):
            raise ValueError(f"{hf_config.model_type}: a value model (critic, reward model) of a vision-language model "
                             "is not implemented; train it with a GRPO-family estimator (no critic)")
        hf_config = value_config(hf_config)
    auto = AutoModelForTokenClassification if value_head else auto_model_class(hf_config)
    with params_on_meta():
        model = auto.from_config(hf_config, dtype=torch.float32, attn_implementation=cfg.attention)
    freeze(model, cfg)
    if value_head:  # an exported critic names its class (fully_shard renames the module's)
        hf_config.architectures = [type(model).__name__]
    if cfg.cp_size > 1:  # context parallel: every attention layer reads the forward's rl_cp= context
        from rlbench.distributed.cp_kernels import cp_kernel  # importing the kernel registers its attention

        model.config._attn_implementation = cp_kernel(cfg.fsdp.cp_attention).attn_name
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # FSDP does not manage buffers
    mp = MixedPrecisionPolicy(param_dtype=cfg.torch_param_dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if offload else None
    kwargs = dict(mesh=env.shard_mesh, mp_policy=mp, reshard_after_forward=cfg.fsdp.reshard_after_forward)
    if policy is not None:
        kwargs["offload_policy"] = policy
    layers = decoder_layers(model)
    if cfg.compiled:
        # All layers share one code object, so they share dynamo's cache entries: one graph per (grad mode,
        # pack length T) whatever the layer count (tests/test_fsdp_unit.py). `dynamic=False` specialises on T:
        # RankStep's bucketed packs bound the lengths (40 for a 16k budget); leave room for them before dynamo
        # falls back to eager.
        dynamo_config = torch._dynamo.config
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, _RECOMPILE_LIMIT)
        if cfg.fsdp.gradient_checkpointing and hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            # transformers >= 5.25 sets a context variable (its output capturing) inside every layer's forward;
            # under a checkpointed layer that side effect is a graph break and the whole layer ran eagerly.
            # The recompute in backward need not replay it: nothing of ours reads it.
            dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for i, layer in enumerate(layers):
        if cfg.fsdp.gradient_checkpointing and i % cfg.fsdp.checkpoint_every == 0:
            _checkpoint_forward(layer)
        if cfg.compiled:
            layer.compile(**_compile_options(cfg))
        fully_shard(layer, **kwargs)
    # The root (embeddings, final norm, lm_head) is needed again right at the start of backward: keep it gathered.
    fully_shard(model, **(kwargs | {"reshard_after_forward": False}))
    model.to_empty(device="cpu" if offload else env.device)
    restore_buffers(model, buffers, env.device)  # on the compute device even with CPU offload
    if os.path.isdir(name):
        absent = load_hf_weights(model, name, optional=(f"{VALUE_HEAD}.",) if value_head else ())
        if absent:  # a causal LM's directory: the value head starts at zero
            zero_head_(model)
    else:
        random_init(model, hf_config, cfg.seed, env.device)
        if value_head:
            zero_head_(model)
    return model, hf_config
