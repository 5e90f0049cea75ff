"""Full (unsharded) weights out of an FSDP2 model: buckets for weight sync, and a plain HF export.

Both carry the on-disk names and layout (`rlbench.models.weight_layout.export_layout`: what `save_pretrained`
writes, e.g. one tensor per MoE expert), so `from_pretrained`, SGLang and the torch engine read them as a
checkpoint. Both are collective (every rank iterates; each DTensor is all-gathered in turn). At most one bucket of
gathered tensors is alive at a time: a bucket is yielded, then a fresh one is started.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from rlbench.distributed.mesh import DistEnv, barrier
from rlbench.models.weight_layout import export_layout


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def sync_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, sharded tensor): parameters once each (tied weights once) and persistent buffers."""
    yield from model.named_parameters()
    non_persistent = {
        f"{mod_name}.{b}" if mod_name else b
        for mod_name, mod in model.named_modules()
        for b in mod._non_persistent_buffers_set
    }
    for name, buf in model.named_buffers():
        if name not in non_persistent:
            yield name, buf


@torch.no_grad()
def named_weight_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (on-disk name, full tensor cast to `dtype`) of at most `bucket_bytes` each.

    A single tensor larger than `bucket_bytes` forms its own bucket. Collective: all ranks must iterate.
    """
    layout = export_layout(model)
    full = ((name, _full(t.detach())) for name, t in sync_tensors(model))
    disk = (piece for name, t in full for piece in layout.to_disk(name, t))
    yield from buckets(((n, t.to(dtype) if dtype is not None else t) for n, t in disk), bucket_bytes)


def buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` pairs into lists of at most `bucket_bytes` (a larger tensor is its own list), lazily:
    at most one bucket of tensors is alive at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (e.g. 512 MiB = 536870912)")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def export_hf(
    model: nn.Module,
    config: PretrainedConfig,
    path: str,
    env: DistEnv,
    *,
    dtype: torch.dtype | None = None,
    shard_bytes: int = 2 << 30,
) -> None:
    """Write a standard HF directory (config.json + safetensors shards + index) that `from_pretrained` loads.

    Streams through `named_weight_buckets`, so no rank ever holds the whole model; rank 0 writes.
    """
    weight_map: dict[str, str] = {}
    total = 0
    for i, bucket in enumerate(named_weight_buckets(model, shard_bytes, dtype)):
        if env.is_main:
            fname = f"model-{i + 1:05d}.safetensors"
            tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
            os.makedirs(path, exist_ok=True)
            save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, fname)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    if env.is_main:
        config.save_pretrained(path)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    barrier(env)
