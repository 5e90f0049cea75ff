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


LEGACY_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""In-memory name prefix -> the prefix in HF checkpoints saved in the default layout (Qwen2-VL/2.5-VL: transformers
keeps the decoder under `model.language_model` and the vision tower under `model.visual`, and saves them as `model.`
and `visual.`)."""


def file_names(names, files: dict[str, str]) -> dict[str, str]:
    """In-memory parameter name -> its name in the checkpoint `files` (itself, or its `LEGACY_PREFIXES` form), for the
    names found."""
    out = {}
    for name in names:
        if name in files:
            out[name] = name
            continue
        for new, old in LEGACY_PREFIXES:
            if name.startswith(new) and old + name[len(new):] in files:
                out[name] = old + name[len(new):]
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str, *, optional: tuple[str, ...] = ()) -> list[str]:
    """Each rank reads only its own rows of each tensor (safetensors slicing); no full model anywhere.

    Parameters whose name starts with one of `optional` may be absent from the files (a value head on a causal LM
    directory); returns those absent names, left for the caller to initialise. Any other absent tensor raises."""
    files = weight_files(path)
    targets = dict(model.named_parameters())  # tied weights appear once
    targets |= {n: b for n, b in model.named_buffers() if n in file_names([n], files)}
    on_disk = file_names(targets, files)
    absent = sorted(n for n in targets if n not in on_disk)
    missing = [n for n in absent if not n.startswith(optional)] if optional else absent
    if missing:
        raise ValueError(f"{path!r} lacks tensors {missing[:5]} (of {len(missing)}); is it the same architecture?")
    targets = {n: t for n, t in targets.items() if n in on_disk}
    handles: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        for name, tensor in targets.items():
            file = files[on_disk[name]]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            local, index = local_slice(tensor)
            if local.numel():
                local.copy_(handles[file].get_slice(on_disk[name])[index].to(local.dtype))
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
