"""Hugging Face weights into a (sharded) model, for both backends: the HF config of a directory or preset, each
rank reading only its own rows of every tensor from the safetensors files (`safe_open(...).get_slice`), and a
world-size-invariant random init for presets."""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, PretrainedConfig

from rlbench.models.presets import build_config
from rlbench.models.weight_layout import checkpoint_layout, overlap


def model_config(name: str, overrides: dict | None = None) -> PretrainedConfig:
    """The HF config of a local model directory or of a preset name."""
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name)
    return build_config(name, **(overrides or {}))


def local_slice(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, the index of it inside the full tensor)."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, s) for s in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


def weight_files(path: str) -> dict[str, str]:
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


def disk_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """tensor name -> shape, from the safetensors headers (no tensor is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if files.get(k) == file}
    return shapes


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str, *, optional: tuple[str, ...] = ()) -> list[str]:
    """Each rank reads only its own rows of each tensor (safetensors slicing); no full model anywhere.

    The checkpoint's layout may differ from the in-memory one (transformers' conversion rules,
    `rlbench.models.weight_layout`): MoE experts stored one tensor per expert are stacked into the fused
    in-memory tensors, each rank reading only the experts (and rows) of its own shard.

    Parameters whose name starts with one of `optional` may be absent from the files (a value head on a causal LM
    directory); returns those absent names, left for the caller to initialise. Any other absent tensor raises."""
    files = weight_files(path)
    layout, _ = checkpoint_layout(model, disk_shapes(files))
    targets = dict(model.named_parameters())  # tied weights appear once
    targets |= {n: b for n, b in model.named_buffers() if n in files or n in layout.pieces}
    stored = set(files) | set(layout.pieces)
    absent = sorted(n for n in targets if n not in stored)
    missing = [n for n in absent if not n.startswith(optional)] if optional else absent
    if missing:
        raise ValueError(f"{path!r} lacks tensors {missing[:5]} (of {len(missing)}); is it the same architecture?")
    targets = {n: t for n, t in targets.items() if n in stored}
    layout.check_covers({n: t.shape for n, t in targets.items() if n in layout.pieces})
    handles: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        for name, tensor in targets.items():
            local, index = local_slice(tensor)
            if not local.numel():
                continue
            for piece in layout.disk_pieces(name, tensor.shape):
                hit = overlap(piece.index, index)
                if hit is None:
                    continue
                file = files[piece.disk]
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                local_index, disk_index = hit
                local[local_index].copy_(handles[file].get_slice(piece.disk)[disk_index].to(local.dtype))
    return absent


@torch.no_grad()
def random_init(model: nn.Module, config: PretrainedConfig, seed: int, device: torch.device,
                names: list[str] | None = None) -> None:
    """HF-style init (normal(0, initializer_range), norms = 1, biases = 0), identical for any world size.

    Every rank draws the full tensor from a generator seeded by (seed, parameter index) on `device`,
    one tensor at a time, and keeps its own rows. `names`: only these parameters (None: all).
    """
    std = getattr(config, "initializer_range", 0.02)
    for i, (name, param) in enumerate(model.named_parameters()):
        if names is not None and name not in names:
            continue
        local, index = local_slice(param)
        full = torch.empty(param.shape, dtype=torch.float32, device=device)
        module = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if name.endswith("weight") and ("norm" in module or module.startswith("ln_")):  # also the vision tower's
            full.fill_(1.0)
        elif name.endswith("bias") or full.dim() < 2:
            full.zero_()
        else:
            full.normal_(0.0, std, generator=torch.Generator(device).manual_seed(seed * 100_003 + i))
        local.copy_(full[index])
        del full
