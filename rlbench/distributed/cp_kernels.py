"""The context-parallel attention kernels `TrainConfig.cp_attention` chooses from, picked once when the run is built.

A kernel says which `AttentionInterface` entry the model runs, which slicing of the pack it needs (zig-zag or
contiguous, `rlbench.packing.cp`), and how to build the per-forward `rl_cp=` context from the pack's layout.

- "allgather": `rlbench.distributed.cp_attention` ("rlbench_cp"): zig-zag slices, K/V all-gathered, SDPA on CPU,
  compiled flex on CUDA.
- "ring_flash_llama3": `rlbench.distributed.ring_flash`: ring-flash-attn's llama3 varlen kernel over contiguous
  slices (CUDA, `pip install flash-attn ring-flash-attn`); choosing it loads the library, so a missing package
  is an `ImportError` when the backend is built, not at the first forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlbench.packing.cp import CPLayout

__all__ = ["CPKernel", "cp_kernel"]


@dataclass(frozen=True)
class CPKernel:
    """One CP attention kernel: what the model is built with and what each forward hands it."""

    attn_name: str  # the AttentionInterface entry set as the model's `_attn_implementation`
    zigzag: bool  # the pack slicing the kernel needs (`cp_layout(..., zigzag=)`)
    context: Callable[..., Any]  # (layout, cp_rank, group, kv_head_chunk, recompute, device) -> rl_cp context


def _allgather() -> CPKernel:
    from rlbench.distributed.cp_attention import CP_ATTN_NAME, CPContext, cp_attention_info

    def context(layout: CPLayout, cp_rank: int, group, kv_head_chunk, recompute: bool, device: torch.device):
        return CPContext(cp_attention_info(layout, cp_rank, device), group, kv_head_chunk=kv_head_chunk,
                         recompute=recompute)

    return CPKernel(CP_ATTN_NAME, True, context)


def _ring_flash_llama3() -> CPKernel:
    from rlbench.distributed.ring_flash import RING_FLASH_ATTN_NAME, load_ring_flash_attn, ring_flash_context

    load_ring_flash_attn()  # a missing flash-attn / ring-flash-attn fails here, when the run is built

    def context(layout: CPLayout, cp_rank: int, group, kv_head_chunk, recompute: bool, device: torch.device):
        # the kernel's backward re-gathers K/V by itself, so `recompute` has nothing to add (the config warns)
        return ring_flash_context(layout, cp_rank, group, heads_k_stride=kv_head_chunk, device=device)

    return CPKernel(RING_FLASH_ATTN_NAME, False, context)


CP_KERNELS = {"allgather": _allgather, "ring_flash_llama3": _ring_flash_llama3}


def cp_kernel(name: str) -> CPKernel:
    """The kernel named by `TrainConfig.cp_attention` (importing it registers its attention entry)."""
    if name not in CP_KERNELS:
        raise ValueError(f"cp_attention={name!r}; use one of {sorted(CP_KERNELS)}")
    return CP_KERNELS[name]()
