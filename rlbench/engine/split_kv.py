"""Split-KV decode attention in Triton ("flash-decoding"): the key axis is cut into chunks of `CHUNK` positions
and every (row, KV head, chunk) is its own program, so a decode step with few, long rows still fills the GPU.

SDPA parallelises a decode step over batch x KV heads only. In the grouped layout (`KVContext.group`: the n
samples of a prompt share its K/V) that is 64 programs of 16 query rows at 8 prompts x 8 KV heads, each walking
up to 2.5k keys alone on an H200 with 132 SMs. Here program (r, h, c) reads keys `[c CHUNK, (c + 1) CHUNK)` of
row r and KV head h once for all its query rows (the G heads of the KV head, times the k samples in the grouped
layout; tensor-core dots), keeps an online softmax in fp32, and writes a normalised partial output and its
log-sum-exp. A second pass (torch: inductor fuses it into one kernel) merges the chunks.

`split_kv_decode` has the `DecodeAttention` signature of `rlbench.engine.attention`; the mask is any boolean
`[B, 1, 1 or M, L]` (the slot layout's or the grouped layout's). Under Triton's CPU interpreter (tensors on the
CPU, TRITON_INTERPRET=1 set before Triton is imported) 16-bit dot operands are upcast to fp32 first (the
interpreter multiplies bf16 operands as raw integers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

CHUNK = 256
"""Keys per program. At the e2e workload's longest grouped row (2.5k keys, 8 x 8 rows x heads) 640 programs;
at batch 256 in the slot layout (768 keys) 6k programs."""

BLOCK_N = 64
"""Keys per online-softmax step (CHUNK / BLOCK_N steps per program)."""

LOG2E = 1.4426950408889634


@triton.jit
def _split_kv_kernel(q, k, v, mask, out, lse, M, L, qk_scale,
                     sqb, sqh, sqm, skb, skh, skl, svb, svh, svl, smb, smm, sml,
                     sob, soh, soc, som, slb, slh, slc,
                     HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                     PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    valid = m < M
    qv = tl.load(q + row * sqb + head * sqh + m[:, None] * sqm + d[None, :], mask=valid[:, None], other=0.0)
    if INTERPRETED:
        qv = qv.to(tl.float32)
    k_base = k + row * skb + head * skh
    v_base = v + row * svb + head * svh
    m_base = mask + row * smb + m[:, None] * smm
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HD], 0.0, tl.float32)
    for step in range(CHUNK // BLOCK_N):
        j = chunk * CHUNK + step * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = j < L
        kt = tl.load(k_base + j.to(tl.int64)[:, None] * skl + d[None, :], mask=inside[:, None], other=0.0)
        vt = tl.load(v_base + j.to(tl.int64)[:, None] * svl + d[None, :], mask=inside[:, None], other=0.0)
        seen = tl.load(m_base + j[None, :] * sml, mask=valid[:, None] & inside[None, :], other=0)
        if INTERPRETED:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = (tl.dot(qv, tl.trans(kt), input_precision=PRECISION) * qk_scale).to(tl.float32)  # an fp64 scale arg
        s = tl.where(seen != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: p = 0, no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    seen_any = l_i > 0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    tl.store(out + row * sob + head * soh + chunk * soc + m[:, None] * som + d[None, :], o, mask=valid[:, None])
    tl.store(lse + row * slb + head * slh + chunk * slc + m,
             tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf")), mask=valid)


@triton_op("rlbench::split_kv_decode", mutates_args=())
def _split_kv(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    b, n_kv, rows, hd = q.shape
    length = keys.shape[2]
    chunks = triton.cdiv(length, CHUNK)
    partial = torch.empty((b, n_kv, chunks, rows, hd), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, n_kv, chunks, rows), dtype=torch.float32, device=q.device)
    interpreted = q.device.type != "cuda"
    wrap_triton(_split_kv_kernel)[(b, n_kv, chunks)](
        q, keys, values, mask, partial, lse, rows, length, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), *keys.stride()[:3], *values.stride()[:3],
        mask.stride(0), mask.stride(2) if mask.shape[2] > 1 else 0, mask.stride(3),
        *partial.stride()[:4], *lse.stride()[:3],
        HD=hd, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=min(BLOCK_N, CHUNK), CHUNK=CHUNK,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRETED=interpreted, num_warps=4,
        num_stages=1 if interpreted else 2)
    top = lse.amax(2, keepdim=True)  # every row sees at least one key, so `top` is finite
    weight = torch.exp2(lse - top)  # [B, n_kv, C, M]
    merged = (weight[..., None] * partial).sum(2) / weight.sum(2)[..., None]
    return merged.to(q.dtype)


def split_kv_decode(q, keys, values, mask, scale: float) -> torch.Tensor:
    """`(q [B, n_kv, M, hd], keys/values [B, n_kv, L, hd] (a cache slice: any strides, last dim contiguous),
    mask [B, 1, 1 or M, L] bool, scale) -> [B, n_kv, M, hd]` in q's dtype. Every row needs a visible key."""
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    hd = q.shape[-1]
    if hd < 16 or hd & (hd - 1):
        raise ValueError(f"split_kv_decode: head_dim {hd} is not a power of two >= 16")
    if mask.dtype != torch.bool:
        raise ValueError(f"split_kv_decode: the mask must be bool, got {mask.dtype}")
    return _split_kv(q, keys, values, mask, scale)
