"""Triton code of the batch-1 decode megakernel (`megakernel.py` holds the host side and the why).

One persistent program per SM runs every decoder layer. A layer is five stages, each split into tasks
of about equal bytes, at most one per program for the GEMVs; programs meet at a grid barrier between stages:

  A  QKV      rows of `[qkv] @ rmsnorm(x)`                     -> qkv buffer (bf16, as F.linear rounds)
  B  attend   (KV head, 64-position split) partial softmax; q/k-norm and RoPE recomputed per task; the
              split holding the new position writes its K/V into the cache; the last split to finish
              for a KV head (atomic ticket) merges the partials in split order (deterministic)
  C  o_proj   rows of `x += o @ attn`
  D  gate/up  rows of `act = silu(gate @ rmsnorm(x)) * (up @ rmsnorm(x))`
  E  down     rows of `x += down @ act`

Rounding follows the HF modules: every tensor HF holds in bf16 is rounded to bf16 at the same point (norm
outputs, linear outputs, RoPE products, residual sums); reductions run in fp32. Activation loads use
`.cg` (L2, the coherence point) because other programs wrote them since the last barrier.
"""

from __future__ import annotations

import triton
import triton.language as tl

TABLE = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "k", "v")
"""Columns of the per-layer pointer table (`_ptr(table, layer, column)` reads them by these indices)."""


@triton.jit
def _bf(x):
    """Round fp32 to the nearest bf16 (ties to even), kept as fp32: where HF holds a bf16 tensor.

    Integer rounding instead of `.to(tl.bfloat16)`, because Triton's CPU interpreter truncates that cast;
    this way the interpreter (tests) and the GPU round alike. Stores cast the already-rounded value.
    """
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return ((b >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(x):
    return _bf(x).to(tl.bfloat16)


@triton.jit
def _ptr(table, layer, col: tl.constexpr):
    return tl.load(table + layer * 11 + col).to(tl.pointer_type(tl.bfloat16))


@triton.jit
def _grid_sync(sync, target):
    """Grid barrier: arrive on the counter, spin until all programs have (the counter only grows)."""
    tl.debug_barrier()
    tl.atomic_add(sync, 1, sem="release", scope="gpu")
    seen = tl.load(sync, volatile=True)
    while seen < target:
        seen = tl.load(sync, volatile=True)
    tl.atomic_add(sync, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rstd(x_ptr, D: tl.constexpr, eps, BD: tl.constexpr):
    d = tl.arange(0, BD)
    x = tl.load(x_ptr + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)


@triton.jit
def _gemv(w_ptr, rows, rmask, K: tl.constexpr, v_ptr, norm_ptr, rstd, NORMED: tl.constexpr, BK: tl.constexpr):
    """fp32 `w[rows] @ v` for a row tile `[R]`; with NORMED, v is `bf16(norm * bf16(v * rstd))` (HF RMSNorm)."""
    acc = tl.zeros([rows.shape[0], BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first")
        v = tl.load(v_ptr + ks, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        if NORMED:
            v = _bf(tl.load(norm_ptr + ks, mask=kmask, other=0.0).to(tl.float32) * _bf(v * rstd))
        acc += w.to(tl.float32) * v[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _stage_qkv(table, layer, x, qkv_out, pid, nprog, eps, rows_per, D: tl.constexpr, N: tl.constexpr,
               HAS_BIAS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    w, norm, bias = _ptr(table, layer, 1), _ptr(table, layer, 0), _ptr(table, layer, 2)
    for t in range(pid, tl.cdiv(N, rows_per), nprog):
        rows = t * rows_per + tl.arange(0, BR)
        rmask = (tl.arange(0, BR) < rows_per) & (rows < N)
        out = _gemv(w, rows, rmask, D, x, norm, _rstd(x, D, eps, BD), True, BK)
        if HAS_BIAS:
            out += tl.load(bias + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(qkv_out + rows, _to_bf16(out), mask=rmask)


@triton.jit
def _norm_rope(src, heads, hmask, norm, cos, sin, eps, HD: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads `[BG]` of `src` (`[*, HD]` rows, bf16) -> per-head RMSNorm (Qwen3) then HF RoPE, as fp32 `[BG, HD]`
    holding bf16 values. rotate_half(x) = [-x2, x1] is read as a second, permuted load."""
    d = tl.arange(0, HD)
    rot = (d + HD // 2) % HD
    m = hmask[:, None]
    a = tl.load(src + heads[:, None] * HD + d[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    b = tl.load(src + heads[:, None] * HD + rot[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / HD + eps)
        a = _bf(tl.load(norm + d).to(tl.float32)[None, :] * _bf(a * r[:, None]))
        b = _bf(tl.load(norm + rot).to(tl.float32)[None, :] * _bf(b * r[:, None]))
    b = tl.where(d[None, :] < HD // 2, -b, b)
    return _bf(_bf(a * cos[None, :]) + _bf(b * sin[None, :]))


@triton.jit
def _stage_attend(table, layer, qkv, cos_ptr, sin_ptr, pos, part_acc, part_m, part_l, tickets, attn_out, pid,
                  nprog, eps, scale, head_stride, max_splits, H: tl.constexpr, NKV: tl.constexpr,
                  HD: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, SPLIT: tl.constexpr,
                  HAS_NORM: tl.constexpr, CS: tl.constexpr):
    q_norm, k_norm = _ptr(table, layer, 3), _ptr(table, layer, 4)
    kc, vc = _ptr(table, layer, 9), _ptr(table, layer, 10)
    d = tl.arange(0, HD)
    jj = tl.arange(0, BG)
    cos = tl.load(cos_ptr + d).to(tl.float32)
    sin = tl.load(sin_ptr + d).to(tl.float32)
    n_splits = pos // SPLIT + 1
    for t in range(pid, NKV * n_splits, nprog):
        g = t // n_splits
        s = t % n_splits
        p0 = s * SPLIT
        if p0 + SPLIT > pos:  # this split holds the new token: write its K/V (roped k) into the cache
            kv_head = tl.full([1], H, tl.int32) + g
            k_new = _norm_rope(qkv, kv_head, kv_head >= 0, k_norm, cos, sin, eps, HD, HAS_NORM)
            v_new = tl.load(qkv + (H + NKV + g) * HD + d, cache_modifier=".cg")
            tl.store(kc + g * head_stride + pos * HD + d[None, :], _to_bf16(k_new))
            tl.store(vc + g * head_stride + pos * HD + d, v_new)
            tl.debug_barrier()
        heads = g * G + jj
        q = _norm_rope(qkv, heads, jj < G, q_norm, cos, sin, eps, HD, HAS_NORM)  # [BG, HD]
        offs = p0 + tl.arange(0, SPLIT)
        valid = offs <= pos
        kv_off = g * head_stride + offs[:, None] * HD + d[None, :]
        k = tl.load(kc + kv_off, mask=valid[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BG, SPLIT]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m = tl.max(scores, axis=1)
        p = tl.exp(scores - m[:, None])
        v = tl.load(vc + kv_off, mask=valid[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        acc = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [BG, HD]
        slot = g * max_splits + s
        tl.store(part_acc + (slot * BG + jj[:, None]) * HD + d[None, :], acc)
        tl.store(part_m + slot * BG + jj, m)
        tl.store(part_l + slot * BG + jj, tl.sum(p, axis=1))
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets + layer * NKV + g, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:  # the last split of this KV head merges all of them, in split order
            _merge(part_acc, part_m, part_l, attn_out, g, n_splits, max_splits, HD, G, BG, CS)


@triton.jit
def _merge(part_acc, part_m, part_l, attn_out, g, n_splits, max_splits, HD: tl.constexpr, G: tl.constexpr,
           BG: tl.constexpr, CS: tl.constexpr):
    d = tl.arange(0, HD)
    jj = tl.arange(0, BG)
    m_tot = tl.full([BG], float("-inf"), tl.float32)
    for c0 in range(0, n_splits, CS):
        ss = c0 + tl.arange(0, CS)
        idx = (g * max_splits + ss[:, None]) * BG + jj[None, :]
        m = tl.load(part_m + idx, mask=(ss < n_splits)[:, None], other=float("-inf"), cache_modifier=".cg")
        m_tot = tl.maximum(m_tot, tl.max(m, axis=0))
    l_tot = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, HD], tl.float32)
    for c0 in range(0, n_splits, CS):
        ss = c0 + tl.arange(0, CS)
        sm = (ss < n_splits)[:, None]
        idx = (g * max_splits + ss[:, None]) * BG + jj[None, :]
        w = tl.exp(tl.load(part_m + idx, mask=sm, other=float("-inf"), cache_modifier=".cg") - m_tot[None, :])
        l_tot += tl.sum(w * tl.load(part_l + idx, mask=sm, other=0.0, cache_modifier=".cg"), axis=0)
        a = tl.load(part_acc + idx[:, :, None] * HD + d[None, None, :], mask=sm[:, :, None], other=0.0,
                    cache_modifier=".cg")
        acc += tl.sum(w[:, :, None] * a, axis=0)
    out = acc / l_tot[:, None]
    tl.store(attn_out + (g * G + jj[:, None]) * HD + d[None, :], _to_bf16(out), mask=(jj < G)[:, None])


@triton.jit
def _stage_residual(w, x, v_ptr, pid, nprog, rows_per, D: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
                    BK: tl.constexpr):
    """x[rows] = bf16(x[rows] + bf16(w[rows] @ v)) (o_proj and down_proj with their residual add)."""
    for t in range(pid, tl.cdiv(D, rows_per), nprog):
        rows = t * rows_per + tl.arange(0, BR)
        rmask = (tl.arange(0, BR) < rows_per) & (rows < D)
        out = _bf(_gemv(w, rows, rmask, K, v_ptr, v_ptr, 1.0, False, BK))
        res = tl.load(x + rows, mask=rmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(x + rows, _to_bf16(res + out), mask=rmask)


@triton.jit
def _stage_gate_up(table, layer, x, act, pid, nprog, eps, rows_per, D: tl.constexpr, FFN: tl.constexpr,
                   BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """act[r] = bf16(bf16(silu(gate[r])) * up[r]); the tile stacks `[gate rows; up rows]` into one GEMV."""
    w, norm = _ptr(table, layer, 7), _ptr(table, layer, 6)
    for t in range(pid, tl.cdiv(FFN, rows_per), nprog):
        i = tl.arange(0, 2 * BR)
        local = i % BR
        rows_out = t * rows_per + local
        rmask = (local < rows_per) & (rows_out < FFN)
        rows = rows_out + (i // BR) * FFN
        out = _bf(_gemv(w, rows, rmask, D, x, norm, _rstd(x, D, eps, BD), True, BK))  # [2 BR]
        pair = tl.reshape(out, (2, BR))
        first = (tl.arange(0, 2) == 0)[:, None]
        gate = tl.sum(tl.where(first, pair, 0.0), axis=0)
        up = tl.sum(tl.where(first, 0.0, pair), axis=0)
        silu = _bf(gate / (1.0 + tl.exp(-gate)))
        r = t * rows_per + tl.arange(0, BR)
        tl.store(act + r, _to_bf16(silu * up), mask=(tl.arange(0, BR) < rows_per) & (r < FFN))


@triton.jit
def decode_layers(table, x, cos, sin, pos_ptr, qkv, attn, act, part_acc, part_m, part_l, sync, num_layers, eps,
                  scale, head_stride, max_splits, r_qkv, r_o, r_gu, r_dn,
                  D: tl.constexpr, H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, FFN: tl.constexpr,
                  G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr, CS: tl.constexpr,
                  HAS_QKV_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                  BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr,
                  BR_GU: tl.constexpr, BK_GU: tl.constexpr, BR_DN: tl.constexpr, BK_DN: tl.constexpr):
    """Every decoder layer for one token: x `[D]` bf16 is updated in place. `sync[0]` is the barrier counter,
    `sync[1:]` the per-(layer, KV head) merge tickets; all zero at launch."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    pos = tl.load(pos_ptr).to(tl.int32)
    tickets = sync + 1
    arrived = nprog * 0
    for layer in range(num_layers):
        _stage_qkv(table, layer, x, qkv, pid, nprog, eps, r_qkv, D, (H + 2 * NKV) * HD, HAS_QKV_BIAS,
                   BR_QKV, BK_QKV, BD)
        arrived += nprog
        _grid_sync(sync, arrived)
        _stage_attend(table, layer, qkv, cos, sin, pos, part_acc, part_m, part_l, tickets, attn, pid, nprog,
                      eps, scale, head_stride, max_splits, H, NKV, HD, G, BG, SPLIT, HAS_QK_NORM, CS)
        arrived += nprog
        _grid_sync(sync, arrived)
        _stage_residual(_ptr(table, layer, 5), x, attn, pid, nprog, r_o, D, H * HD, BR_O, BK_O)
        arrived += nprog
        _grid_sync(sync, arrived)
        _stage_gate_up(table, layer, x, act, pid, nprog, eps, r_gu, D, FFN, BR_GU, BK_GU, BD)
        arrived += nprog
        _grid_sync(sync, arrived)
        _stage_residual(_ptr(table, layer, 8), x, act, pid, nprog, r_dn, D, FFN, BR_DN, BK_DN)
        arrived += nprog
        _grid_sync(sync, arrived)
