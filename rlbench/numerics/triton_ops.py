"""Batch-invariant Triton kernels (forward only) for the true on-policy mode: matmul, RMSNorm, row logsumexp
and causal attention, each with one fixed floating-point reduction order per output element.

An element's bits are then a function of its own inputs only: not of the number of rows, of the other rows,
or of where its row sits in a tile or in the grid. The rules every kernel follows:

- tile shapes, warps and stages are module constants (no autotuning), chosen by M only where the table's
  configs are checked on the GPU to agree bit for bit (`MATMUL_CONFIGS`);
- every reduction runs inside one program in a fixed order (no split-K, no split-KV, no atomics); its shape
  depends on the reduced length (K, D, V, a sequence's own positions), never on M;
- masked-out rows are loaded as zeros and never written; they cannot reach a valid row.

Under Triton's CPU interpreter (tensors on the CPU, `TRITON_INTERPRET=1`) two things differ, both outside
the arithmetic order: 16-bit dot operands are upcast to fp32 first (the interpreter multiplies bf16 operands
as raw integers; the products of 16-bit values are exact in fp32 either way), and the attention's block loop
is a `while` loop (with numpy 2 the interpreter cannot take a runtime value as a `range` bound, which is
also why K and V are constexpr). The interpreter truncates fp32 -> bf16 casts where the GPU rounds to
nearest even, so the CPU tests compare values with tolerances and bits only between calls.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


class MatmulConfig(NamedTuple):
    """One matmul tile config. The K step is `MATMUL_BLOCK_K` for every config (the K chunking is fixed)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int
    """Row tiles per launch-order group (L2 reuse of the weight tiles); does not change any arithmetic."""


MATMUL_BLOCK_K = 64
"""K step of every matmul config: the fp32 accumulator takes K in chunks of 64 from k = 0, in order."""

MATMUL_SMALL = MatmulConfig(block_m=64, block_n=32, num_warps=4, num_stages=4, group_m=16)
"""Decode (M < 1024): 64 x 32 tiles, so N = 1024 still gives 32 programs at M = 1; group_m = 16 runs the M
tiles of one weight tile back to back. The fastest of the bit-identical tiles at M = 64/256 on the H200
(`benchmarks/numerics.py --sweep`: 1.51x cuBLAS, geometric mean over the Qwen3-0.6B/4B layer shapes)."""

MATMUL_LARGE = MatmulConfig(block_m=128, block_n=256, num_warps=8, num_stages=3, group_m=8)
"""Training (M >= 1024): 128 x 256 tiles on two warpgroups, grouped launch order; the fastest bit-identical
tile at M = 8k/16k on the H200 (1.25x cuBLAS; 128 x 128 was 1.46x)."""

MATMUL_CONFIGS: tuple[tuple[int, MatmulConfig], ...] = ((0, MATMUL_SMALL), (1024, MATMUL_LARGE))
"""`(min_M, config)` ascending: a call uses the last entry whose min_M <= M. More than one entry is valid
only while the GPU test shows every config giving the same bits (tests/test_numerics_gpu.py); otherwise keep
a single entry, e.g. `((0, MATMUL_LARGE),)`."""

FP32_MAX_STAGES = 2
"""fp32 operands take twice the shared memory per stage: pipeline depth capped (the arithmetic is the same)."""

RMS_BLOCK_ELEMS = 4096
"""RMSNorm: rows per program = max(1, 4096 // next_pow2(D)) (32 rows of D = 128, 4 of D = 1024): a function
of D only, so a row's reduction has the same shape whatever M is."""

LSE_BLOCK_V = 4096
"""logsumexp_rows: V is read in chunks of 4096 lanes, each lane keeping its own running max and sum."""
LSE_NUM_WARPS = 8

ATTN_BLOCK_M = 16
"""Attention rows per program (query tokens x their G heads): the smallest tensor-core tile, because at
decode a tile holds one token (G useful rows) and larger tiles only add wasted work there."""
ATTN_BLOCK_N = 64
"""Keys per block: block b holds absolute positions [64 b, 64 b + 64) of the row's sequence."""
ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 3
"""K/V blocks in flight (capped at FP32_MAX_STAGES for fp32); pipeline depth only."""


def _precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: IEEE fp32 products for fp32 (never TF32); ignored for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _stages(stages: int, dtype: torch.dtype) -> int:
    return min(stages, FP32_MAX_STAGES) if dtype == torch.float32 else stages


@triton.jit
def _sum(x, axis: tl.constexpr):
    """`tl.sum` of fp32, the same reduce. This file calls only Triton builtins, not `tl.sum`, `tl.max`,
    `tl.zeros` or `tl.cdiv`: those are jit functions, which the interpreter can call only if Triton itself
    was imported with TRITON_INTERPRET=1, and the CPU tests interpret a private copy of this module in a
    process whose Triton compiles for the GPU."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# ---------------------------------------------------------------------------------------------- matmul


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x, w, bias, y, M, N, sxm, sxk, swn, swk, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    x_ptrs = x + rm.to(tl.int64)[:, None] * sxm + rk[None, :] * sxk
    w_ptrs = w + rn.to(tl.int64)[None, :] * swn + rk[:, None] * swk
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = k0 + rk < K
            a = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(a, b, acc, PRECISION, INTERPRETED)
        x_ptrs += BLOCK_K * sxk
        w_ptrs += BLOCK_K * swk
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def matmul_config(m: int) -> MatmulConfig:
    """The `MATMUL_CONFIGS` entry for M rows (read at each call, so tests can swap the table)."""
    chosen = MATMUL_CONFIGS[0][1]
    for min_m, cfg in MATMUL_CONFIGS:
        if m >= min_m:
            chosen = cfg
    return chosen


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` `[M, K] x [N, K] -> [M, N]` in x's dtype (bf16, fp16 or fp32; any strides).

    Batch-invariant: output (m, n) is one fp32 accumulator over K in `MATMUL_BLOCK_K` chunks from k = 0 (no
    split-K), bias added in fp32 after the loop, one cast at the end. Which tile row m lands in, and which
    rows share it, only changes which program computes it; with one config per M range the instructions of
    all ranges must agree (see `MATMUL_CONFIGS`).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype:
        raise ValueError(f"matmul: x is {x.dtype}, weight is {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out  # out: contiguous [M, N]
    if m == 0 or n == 0:
        return y
    if bias is not None:
        bias = bias.contiguous()
        if bias.shape != (n,):
            raise ValueError(f"matmul: bias {tuple(bias.shape)} for N = {n}")
    cfg = matmul_config(m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else y, y, m, n, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), K=k, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=MATMUL_BLOCK_K, GROUP_M=cfg.group_m, EVEN_K=k % MATMUL_BLOCK_K == 0,
        PRECISION=_precision(x.dtype), INTERPRETED=x.device.type != "cuda", num_warps=cfg.num_warps,
        num_stages=_stages(cfg.num_stages, x.dtype))
    return y


# -------------------------------------------------------------------------------------------- rms_norm


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x, w, y, M, sxm, eps, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < M)[:, None] & cmask[None, :]
    xf = tl.load(x + rows.to(tl.int64)[:, None] * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(_sum(xf * xf, 1) / D + eps)
    normed = (xf * rstd[:, None]).to(y.dtype.element_ty).to(tl.float32)
    wf = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    out = (wf[None, :] * normed).to(y.dtype.element_ty)
    tl.store(y + rows.to(tl.int64)[:, None] * D + cols[None, :], out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF `Qwen3RMSNorm` of `[M, D]` rows: `weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)`, in x's dtype.

    The final product is taken in fp32 and rounded once to x's dtype, which is what a 16-bit torch multiply
    does (the product of two 16-bit values is exact in fp32). Batch-invariant: a row's sum of squares is
    one in-program reduction over a `[ROWS, next_pow2(D)]` block whose shape depends on D only.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, d = x.shape
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_d = triton.next_power_of_2(d)
    rows = max(1, RMS_BLOCK_ELEMS // block_d)
    _rms_norm_kernel[(triton.cdiv(m, rows),)](x, weight, y, m, x.stride(0), eps, D=d, ROWS=rows, BLOCK_D=block_d,
                                              num_warps=8 if block_d >= 4096 else 4)
    return y


# -------------------------------------------------------------------------------------- logsumexp_rows


@triton.jit
def _logsumexp_kernel(z, out, szm, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z + row.to(tl.int64) * szm
    lanes = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.full([BLOCK_V], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + lanes, mask=v0 + lanes < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
        alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_new))  # also 1 while the lane is still all -inf
        e = tl.where(m_new == float("-inf"), 0.0, tl.exp(x - m_new))
        s = s * alpha + e
        m = m_new
    mx = _max(m, 0)
    total = _sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), 0)
    res = tl.where(mx == float("inf"), float("inf"), mx + tl.log(total))
    tl.store(out + row, res)


def logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(z, -1)` of `[M, V]` float32 -> `[M]` float32, one program per row.

    Batch-invariant: each lane of a `LSE_BLOCK_V` vector keeps an online max and rescaled sum over the
    row's chunks in order, then one fixed in-register reduction combines the lanes. A row of all -inf gives
    -inf (no NaN); a row holding +inf gives +inf; NaN gives NaN.
    """
    if z.dim() != 2 or z.dtype != torch.float32:
        raise ValueError(f"logsumexp_rows: wants [M, V] float32, got {tuple(z.shape)} {z.dtype}")
    if z.stride(1) != 1:
        z = z.contiguous()
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0] > 0:
        _logsumexp_kernel[(z.shape[0],)](z, out, z.stride(0), V=z.shape[1], BLOCK_V=LSE_BLOCK_V,
                                         num_warps=LSE_NUM_WARPS)
    return out


# ------------------------------------------------------------------------------------------- attention


@triton.jit
def _attend_block(q, k_base, v_base, start, pmax, p, m_i, l_i, acc, qk_scale, skl, svl, d, kprefix, klane, kstride,
                  BLOCK_N: tl.constexpr, GROUPED: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Keys [start, start + BLOCK_N) of the sequence, for all rows of the tile: one online-softmax step."""
    j = start + tl.arange(0, BLOCK_N)
    kmask = (j <= pmax)[:, None]
    jj = j.to(tl.int64)  # the key's index in the cache row: its position, or in the grouped layout
    if GROUPED:  # the prompt's keys at [0, P), then sample `klane`'s at P + (position - P) * kstride + klane
        jj = tl.where(j < kprefix, jj, kprefix + (jj - kprefix) * kstride + klane)
    kt = tl.load(k_base + jj[:, None] * skl + d[None, :], mask=kmask, other=0.0)
    vt = tl.load(v_base + jj[:, None] * svl + d[None, :], mask=kmask, other=0.0)
    s = _dot(q, tl.trans(kt), None, PRECISION, INTERPRETED) * qk_scale
    s = tl.where(j[None, :] <= p[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, _max(s, 1))
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))  # exactly 1 for a row this block cannot see
    pr = tl.exp2(s - m_new[:, None])  # exactly 0 where masked
    l_i = l_i * alpha + _sum(pr, 1)
    acc = _dot(pr.to(vt.dtype), vt, acc * alpha[:, None], PRECISION, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(q, k, v, out, pos, tile_tok0, tile_ntok, tile_kb, tile_kstart, tile_kprefix, tile_klane,
                      kstride, qk_scale, T, sqb, sqt, sqh, skb, skl, skh, svb, svl, svh,
                      H: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, GROUPED: tl.constexpr, PRECISION: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # last tiles first: within a document they are the longest
    g = tl.program_id(1)
    tok0 = tl.load(tile_tok0 + i)
    ntok = tl.load(tile_ntok + i)
    kb = tl.load(tile_kb + i).to(tl.int64)
    kstart = tl.load(tile_kstart + i).to(tl.int64)
    kprefix = 0
    klane = 0
    if GROUPED:
        kprefix = tl.load(tile_kprefix + i).to(tl.int64)
        klane = tl.load(tile_klane + i).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    valid = r // G < ntok
    tok = (tok0 + r // G).to(tl.int64)
    head = g * G + r % G
    p = tl.load(pos + tok, mask=valid, other=0).to(tl.int32)  # invalid rows: position 0, q = 0 (no NaN)
    pmax = _max(tl.where(valid, p, 0), 0)
    d = tl.arange(0, HD)
    qv = tl.load(q + ((tok // T) * sqb + (tok % T) * sqt + head * sqh)[:, None] + d[None, :],
                 mask=valid[:, None], other=0.0)
    k_base = k + kb * skb + kstart * skl + g * skh
    v_base = v + kb * svb + kstart * svl + g * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HD], 0.0, tl.float32)
    if INTERPRETED:
        start = 0
        while start <= pmax:
            m_i, l_i, acc = _attend_block(qv, k_base, v_base, start, pmax, p, m_i, l_i, acc, qk_scale, skl, svl,
                                          d, kprefix, klane, kstride, BLOCK_N, GROUPED, PRECISION, INTERPRETED)
            start += BLOCK_N
    else:
        for start in range(0, pmax + 1, BLOCK_N):
            m_i, l_i, acc = _attend_block(qv, k_base, v_base, start, pmax, p, m_i, l_i, acc, qk_scale, skl, svl,
                                          d, kprefix, klane, kstride, BLOCK_N, GROUPED, PRECISION, INTERPRETED)
    o = acc / l_i[:, None]
    tl.store(out + (tok * (H * HD) + head * HD)[:, None] + d[None, :], o.to(out.dtype.element_ty),
             mask=valid[:, None])


def tokens_per_tile(group: int) -> int:
    """Query tokens per attention tile for `group` = H // n_kv query heads per KV head."""
    if not 1 <= group <= ATTN_BLOCK_M:
        raise ValueError(f"attention: {group} query heads per KV head; at most {ATTN_BLOCK_M} are supported")
    return ATTN_BLOCK_M // group


TOKENS_PER_TILE = tokens_per_tile


def attention(q, k, v, positions, tile_tok0, tile_ntok, tile_kb, tile_kstart, scale: float, tile_kprefix=None,
              tile_klane=None, kstride: int = 1) -> torch.Tensor:
    """Causal attention over tiles of query tokens; returns `[B, T, H, hd]` contiguous in q's dtype.

    q `[B, T, H, hd]`, k/v `[KB, L, n_kv, hd]` (any strides, last dim contiguous), positions `[B*T]` (of
    flat token n = b T + t). Tile i (int32 metadata) covers tokens `tile_tok0[i] + [0, tile_ntok[i])` of one
    sequence whose position-0 key is `k[tile_kb[i], tile_kstart[i]]`. Tokens in no tile come out as zeros.
    With `tile_kprefix` / `tile_klane` (the engine's grouped layout, `layout.Tiles`) the key of position j is at
    `kstart + j` below the tile's prefix P and at `kstart + P + (j - P) kstride + lane` from P on.

    Batch-invariant: every query row takes its keys in blocks of `ATTN_BLOCK_N` absolute positions from
    its sequence's position 0, in order, with one online softmax (fp32 m, l, acc). The loop runs to the
    tile's highest position (read in the kernel: no host sync, graph-capturable); a block past a row's own
    position is an exact no-op for it (alpha = 1, p = 0), so a row's bits do not depend on its tile
    neighbours, hence not on whether prefill, decode, packed or padded training called it.
    """
    bsz, t, h, hd = q.shape
    n_kv, hd_k = k.shape[2:]
    if v.shape != k.shape or hd_k != hd or h % n_kv or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hd < 16 or hd > 256 or hd & (hd - 1):
        raise ValueError(f"attention: head_dim {hd} is not a power of two in [16, 256]")
    group = h // n_kv
    tokens_per_tile(group)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.zeros((bsz, t, h, hd), dtype=q.dtype, device=q.device)
    n_tiles = tile_tok0.numel()
    if n_tiles == 0:
        return out
    grouped = tile_kprefix is not None
    tiles = [x.to(torch.int32).contiguous() for x in (tile_tok0, tile_ntok, tile_kb, tile_kstart)]
    lanes = [x.to(torch.int32).contiguous() for x in (tile_kprefix, tile_klane)] if grouped else tiles[:2]
    _attention_kernel[(n_tiles, n_kv)](
        q, k, v, out, positions.reshape(-1).contiguous(), *tiles, *lanes, kstride, scale * LOG2E, t, *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], H=h, G=group, HD=hd,
        BLOCK_M=ATTN_BLOCK_M, BLOCK_N=ATTN_BLOCK_N, GROUPED=grouped, PRECISION=_precision(q.dtype),
        INTERPRETED=q.device.type != "cuda", num_warps=ATTN_NUM_WARPS,
        num_stages=_stages(ATTN_NUM_STAGES, q.dtype))
    return out
