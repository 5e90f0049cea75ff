"""CPU stand-in for ring_flash_attn/llama3_flash_attn_varlen.py (ring-flash-attention @8996282, same file in 0.1.8).

rlbench loads this file the way it loads the real one (`rlbench.distributed.ring_flash.load_ring_flash_attn`,
without the package's __init__), so tests/test_cp_ring_flash.py checks rlbench's glue on gloo: the contiguous
slicing, the global cu_seqlens handed to the prepare function, local_k_slice, heads_k_stride, the targets and
the response assembly, and the gradients.

What it reproduces, from the real source:
- `llama3_flash_attn_prepare_cu_seqlens`: the same algorithm, rewritten (real lines 24-60): rank r owns global
  tokens [r*T/world, (r+1)*T/world); `left`/`right` by searchsorted over the global cu_seqlens; cu_seqlens_q are
  the rank's slots in local offsets; with causal, cu_seqlens_k run from the start of the rank's first sequence
  to the end of its chunk (`local_k_slice`); max_seqlen_q/k are python ints (`.item()`).
- `llama3_flash_attn_varlen_func`: the same signature (real lines 467-484) and layout (`[T_local, heads, hd]`);
  asserts `nheads_k % heads_k_stride == 0` (line 86); per KV-head stride, all-gathers K/V over `group` in rank
  order (lines 97-116), keeps `[local_k_slice]` (lines 118-119), attends the matching query heads
  (line 117) and concatenates the heads (line 156); default `softmax_scale = hd ** -0.5` (lines 324-325).
  The attention is per sequence of (cu_seqlens_q, cu_seqlens_k) with flash-attn's bottom-right-aligned causal
  mask for seqlen_q < seqlen_k (flash-attn >= 2.1), computed by SDPA with a dense mask in the input dtype.
  Backward: autograd through the gather, whose backward sums every rank's dK/dV and keeps the own rows, which is
  what the real `reduce_scatter_tensor` of the gathered dK/dV does (lines 292-293).

What it does not cover: flash-attn's kernels and numerics (bf16/fp16 only there; fp32 here), the real
double-buffered async all-gather and the re-gather in backward, `max_seqlen_*` as kernel launch bounds (only
checked equal to the slot maxima), CUDA, dropout, windows, alibi, `return_attn_probs` (asserted off).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    total_length = cu_seqlens[-1]
    assert total_length % world_size == 0
    length_per_rank = total_length // world_size
    left = torch.searchsorted(cu_seqlens, rank * length_per_rank)
    right = torch.searchsorted(cu_seqlens, (rank + 1) * length_per_rank)
    length_per_rank = length_per_rank.item()
    if cu_seqlens[left] != rank * length_per_rank:  # the rank's first sequence started on an earlier rank
        left -= 1
    left, right = left.item(), right.item()
    cu_seqlens_q = cu_seqlens[left : right + 1].clone()
    cu_seqlens_q -= rank * length_per_rank
    cu_seqlens_q[0] = 0
    cu_seqlens_q[-1] = length_per_rank
    cu_seqlens_k = cu_seqlens[left : right + 1].clone()
    if causal:
        slice_right = (rank + 1) * length_per_rank
        cu_seqlens_k[-1] = slice_right
    else:
        slice_right = cu_seqlens[right].item()
    slice_left = cu_seqlens[left].item()
    cu_seqlens_k -= slice_left
    max_seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()
    max_seqlen_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slice(slice_left, slice_right)


class _GatherRows(torch.autograd.Function):
    """all_gather_into_tensor along dim 0 (rank order); backward: the sum over ranks, own rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)  # gloo has no reduce_scatter_tensor
        n = grad.shape[0] // world
        return total[rank * n : (rank + 1) * n].clone(), None


def _bottom_right_causal(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """[tq, tk] bool: per slot s, query i sees key j iff (j - k_start) <= (i - q_start) + (len_k - len_q)."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    q_seq = torch.searchsorted(cu_q[1:], torch.arange(tq), right=True)  # [tq]
    k_seq = torch.searchsorted(cu_k[1:], torch.arange(tk), right=True)  # [tk]
    shift = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])  # [S] len_k - len_q
    q_off = torch.arange(tq) - cu_q[q_seq] + shift[q_seq]
    k_off = torch.arange(tk) - cu_k[k_seq]
    return (q_seq[:, None] == k_seq[None, :]) & (k_off[None, :] <= q_off[:, None])


def llama3_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
    return_attn_probs=False, group=None,
):
    assert causal and dropout_p == 0 and tuple(window_size) == (-1, -1) and alibi_slopes is None
    assert not return_attn_probs
    nheads = q.shape[1]
    total_k, nheads_k, head_dim = k.shape
    assert nheads_k % heads_k_stride == 0
    assert q.shape[0] == total_k  # every rank holds an equal contiguous chunk
    tk = local_k_slice.stop - local_k_slice.start
    assert int(cu_seqlens_q[-1]) == total_k and int(cu_seqlens_k[-1]) == tk
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    mask = _bottom_right_causal(cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), total_k, tk).to(q.device)
    outs = []
    for i in range(0, nheads_k, heads_k_stride):
        k_i = _GatherRows.apply(k[:, i : i + heads_k_stride], group)[local_k_slice]  # [tk, stride, hd]
        v_i = _GatherRows.apply(v[:, i : i + heads_k_stride], group)[local_k_slice]
        q_i = q[:, i * nheads // nheads_k : (i + heads_k_stride) * nheads // nheads_k]  # [Tl, h_i, hd]
        o = F.scaled_dot_product_attention(q_i.transpose(0, 1)[None], k_i.transpose(0, 1)[None],
                                           v_i.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [Tl, h_i, hd]
    return torch.cat(outs, dim=1)
