"""Context-parallel attention through ring-flash-attn's "llama3" varlen kernel (an optional extra, CUDA only).

`pip install flash-attn ring-flash-attn` (flash-attn has no CPU build). Selected by
`TrainConfig.cp_attention="ring_flash_llama3"`; the default CP kernel is `rlbench.distributed.cp_attention`.

What the kernel expects (ring_flash_attn/llama3_flash_attn_varlen.py, ring-flash-attention @8996282, the same
file in the 0.1.8 wheel):

- each CP rank holds a CONTIGUOUS chunk of the packed stream: rank r has global tokens [r*T/cp, (r+1)*T/cp)
  (`cp_layout(pack, cp, zigzag=False)`; the test in that repository slices `qkv[rank*local:(rank+1)*local]`);
- `llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size)` turns the GLOBAL slot
  boundaries into the rank's `cu_seqlens_q`, `cu_seqlens_k`, `max_seqlen_q/k` and `local_k_slice` (the
  range of gathered keys its queries need: from the start of its first sequence to the end of its chunk);
- `llama3_flash_attn_varlen_func(q, k, v, ...)` takes `[T_local, heads, head_dim]`, all-gathers K/V
  `heads_k_stride` KV heads at a time, and runs flash-attn varlen with a bottom-right-aligned causal mask
  per sequence; backward re-gathers K/V and reduce-scatters dK/dV (it keeps only the local K/V).

The boundaries come from `CPLayout.cu_seqlens` (explicit slots, the trailing pad is a slot of its own), never
from token values or position ids. Contiguous chunks make the causal work per rank unequal (rank cp-1 does the
most); ring-flash-attn has no zig-zag variant of this kernel.

The package's `__init__` also imports its HF adapter (`substitute_hf_flash_attn`), which imports helper names
from `transformers.modeling_flash_attention_utils` that transformers 5 no longer has (0.1.8:
`is_flash_attn_greater_or_equal_2_10`; absent in transformers 5.24), so `import ring_flash_attn` fails there.
rlbench needs neither the adapter nor its global monkey-patch of HF's flash-attention entry point: it loads only
the kernel module (`load_ring_flash_attn`) and registers its own `AttentionInterface` entry, which reads the
forward's `rl_cp=RingFlashContext(...)` (as "rlbench_cp" reads `CPContext`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rlbench.packing.cp import CPLayout

__all__ = [
    "RING_FLASH_ATTN_NAME",
    "RingFlashContext",
    "RingFlashKernel",
    "load_ring_flash_attn",
    "ring_flash_context",
    "ring_flash_hf_attention",
]

RING_FLASH_ATTN_NAME = "rlbench_ring_flash_llama3"
MISSING = ("cp_attention='ring_flash_llama3' needs the packages flash-attn and ring-flash-attn on a CUDA machine: "
           "pip install flash-attn ring-flash-attn (or use cp_attention='allgather')")
_KERNEL_MODULE = "llama3_flash_attn_varlen"
_PRIVATE_PACKAGE = "_rlbench_ring_flash_attn"  # the package's files, imported without its __init__


@dataclass(frozen=True)
class RingFlashKernel:
    """The two functions rlbench uses from ring_flash_attn.llama3_flash_attn_varlen."""

    prepare_cu_seqlens: Callable[..., Any]  # llama3_flash_attn_prepare_cu_seqlens
    varlen_func: Callable[..., Any]  # llama3_flash_attn_varlen_func


_loaded: list[RingFlashKernel] = []


def _kernel_module() -> types.ModuleType:
    """ring_flash_attn.llama3_flash_attn_varlen (and its `.utils`), without running the package's __init__."""
    imported = sys.modules.get(f"ring_flash_attn.{_KERNEL_MODULE}")
    if imported is not None:  # someone imported the package normally: use that
        return imported
    spec = importlib.util.find_spec("ring_flash_attn")  # locates the package; executes nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(MISSING)
    package = types.ModuleType(_PRIVATE_PACKAGE)
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules[_PRIVATE_PACKAGE] = package
    try:
        return importlib.import_module(f"{_PRIVATE_PACKAGE}.{_KERNEL_MODULE}")
    except ImportError as exc:  # e.g. flash_attn missing: the kernel module imports flash_attn.flash_attn_interface
        for name in [n for n in sys.modules if n == _PRIVATE_PACKAGE or n.startswith(_PRIVATE_PACKAGE + ".")]:
            del sys.modules[name]
        raise ImportError(f"{MISSING}; importing the kernel failed: {exc}") from exc


def load_ring_flash_attn() -> RingFlashKernel:
    """The ring-flash-attn llama3 functions; `ImportError` naming the pip packages when they are missing."""
    if not _loaded:
        module = _kernel_module()
        _loaded.append(RingFlashKernel(module.llama3_flash_attn_prepare_cu_seqlens,
                                       module.llama3_flash_attn_varlen_func))
    return _loaded[0]


@dataclass(frozen=True)
class RingFlashContext:
    """The per-forward context handed to the model as `rl_cp=` (read by every attention layer)."""

    cu_seqlens_q: torch.Tensor  # [S_r+1] int32: the rank's query slots (local offsets)
    cu_seqlens_k: torch.Tensor  # [S_r+1] int32: the same slots' keys inside `local_k_slice`
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: slice  # rows of the gathered [T, ...] keys the rank's queries need
    group: dist.ProcessGroup  # the CP group (e.g. `env.mesh["cp"].get_group()`)
    heads_k_stride: int | None = None  # KV heads per all-gather; None: all at once
    kernel: RingFlashKernel | None = None  # None: `load_ring_flash_attn()`


def ring_flash_context(
    layout: CPLayout, cp_rank: int, group, *, heads_k_stride: int | None = None, device: torch.device | str = "cpu"
) -> RingFlashContext:
    """The `RingFlashContext` of rank `cp_rank` for a contiguous `layout` (once per pack, every layer reuses it).

    Args:
        layout: `cp_layout(pack, cp, zigzag=False)`; its global `cu_seqlens` (slots incl. the trailing pad) are
            what the kernel's prepare function takes.
        cp_rank: this rank's index in the CP group.
        group: the CP process group.
        heads_k_stride: KV heads gathered per collective (must divide the model's KV heads); None: all.
        device: where the cu_seqlens live (the compute device).
    """
    if layout.zigzag:
        raise ValueError("ring-flash-attn's llama3 kernel needs contiguous CP chunks; build the layout with "
                         "cp_layout(pack, cp, zigzag=False)")
    if not 0 <= cp_rank < layout.cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={layout.cp_size})")
    kernel = load_ring_flash_attn()
    cu = layout.cu_seqlens.to(device=device, dtype=torch.int32)  # [S+1] global
    cu_q, cu_k, max_q, max_k, k_slice = kernel.prepare_cu_seqlens(cu, True, cp_rank, layout.cp_size)
    return RingFlashContext(cu_q, cu_k, int(max_q), int(max_k), k_slice, group, heads_k_stride, kernel)


def ring_flash_hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`AttentionInterface` entry ("rlbench_ring_flash_llama3"): reads the forward's `rl_cp=RingFlashContext`.

    Args:
        query: `[1, H, T_local, hd]`; key, value: `[1, n_kv, T_local, hd]` (HF layout, RoPE applied).

    Returns:
        (`[1, T_local, H, hd]`, None). The mask HF would build is ignored (the slots come from the layout).
    """
    ctx = kwargs.get("rl_cp")
    if not isinstance(ctx, RingFlashContext):
        raise ValueError(f"attn_implementation={RING_FLASH_ATTN_NAME!r} needs the forward kwarg "
                         f"rl_cp=RingFlashContext(...), got {type(ctx).__name__}")
    if dropout:
        raise ValueError(f"attention dropout={dropout}: the CP kernel has none; set attention_dropout=0")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("ring-flash-attn's llama3 kernel supports neither sliding-window layers nor softcap")
    if not getattr(module, "is_causal", True):
        raise ValueError("ring-flash-attn CP attention is causal only")
    if query.shape[0] != 1:
        raise ValueError(f"CP attention takes one packed row (batch 1), got batch {query.shape[0]}")
    n_kv = key.shape[1]
    stride = n_kv if ctx.heads_k_stride is None else ctx.heads_k_stride
    kernel = ctx.kernel or load_ring_flash_attn()
    out = kernel.varlen_func(
        query[0].transpose(0, 1),  # [Tl, H, hd]
        key[0].transpose(0, 1),  # [Tl, n_kv, hd]; the kernel makes K/V contiguous itself
        value[0].transpose(0, 1),
        ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
        heads_k_stride=stride, local_k_slice=ctx.local_k_slice, softmax_scale=scaling, causal=True,
        group=ctx.group,
    )  # [Tl, H, hd]
    return out[None], None


def _no_mask(*args, **kwargs):
    return None  # the slots come from the layout (rl_cp), never from HF's mask builder


AttentionInterface.register(RING_FLASH_ATTN_NAME, ring_flash_hf_attention)
AttentionMaskInterface.register(RING_FLASH_ATTN_NAME, _no_mask)
