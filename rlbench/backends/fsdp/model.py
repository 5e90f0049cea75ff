"""Build an FSDP2-sharded Hugging Face causal LM without materialising it whole on any device.

Order (fixed, torchtitan-style): meta-device construction -> activation checkpointing per decoder layer
-> optional `torch.compile` per layer -> `fully_shard` per layer -> `fully_shard` root -> `to_empty`
-> weights: each rank reads only its own rows of every tensor from the safetensors files
(`safe_open(...).get_slice`), or a world-size-invariant random init from a preset.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from rlbench.backends.fsdp.config import FSDPConfig
from rlbench.distributed.mesh import DistEnv
from rlbench.models.build import params_on_meta, restore_buffers
from rlbench.models.presets import build_config

_RECOMPILE_LIMIT = 64  # compiled variants kept per decoder-layer code object (grad modes x bucketed pack lengths)
# `torch.compile` kwargs of every decoder layer (tests swap the backend). Static shapes, one graph per pack length T,
# bounded by RankStep padding packs to a few bucketed lengths (`FSDPBackend.pack_buckets`, `bucket_length`): static
# kernels are the flex_attention/BlockMask ones measured and bitwise-checked on the H200. `dynamic=True` also gives
# one graph (CPU/SDPA) but its CUDA flex kernels are untested, and its first compile took 1.7x longer on CPU.
_COMPILE_OPTIONS: dict = {"dynamic": False}


def _compile_options(cfg: FSDPConfig) -> dict:
    """`_COMPILE_OPTIONS`, with eager's rounding for the batch-invariant layers (the engine's bits)."""
    if not cfg.batch_invariant or _COMPILE_OPTIONS.get("backend", "inductor") != "inductor":
        return _COMPILE_OPTIONS
    from rlbench import numerics

    extra = _COMPILE_OPTIONS.get("options") or {}
    return _COMPILE_OPTIONS | {"options": {**extra, **numerics.compile_options()}}


def model_config(name: str, overrides: dict | None = None) -> PretrainedConfig:
    """The HF config of a local model directory or of a preset name."""
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name)
    return build_config(name, **(overrides or {}))


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The blocks FSDP shards one by one (HF's `_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} lists no `_no_split_modules`; cannot find its decoder layers")
    return layers


def _checkpoint_forward(layer: nn.Module) -> None:
    # Checkpoint `forward`, not `__call__`: FSDP's hooks stay outside, so recompute reuses the gathered params.
    forward = layer.forward

    @functools.wraps(forward)
    def forward_with_recompute(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = forward_with_recompute


def build_sharded_model(
    name: str, cfg: FSDPConfig, env: DistEnv, *, offload: bool = False
) -> tuple[PreTrainedModel, PretrainedConfig]:
    """An FSDP2 model on `env.device` (sharded params on CPU when `offload`), weights loaded or random.

    Args:
        name: a local HF directory (weights loaded) or a preset name (random init with `cfg.seed`).
        cfg: sharding/precision/attention options.
        env: the process's mesh; FSDP shards over `env.shard_mesh` (dp x cp flattened).
        offload: FSDP CPUOffloadPolicy (params, grads and optimizer state on CPU).
    """
    hf_config = model_config(name, cfg.model_overrides)
    hf_config._attn_implementation = cfg.attention
    hf_config.use_cache = False
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.float32, attn_implementation=cfg.attention
        )
    if cfg.cp_size > 1:  # context parallel: every attention layer reads the forward's rl_cp= context
        from rlbench.distributed.cp_kernels import cp_kernel  # importing the kernel registers its attention

        model.config._attn_implementation = cp_kernel(cfg.cp_attention).attn_name
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # FSDP does not manage buffers
    mp = MixedPrecisionPolicy(param_dtype=cfg.torch_param_dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if offload else None
    kwargs = dict(mesh=env.shard_mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
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
        if cfg.gradient_checkpointing and hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            # transformers >= 5.25 sets a context variable (its output capturing) inside every layer's forward;
            # under a checkpointed layer that side effect is a graph break and the whole layer ran eagerly.
            # The recompute in backward need not replay it: nothing of ours reads it.
            dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for i, layer in enumerate(layers):
        if cfg.gradient_checkpointing and i % cfg.checkpoint_every == 0:
            _checkpoint_forward(layer)
        if cfg.compiled:
            layer.compile(**_compile_options(cfg))
        fully_shard(layer, **kwargs)
    # The root (embeddings, final norm, lm_head) is needed again right at the start of backward: keep it gathered.
    fully_shard(model, **(kwargs | {"reshard_after_forward": False}))
    model.to_empty(device="cpu" if offload else env.device)
    restore_buffers(model, buffers, env.device)  # on the compute device even with CPU offload
    if os.path.isdir(name):
        load_hf_weights(model, name)
    else:
        random_init(model, hf_config, cfg.seed, env.device)
    return model, hf_config


def local_slice(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, the index of it inside the full tensor)."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, s) for s in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _weight_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"{path!r} has no model.safetensors(.index.json); save it with save_pretrained")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> None:
    """Each rank reads only its own rows of each tensor (safetensors slicing); no full model anywhere."""
    files = _weight_files(path)
    targets = dict(model.named_parameters())  # tied weights appear once
    targets |= {n: b for n, b in model.named_buffers() if n in files}
    missing = sorted(n for n in targets if n not in files)
    if missing:
        raise ValueError(f"{path!r} lacks tensors {missing[:5]} (of {len(missing)}); is it the same architecture?")
    handles: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        for name, tensor in targets.items():
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            local, index = local_slice(tensor)
            if local.numel():
                local.copy_(handles[file].get_slice(name)[index].to(local.dtype))


@torch.no_grad()
def random_init(model: nn.Module, config: PretrainedConfig, seed: int, device: torch.device) -> None:
    """HF-style init (normal(0, initializer_range), norms = 1, biases = 0), identical for any world size.

    Every rank draws the full tensor from a generator seeded by (seed, parameter index) on `device`,
    one tensor at a time, and keeps its own rows.
    """
    std = getattr(config, "initializer_range", 0.02)
    for i, (name, param) in enumerate(model.named_parameters()):
        local, index = local_slice(param)
        full = torch.empty(param.shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            full.fill_(1.0)
        elif name.endswith("bias") or full.dim() < 2:
            full.zero_()
        else:
            full.normal_(0.0, std, generator=torch.Generator(device).manual_seed(seed * 100_003 + i))
        local.copy_(full[index])
        del full
