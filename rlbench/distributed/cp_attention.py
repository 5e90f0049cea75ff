"""Context-parallel (CP) attention over a packed micro-batch: all-gather K/V over the CP group, attend locally.

Each CP rank holds `T/cp` tokens of the pack (zig-zag per slot, `rlbench.packing.cp`; contiguous works too).
Every attention layer:

1. all-gathers the rank's keys/values over the CP process group (`all_gather_kv`: an autograd Function whose
   backward reduce-scatters dK/dV, i.e. sums every rank's contribution and hands each owner its rows);
2. puts the gathered rank-ordered chunks back into global token order (`CPAttnInfo.gather_order`);
3. lets the local queries attend with the per-document causal mask of the GLOBAL pack: the query at global
   index i sees the key at j iff both lie in the same slot (`CPAttnInfo.doc_ids`) and j <= i.

Slots come from `CPLayout.cu_seqlens` (explicit boundaries, the trailing pad is a slot of its own); nothing is
inferred from token values or from the local position ids. Alignment pads sit after their sequence's real
tokens, so the causal rule alone keeps real tokens from seeing them.

`kv_head_chunk` gathers that many KV heads at a time (with their query heads) instead of all of them; with
`recompute=True` each chunk runs under non-reentrant activation checkpointing, so backward re-gathers the chunk
instead of keeping every layer's gathered K/V alive (memory O(T * kv_head_chunk * hd) per layer instead of
O(T * n_kv * hd)). Both change only the schedule, not the result.

Kernels: SDPA with a boolean `[T_local, T]` mask (CPU), compiled flex_attention with a block-sparse BlockMask
(CUDA, chosen when `q.is_cuda`; eager flex would materialise the `[T_local, T]` scores). On CPU the tests check
`cp_block_tables` against the dense mask and eager flex's forward against SDPA; tests/test_cp_gpu.py checks the
compiled CUDA kernel's forward and backward against full attention.

One process can stand in for one CP rank (`EmulatedCP` in place of the group): the all-gather is replaced by
local copies of the rank's own chunk in the peers' slots, so memory and the kernel's work are a real rank's while
the values are not (tests/test_cp_emulation.py; `rlbench.experiments.cp_oom` measures a rank's memory with it).
`cp_attention_all_ranks` computes every rank's output in one process from the real full K/V, through the same
kernel path, to compare it with full attention.

Model integration: `CP_ATTN_NAME` ("rlbench_cp") is registered with transformers' `AttentionInterface`; set
`config._attn_implementation = CP_ATTN_NAME` and pass `rl_cp=CPContext(...)` to the model's forward (with the
rank-local `input_ids` and `position_ids`, which RoPE still needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rlbench.packing.cp import CPLayout, cp_gather

__all__ = [
    "CP_ATTN_NAME",
    "CPAttnInfo",
    "CPContext",
    "EmulatedCP",
    "all_gather_kv",
    "cp_attention",
    "cp_attention_all_ranks",
    "cp_attention_info",
    "cp_block_mask",
    "cp_block_tables",
    "cp_dense_mask",
    "cp_hf_attention",
]

CP_ATTN_NAME = "rlbench_cp"
BLOCK = 128  # flex_attention's block size


@dataclass(frozen=True)
class CPAttnInfo:
    """What one CP rank's attention needs to know about the pack's layout (all on the compute device)."""

    cp_rank: int
    cp_size: int
    q_positions: torch.Tensor  # [T_local] long: global index of each local token (ascending for zig-zag)
    doc_ids: torch.Tensor  # [T] long: slot of every global token (the trailing pad is the last slot)
    gather_order: torch.Tensor  # [T] long: row of global token t in the rank-concatenated gathered tensor

    @property
    def num_tokens(self) -> int:
        return int(self.doc_ids.numel())

    @property
    def local_tokens(self) -> int:
        return int(self.q_positions.numel())


def cp_attention_info(layout: CPLayout, cp_rank: int, device: torch.device | str = "cpu") -> CPAttnInfo:
    """The `CPAttnInfo` of rank `cp_rank` under `layout` (build once per pack, reuse for every layer)."""
    if not 0 <= cp_rank < layout.cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={layout.cp_size})")
    sizes = {int(idx.numel()) for idx in layout.indices}
    if len(sizes) != 1:
        raise ValueError(f"CP attention needs the same token count on every rank, the layout has {sorted(sizes)}")
    T = layout.num_tokens
    cu = layout.cu_seqlens.long()
    doc_ids = torch.searchsorted(cu[1:], torch.arange(T), right=True)  # [T]
    order = torch.empty(T, dtype=torch.long)
    order[torch.cat(layout.indices)] = torch.arange(T)  # inverse of the rank-concatenation permutation
    return CPAttnInfo(cp_rank, layout.cp_size, layout.indices[cp_rank].to(device), doc_ids.to(device),
                      order.to(device))


@dataclass(frozen=True)
class EmulatedCP:
    """Stands in for the CP process group of rank `rank` of `size` in one process, with no peers.

    `all_gather_kv` returns the `[size * n, ...]` tensor a real all-gather returns, the rank's own chunk in its slot
    and copies of it in the peers' slots: same sizes and dtype (memory and kernel work are a real rank's), other
    values (the attention output is not the pack's). Backward returns the own slice of the gradient: the size a
    reduce-scatter delivers, without the peers' contributions. Nothing is communicated, so nothing of the
    communication's time or memory (NCCL buffers) is measured.
    """

    size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"EmulatedCP(size={self.size}, rank={self.rank}): need size >= 1 and 0 <= rank < size")


@dataclass
class CPContext:
    """The per-forward CP context handed to the model as `rl_cp=` (read by every attention layer)."""

    info: CPAttnInfo
    group: dist.ProcessGroup | EmulatedCP | None  # the CP group (e.g. `env.mesh["cp"].get_group()`)
    kv_head_chunk: int | None = None  # KV heads per all-gather; None: all at once
    recompute: bool = False  # checkpoint each chunk: backward re-gathers instead of keeping gathered K/V


class _AllGatherKV(torch.autograd.Function):
    """all_gather along dim 0 forward; reduce-scatter (sum) backward: each rank gets the sum of every rank's
    gradient for its own rows. Falls back to all_reduce + slice where the backend lacks reduce_scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        n = grad.shape[0] // world
        out = grad.new_empty((n, *grad.shape[1:]))
        try:
            dist.reduce_scatter_tensor(out, grad, group=group)
        except (RuntimeError, ValueError, NotImplementedError):  # e.g. gloo without reduce_scatter for a dtype
            total = grad.clone()
            dist.all_reduce(total, group=group)
            out = total[rank * n : (rank + 1) * n].clone()
        return out, None


class _EmulatedGatherKV(torch.autograd.Function):
    """`EmulatedCP`'s all-gather: own chunk in slot `rank`, copies of it in the other slots; backward: own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        ctx.rows, ctx.rank = x.shape[0], rank
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        out.view(size, *x.shape).copy_(x.unsqueeze(0).expand(size, *x.shape))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, r = ctx.rows, ctx.rank
        return grad[r * n : (r + 1) * n].clone(), None, None  # a reduce-scatter's output size


def cp_group_size(group) -> int:
    """Ranks in a CP group: a process group, an `EmulatedCP`, or None (1)."""
    if group is None:
        return 1
    if isinstance(group, EmulatedCP):
        return group.size
    return dist.get_world_size(group)


def all_gather_kv(x: torch.Tensor, group) -> torch.Tensor:
    """`[n, ...]` per rank -> `[cp * n, ...]` in rank order; autograd-correct (backward reduce-scatters).
    With an `EmulatedCP` group: the emulated gather (the peers' slots hold copies of `x`)."""
    if cp_group_size(group) == 1:
        return x
    if isinstance(group, EmulatedCP):
        return _EmulatedGatherKV.apply(x, group.size, group.rank)
    return _AllGatherKV.apply(x, group)


def cp_dense_mask(info: CPAttnInfo) -> torch.Tensor:
    """`[T_local, T]` bool: local query (global index i) may see global key j iff same slot and j <= i."""
    qp = info.q_positions
    keys = torch.arange(info.num_tokens, device=qp.device)
    return (info.doc_ids[qp][:, None] == info.doc_ids[None, :]) & (keys[None, :] <= qp[:, None])


def cp_block_tables(info: CPAttnInfo, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`(partial [nq, nk], full [nq, nk])` bool block tables of the CP mask (q blocks over the local tokens,
    kv blocks over the global ones). Needs ascending `q_positions` and non-decreasing `doc_ids` (both hold for
    `cp_layout`). Partial over-approximates (the mask_mod decides inside); full is exact."""
    qp, docs = info.q_positions, info.doc_ids
    Tl, T = qp.numel(), docs.numel()
    qs = torch.arange(0, Tl, block, device=qp.device)
    q_lo, q_hi = qp[qs], qp[torch.clamp(qs + block - 1, max=Tl - 1)]  # [nq] first/last global index
    ks = torch.arange(0, T, block, device=qp.device)
    k_lo, k_hi = ks, torch.clamp(ks + block - 1, max=T - 1)  # [nk]
    qd_lo, qd_hi, kd_lo, kd_hi = docs[q_lo][:, None], docs[q_hi][:, None], docs[k_lo][None], docs[k_hi][None]
    any_allowed = (k_lo[None] <= q_hi[:, None]) & (kd_hi >= qd_lo) & (kd_lo <= qd_hi)
    one_doc = (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    complete = (qs + block <= Tl)[:, None] & (ks + block <= T)[None]
    full = one_doc & complete & (k_hi[None] <= q_lo[:, None])
    return any_allowed & ~full, full


def _ordered(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num = table.sum(-1, dtype=torch.int32)
    idx = torch.argsort(table.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def cp_block_mask(info: CPAttnInfo, block: int = BLOCK):
    """Flex `BlockMask [1, 1, T_local, T]` of the CP mask."""
    from torch.nn.attention.flex_attention import BlockMask

    qp, docs = info.q_positions, info.doc_ids

    def mask_mod(b, h, q, kv):
        g = qp[q]
        return (docs[g] == docs[kv]) & (kv <= g)

    partial, full = cp_block_tables(info, block)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(info.local_tokens, info.num_tokens))


_compiled_flex: list = []  # torch.compile(flex_attention), built on the first CUDA call


def _flex(q, k, v, mask, scale, gqa):
    """Compiled flex on the device (eager flex materialises the scores); plain flex inside a compiled region."""
    if torch.compiler.is_compiling() or not q.is_cuda:
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if not _compiled_flex:
        _compiled_flex.append(torch.compile(flex_attention))
    return _compiled_flex[0](q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)


def _local_attention(q, k_all, v_all, mask, scale, use_flex):
    """The rank's queries `[1, h, Tl, hd]` against the K/V of the whole pack `[1, n, T, hd]` (global order)."""
    gqa = q.shape[1] != k_all.shape[1]
    if use_flex:
        return _flex(q, k_all, v_all, mask, scale, gqa)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _attend_chunk(q, k, v, group, order, mask, scale, use_flex):
    """One head chunk: gather K/V `[1, n, T_local, hd]` -> global order `[1, n, T, hd]`, attend -> `[1, h, Tl, hd]`."""
    def gather(x):  # [1, n, Tl, hd] -> [1, n, T, hd] in global token order
        g = all_gather_kv(x[0].transpose(0, 1), group)  # [cp*Tl, n, hd], rank-ordered
        return g.index_select(0, order).transpose(0, 1)[None]

    return _local_attention(q, gather(k), gather(v), mask, scale, use_flex)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    info: CPAttnInfo,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    *,
    kv_head_chunk: int | None = None,
    recompute: bool = False,
    mask=None,
) -> torch.Tensor:
    """Attention of one CP rank's local tokens against the whole pack.

    Args:
        q: `[1, H, T_local, hd]` local queries (HF's attention-function layout, RoPE applied).
        k, v: `[1, n_kv, T_local, hd]` local keys/values; `H % n_kv == 0` (GQA).
        info: this rank's `CPAttnInfo` (`cp_attention_info`).
        group: the CP process group (None or size 1: no communication, `info` must describe cp=1), or an
            `EmulatedCP` (one process standing in for rank `info.cp_rank`: real sizes, not the pack's values).
        scale: softmax scale (default `hd ** -0.5`).
        kv_head_chunk: KV heads gathered per collective (None: all); must divide n_kv.
        recompute: checkpoint each chunk (backward re-gathers K/V instead of keeping them).
        mask: a prebuilt mask for `info` (dense bool on CPU / BlockMask on CUDA) to share across layers.

    Returns:
        `[1, T_local, H, hd]`, like HF attention functions.
    """
    b, h, tl, hd = q.shape
    n_kv = k.shape[1]
    if b != 1:
        raise ValueError(f"CP attention takes one packed row (batch 1), got batch {b}")
    if tl != info.local_tokens or k.shape[2] != tl:
        raise ValueError(f"q/k have {tl}/{k.shape[2]} tokens, the CP layout gives this rank {info.local_tokens}")
    cp = cp_group_size(group)
    if cp != info.cp_size:
        raise ValueError(f"the CP group has {cp} ranks, the layout was built for cp={info.cp_size}")
    if h % n_kv:
        raise ValueError(f"{h} query heads are not a multiple of {n_kv} KV heads")
    chunk = n_kv if kv_head_chunk is None else kv_head_chunk
    if chunk < 1 or n_kv % chunk:
        raise ValueError(f"kv_head_chunk={kv_head_chunk} must divide the {n_kv} KV heads")
    scale = hd**-0.5 if scale is None else scale
    if isinstance(group, EmulatedCP) and group.rank != info.cp_rank:
        raise ValueError(f"EmulatedCP rank {group.rank} but the layout info is rank {info.cp_rank}'s")
    use_flex = q.is_cuda
    if mask is None:
        mask = cp_block_mask(info) if use_flex else cp_dense_mask(info)[None, None]
    group_size = h // n_kv
    outs = []
    for k0 in range(0, n_kv, chunk):
        args = (q[:, k0 * group_size : (k0 + chunk) * group_size], k[:, k0 : k0 + chunk], v[:, k0 : k0 + chunk],
                group, info.gather_order, mask, scale, use_flex)
        if recompute and torch.is_grad_enabled():
            outs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outs.append(_attend_chunk(*args))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [1, H, Tl, hd]
    return out.transpose(1, 2).contiguous()


def cp_attention_all_ranks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, scale: float | None = None
) -> torch.Tensor:
    """Every CP rank's attention, computed in one process from the real K/V of the whole pack.

    Rank r's zig-zag query rows attend to the full K/V (global order) through the kernel path `cp_attention` takes
    after its all-gather (compiled flex + `cp_block_mask` on CUDA, SDPA + dense mask on CPU); the outputs are put
    back into global order. Equal to full document-causal attention when the CP masks are right; differentiable
    in q, k and v, so the kernel's backward is checked too.

    Args:
        q: `[1, H, T, hd]` queries of the whole pack (global order).
        k, v: `[1, n_kv, T, hd]`; `H % n_kv == 0`.
        layout: the pack's `CPLayout` (T = `layout.num_tokens`).
        scale: softmax scale (default `hd ** -0.5`).

    Returns:
        `[1, T, H, hd]` in global token order.
    """
    if q.shape[2] != layout.num_tokens or k.shape[2] != layout.num_tokens:
        raise ValueError(f"q/k have {q.shape[2]}/{k.shape[2]} tokens, the layout has {layout.num_tokens}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for rank in range(layout.cp_size):
        info = cp_attention_info(layout, rank, q.device)
        mask = cp_block_mask(info) if q.is_cuda else cp_dense_mask(info)[None, None]
        q_rank = q.index_select(2, info.q_positions)  # [1, H, Tl, hd]
        outs.append(_local_attention(q_rank, k, v, mask, scale, q.is_cuda).transpose(1, 2))  # [1, Tl, H, hd]
    return cp_gather(outs, layout, dim=1)


_mask_cache: list = [None, None, None]  # [CPAttnInfo, device type, mask]: built once per forward, every layer


def _mask_for(info: CPAttnInfo, cuda: bool):
    held, kind, mask = _mask_cache
    if held is not info or kind != cuda:
        mask = cp_block_mask(info) if cuda else cp_dense_mask(info)[None, None]
        _mask_cache[:] = [info, cuda, mask]
    return mask


def cp_hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`AttentionInterface` entry ("rlbench_cp"): reads the forward's `rl_cp=CPContext`; returns
    (`[1, T_local, H, hd]`, None). The mask HF would build is ignored (the CP mask comes from the layout)."""
    ctx = kwargs.get("rl_cp")
    if ctx is None:
        raise ValueError(f"attn_implementation={CP_ATTN_NAME!r} needs the forward kwarg rl_cp=CPContext(...)")
    if dropout:
        raise ValueError(f"attention dropout={dropout}: CP attention has none; set attention_dropout=0")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("CP attention does not support sliding-window layers")
    mask = _mask_for(ctx.info, query.is_cuda)
    out = cp_attention(query, key, value, ctx.info, ctx.group, scaling, kv_head_chunk=ctx.kv_head_chunk,
                       recompute=ctx.recompute, mask=mask)
    return out, None


def _no_mask(*args, **kwargs):
    return None  # the CP mask comes from the layout (rl_cp), never from HF's mask builder


AttentionInterface.register(CP_ATTN_NAME, cp_hf_attention)
AttentionMaskInterface.register(CP_ATTN_NAME, _no_mask)
