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

Kernels: SDPA with a boolean `[T_local, T]` mask (CPU, tested), flex_attention with a block-sparse BlockMask
(CUDA, chosen when `q.is_cuda`; NOT tested on a GPU yet). On CPU the tests check `cp_block_tables` against the
dense mask and eager flex_attention's forward with `cp_block_mask` against SDPA (the GPU kernel, its backward and
compiled flex are not covered).

Model integration: `CP_ATTN_NAME` ("rlbench_cp") is registered with transformers' `AttentionInterface`; set
`config._attn_implementation = CP_ATTN_NAME` and pass `rl_cp=CPContext(...)` to the model's forward (with the
rank-local `input_ids` and `position_ids`, which RoPE still needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rlbench.packing.cp import CPLayout

__all__ = [
    "CP_ATTN_NAME",
    "CPAttnInfo",
    "CPContext",
    "all_gather_kv",
    "cp_attention",
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


@dataclass
class CPContext:
    """The per-forward CP context handed to the model as `rl_cp=` (read by every attention layer)."""

    info: CPAttnInfo
    group: dist.ProcessGroup | None  # the CP process group (e.g. `env.mesh["cp"].get_group()`)
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


def all_gather_kv(x: torch.Tensor, group) -> torch.Tensor:
    """`[n, ...]` per rank -> `[cp * n, ...]` in rank order; autograd-correct (backward reduce-scatters)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
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
    """Flex `BlockMask [1, 1, T_local, T]` of the CP mask (checked with eager flex forward on CPU; untested on GPU)."""
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


def _attend_chunk(q, k, v, group, order, mask, scale, use_flex):
    """One head chunk: gather K/V `[1, n, T_local, hd]` -> global order `[1, n, T, hd]`, attend -> `[1, h, Tl, hd]`."""
    def gather(x):  # [1, n, Tl, hd] -> [1, n, T, hd] in global token order
        g = all_gather_kv(x[0].transpose(0, 1), group)  # [cp*Tl, n, hd], rank-ordered
        return g.index_select(0, order).transpose(0, 1)[None]

    k_all, v_all = gather(k), gather(v)
    gqa = q.shape[1] != k.shape[1]
    if use_flex:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k_all, v_all, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=gqa)


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
        group: the CP process group (None or size 1: no communication, `info` must describe cp=1).
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
    cp = dist.get_world_size(group) if group is not None else 1
    if cp != info.cp_size:
        raise ValueError(f"the CP group has {cp} ranks, the layout was built for cp={info.cp_size}")
    if h % n_kv:
        raise ValueError(f"{h} query heads are not a multiple of {n_kv} KV heads")
    chunk = n_kv if kv_head_chunk is None else kv_head_chunk
    if chunk < 1 or n_kv % chunk:
        raise ValueError(f"kv_head_chunk={kv_head_chunk} must divide the {n_kv} KV heads")
    scale = hd**-0.5 if scale is None else scale
    use_flex = q.is_cuda  # flex path: UNTESTED (no GPU test yet)
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
