"""Triton code of the batch-1 decode megakernel (`host.py` holds the host side and the why).

A layer is five stages, each split into tasks of about equal bytes, at most one per program for the GEMVs.
`decode_layers`: one persistent program per SM runs every layer, programs meet at a grid barrier between
stages. `decode_stage`: one stage of one layer per kernel, the kernels chained by programmatic dependent launch
(or plain stream order), and the attention merge as a sixth kernel instead of the ticket:

  A  QKV      rows of `[qkv] @ rmsnorm(x)`                     -> qkv buffer (bf16, as F.linear rounds)
  B  attend   (KV head, split of `per` 64-position blocks, no more tasks than programs) partial softmax;
              q/k-norm and RoPE recomputed per task; the block holding the new position writes its K/V into
              the cache; the last split to finish for a KV head (atomic ticket) merges the partials in split
              order (deterministic)
  C  o_proj   rows of `x += o @ attn`
  D  gate/up  rows of `act = silu(gate @ rmsnorm(x)) * (up @ rmsnorm(x))`
  E  down     rows of `x += down @ act`

Weights and cached K/V do not depend on the token, so each program loads its next task's first weight chunk
(or its K/V tile) BEFORE it waits at the barrier (or the PDL wait): the HBM latency overlaps the wait instead
of following it.

Rounding follows the HF modules: every tensor HF holds in bf16 is rounded to bf16 at the same point (norm
outputs, linear outputs, RoPE products, residual sums); reductions run in fp32. Activation loads use
`.cg` (L2, the coherence point) because other programs wrote them since the last barrier.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rlbench.engine.megakernel.layout import TABLE

IN_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O_PROJ, POST_NORM, GATE_UP, DOWN, K_CACHE, V_CACHE = (
    tl.constexpr(i) for i in range(len(TABLE)))  # the pointer table's columns, in TABLE's order
N_COLS = tl.constexpr(len(TABLE))
Q_ROWS = tl.constexpr(16)  # an attention task's q heads, padded to the tensor cores' minimum M


@triton.jit
def round_bf16(x):
    """Round fp32 to the nearest bf16 (ties to even), kept as fp32: where HF holds a bf16 tensor.

    Integer rounding instead of `.to(tl.bfloat16)`, because Triton's CPU interpreter truncates that cast;
    this way the interpreter (tests) and the GPU round alike. Stores cast the already-rounded value.
    """
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return ((b >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(x):
    return round_bf16(x).to(tl.bfloat16)


@triton.jit
def _ptr(table, layer, col: tl.constexpr):
    """A bf16 tensor's address from the table, declared 16-byte aligned (`bind` checks it): without the hint
    Triton knows nothing of a loaded pointer's alignment and reads weights 2 bytes per instruction."""
    return tl.multiple_of(tl.load(table + layer * N_COLS + col).to(tl.pointer_type(tl.bfloat16)), 16)


@triton.jit
def _arrive(sync, arrived):
    """First half of a grid barrier: this program's stores are done; count it in (release). Returns the count
    `_wait` waits for: `arrived` (all programs' arrivals so far) plus this barrier's."""
    tl.debug_barrier()
    tl.atomic_add(sync, 1, sem="release", scope="gpu")
    return arrived + tl.num_programs(0)


@triton.jit
def _wait(sync, target, err, MAX_SPINS: tl.constexpr):
    """Second half: spin until `target` programs have arrived (the counter only grows). One thread polls, with
    atomics (cheaper than every warp polling with volatile loads).

    Split from `_arrive` so that a program issues its next weight loads between the two: a release fence waits
    for the thread's outstanding loads, so loads issued before arriving would delay the arrival by their latency.
    A program that spins MAX_SPINS times (some program is not resident) adds 2**30 to the counter, more than any
    target of a launch, so no wait of this launch blocks again, and raises `err` for the host: a stall and an
    error, not a hang.

    Every poll is an ACQUIRE (`ld.global.gpu.acquire`) whose value the loop reads, so the poll that sees `target`
    has completed before the CTA barrier lets the other threads on: an acquire whose result is unused is dropped
    by Triton, and without one, loads through L1 after the barrier (the cp.async pipeline's `cp.async.ca`) read
    stale activations (the offline compile test counts the acquires).
    """
    seen = tl.atomic_add(sync, 0, sem="acquire", scope="gpu")
    spins = tl.full([], 0, tl.int32)
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(sync, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_add(sync, 1 << 30, sem="relaxed", scope="gpu")
        tl.store(err, 1)
    tl.debug_barrier()


@triton.jit
def _rstd(x_ptr, D: tl.constexpr, eps, BD: tl.constexpr):
    d = tl.arange(0, BD)
    x = tl.load(x_ptr + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)


@triton.jit
def _rows(t, rows_per, N: tl.constexpr, BR: tl.constexpr):
    """Task t's output rows `[BR]` and their mask (rows_per of them, inside N)."""
    i = tl.arange(0, BR)
    rows = t * rows_per + i
    return rows, (i < rows_per) & (rows < N)


@triton.jit
def _stacked_rows(t, rows_per, N: tl.constexpr, BR: tl.constexpr):
    """Task t's `[gate rows; up rows]` of the stacked `[2 N, K]` gate/up weight: `[2 BR]` rows and mask."""
    i = tl.arange(0, 2 * BR)
    local = i % BR
    out = t * rows_per + local
    return out + (i // BR) * N, (local < rows_per) & (out < N)


@triton.jit
def _w_chunk(w, rows, rmask, K: tl.constexpr, k0, BK: tl.constexpr):
    """Weight tile `w[rows, k0:k0+BK]` (bf16), streamed (read once per step)."""
    ks = k0 + tl.arange(0, BK)
    return tl.load(w + rows[:, None] * K + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _v_raw(v_ptr, norm_ptr, K: tl.constexpr, k0, NORMED: tl.constexpr, BK: tl.constexpr):
    """The loads of activation chunk `v[k0:k0+BK]` (and its norm weights): (v, norm) as fp32, masked past K."""
    ks = k0 + tl.arange(0, BK)
    kmask = ks < K
    v = tl.load(v_ptr + ks, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    scale = v
    if NORMED:
        scale = tl.load(norm_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
    return v, scale


@triton.jit
def _norm_chunk(norm_ptr, K: tl.constexpr, BK: tl.constexpr):
    """The first chunk `[BK]` of an RMSNorm's weights as fp32 (token-independent: loaded before a barrier)."""
    ks = tl.arange(0, BK)
    return tl.load(norm_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)


@triton.jit
def _v_apply(v, scale, rstd, NORMED: tl.constexpr):
    """With NORMED, `bf16(norm * bf16(v * rstd))` (HF RMSNorm) of a raw chunk; else the chunk itself."""
    if NORMED:
        v = round_bf16(scale * round_bf16(v * rstd))
    return v


@triton.jit
def _gemv(w0, s0, w, rows, rmask, K: tl.constexpr, v_ptr, norm_ptr, eps, NORMED: tl.constexpr, BK: tl.constexpr,
          BD: tl.constexpr, STAGES: tl.constexpr):
    """fp32 `w[rows] @ v` for a row tile; `w0` is its first K chunk and `s0` (NORMED) the first chunk of the norm
    weights, both loaded earlier (before a barrier).

    Every chunk can cost a round trip after the barrier, so tiles are cut to be one chunk where registers allow
    (TILE_ELEMS): then the weights are all in flight before the barrier. Otherwise register double buffering
    keeps the next chunk's weights and activation in flight. With NORMED, v is `rmsnorm(v) * norm` (`v` has BD
    entries, padded); a one-chunk tile takes the RMS from the chunk it loaded instead of a separate load.
    STAGES > 1 (tiles of many chunks, `layout.PIPELINE_STAGES`): the chunks after the first go through
    Triton's software pipeline instead (cp.async into shared memory, STAGES - 1 in flight, no registers held)."""
    if BK >= K:
        v, _ = _v_raw(v_ptr, norm_ptr, K, 0, False, BK)
        if NORMED:
            v = round_bf16(s0 * round_bf16(v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / K + eps))))
        acc = tl.sum(w0.to(tl.float32) * v[None, :], axis=1)
    else:
        # chunk k0 + BK (weights AND activation) is in flight while chunk k0 is used (masked past K: no load); the
        # first activation chunk is loaded with the RMS, in the same trip
        v_cur, s_cur = _v_raw(v_ptr, norm_ptr, K, 0, False, BK)
        if NORMED:
            s_cur = s0
        rstd = _rstd(v_ptr, K, eps, BD) if NORMED else 1.0
        if STAGES > 1:
            acc = tl.sum(w0.to(tl.float32) * _v_apply(v_cur, s_cur, rstd, NORMED)[None, :], axis=1)
            v_cur, s_cur = _v_raw(v_ptr, norm_ptr, K, BK, NORMED, BK)
            for k0 in tl.range(BK, K, BK, num_stages=STAGES):
                w_c = _w_chunk(w, rows, rmask, K, k0, BK)
                v_next, s_next = _v_raw(v_ptr, norm_ptr, K, k0 + BK, NORMED, BK)
                acc += tl.sum(w_c.to(tl.float32) * _v_apply(v_cur, s_cur, rstd, NORMED)[None, :], axis=1)
                v_cur, s_cur = v_next, s_next
        else:
            acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
            w_cur = w0
            for k0 in range(0, K, BK):
                w_next = _w_chunk(w, rows, rmask, K, k0 + BK, BK)
                v_next, s_next = _v_raw(v_ptr, norm_ptr, K, k0 + BK, NORMED, BK)
                acc += tl.sum(w_cur.to(tl.float32) * _v_apply(v_cur, s_cur, rstd, NORMED)[None, :], axis=1)
                w_cur, v_cur, s_cur = w_next, v_next, s_next
    return acc


@triton.jit
def _stage_qkv(w, norm, bias, x, qkv_out, w0, s0, pid, nprog, eps, rows_per, D: tl.constexpr, N: tl.constexpr,
               HAS_BIAS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
    for t in range(pid, tl.cdiv(N, rows_per), nprog):
        rows, rmask = _rows(t, rows_per, N, BR)
        if t != pid:  # a second task of this program (only when tasks outnumber programs)
            w0 = _w_chunk(w, rows, rmask, D, 0, BK)
        out = _gemv(w0, s0, w, rows, rmask, D, x, norm, eps, True, BK, BD, STAGES)
        if HAS_BIAS:
            out += tl.load(bias + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(qkv_out + rows, _to_bf16(out), mask=rmask)


@triton.jit
def _norm_rope(src, heads, hmask, norm, cos, sin, eps, HD: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads `[BG]` of `src` (`[*, HD]` rows, bf16) -> per-head RMSNorm (Qwen3) then HF RoPE, as fp32 `[BG, HD]`
    holding bf16 values. rotate_half(x) = [-x2, x1] is read as a second, permuted load; `norm` is the pair of
    norm weights and their permutation (loaded before the stage's barrier), cos/sin the token's RoPE row (loaded
    once per launch), all `[HD]` fp32."""
    d = tl.arange(0, HD)
    rot = (d + HD // 2) % HD
    m = hmask[:, None]
    a = tl.load(src + heads[:, None] * HD + d[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    b = tl.load(src + heads[:, None] * HD + rot[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / HD + eps)
        a = round_bf16(norm[0][None, :] * round_bf16(a * r[:, None]))
        b = round_bf16(norm[1][None, :] * round_bf16(b * r[:, None]))
    b = tl.where(d[None, :] < HD // 2, -b, b)
    return round_bf16(round_bf16(a * cos[None, :]) + round_bf16(b * sin[None, :]))


@triton.jit
def _norm_pair(norm_ptr, HD: tl.constexpr, HAS_NORM: tl.constexpr):
    """A head norm's weights `[HD]` and their rotate_half permutation, as fp32 (zeros without the norm)."""
    d = tl.arange(0, HD)
    rot = (d + HD // 2) % HD
    return (tl.load(norm_ptr + d, mask=(d >= 0) & HAS_NORM, other=0.0).to(tl.float32),
            tl.load(norm_ptr + rot, mask=(d >= 0) & HAS_NORM, other=0.0).to(tl.float32))


@triton.jit
def _kv_block(kc, vc, g, blk, pos, live, head_stride, HD: tl.constexpr, SPLIT: tl.constexpr):
    """KV head g's cached K and V `[SPLIT, HD]` (bf16) of block `blk`: positions before `pos` only (the new one
    is not in the cache yet; the task holding it takes it from registers); nothing is read unless `live`."""
    offs = blk * SPLIT + tl.arange(0, SPLIT)
    cached = (offs < pos) & live
    off = g * head_stride + offs[:, None] * HD + tl.arange(0, HD)[None, :]
    k = tl.load(kc + off, mask=cached[:, None], other=0.0, cache_modifier=".cg")
    v = tl.load(vc + off, mask=cached[:, None], other=0.0, cache_modifier=".cg")
    return k, v


@triton.jit
def task(t, n_splits, per):
    """Attention task t -> (KV head, split, first block): a split is `per` consecutive 64-position blocks."""
    return t // n_splits, t % n_splits, (t % n_splits) * per


@triton.jit
def _stage_attend(kc, vc, q_norm, k_norm, layer, qkv, cos, sin, pos, n_blocks, per, n_splits, k0, v0,
                  part_acc, part_m, part_l, tickets, attn_out, pid, nprog, eps, scale, head_stride, max_splits,
                  H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                  SPLIT: tl.constexpr, HAS_NORM: tl.constexpr, CS: tl.constexpr, BF16_DOT: tl.constexpr,
                  TICKET: tl.constexpr = True):
    """Tasks are (KV head, split); a split runs `per` blocks with an online softmax, so that there are never more
    tasks than programs (`per` grows with the context). Each task's partial goes to its slot; with TICKET (the
    grid-barrier kernel) the last task of a KV head to finish (atomic ticket) merges the slots in split order,
    otherwise the next kernel does (`_stage_merge`)."""
    d = tl.arange(0, HD)
    jq = tl.arange(0, Q_ROWS)
    for t in range(pid, NKV * n_splits, nprog):  # one per program (a second only where `per` rounds up short)
        g, s, first = task(t, n_splits, per)
        k_cur, v_cur = k0, v0
        if t != pid:
            k_cur, v_cur = _kv_block(kc, vc, g, first, pos, True, head_stride, HD, SPLIT)
        # Every load of the task in ONE round trip, before any store (a load after a store may alias it, so the
        # compiler would wait): the group's q heads, and the new token's K and V (used by the last block only).
        q = _norm_rope(qkv, g * G + jq, jq < G, q_norm, cos, sin, eps, HD, HAS_NORM)  # [Q_ROWS, HD]
        kv_head = tl.full([1], H, tl.int32) + g
        k_new = _norm_rope(qkv, kv_head, kv_head >= 0, k_norm, cos, sin, eps, HD, HAS_NORM)  # [1, HD]
        v_new = tl.load(qkv + (H + NKV + g) * HD + d, cache_modifier=".cg")
        acc, m_run, l_run = _blocks(kc, vc, q, g, first, per, n_blocks, pos, k_cur, v_cur, k_new, v_new, scale,
                                    head_stride, HD, SPLIT, BF16_DOT)
        slot = g * max_splits + s
        tl.store(part_acc + (slot * BG + jq[:, None]) * HD + d[None, :], acc, mask=(jq < BG)[:, None])
        tl.store(part_m + slot * BG + jq, m_run, mask=jq < BG)
        tl.store(part_l + slot * BG + jq, l_run, mask=jq < BG)
        if TICKET:
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets + layer * NKV + g, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:  # the last split of this KV head merges all of them, in split order
                _merge(part_acc, part_m, part_l, attn_out, g, n_splits, max_splits, HD, G, BG, CS)


@triton.jit
def _blocks(kc, vc, q, g, first, per, n_blocks, pos, k_cur, v_cur, k_new, v_new, scale, head_stride,
            HD: tl.constexpr, SPLIT: tl.constexpr, BF16_DOT: tl.constexpr):
    """A task's blocks on the tensor cores, the group's q heads padded to Q_ROWS rows (mma's minimum): `q @ K^T`
    then `p @ V`, fp32 sums: a block is a few block-wide reductions, not ~10 per q head.

    BF16_DOT (GPU): bf16 operands, as flash attention (q, K, V are bf16 values; p is rounded to bf16), which
    keeps the operand tiles in shared memory small (36 KB): with fp32 operands (72 KB) the L1 left to the kernel
    shrank and every GEMV stage slowed. Under Triton's CPU interpreter, which multiplies bf16 dot operands as raw
    uint16, the operands are fp32 (same q, K, V values; p unrounded). Returns acc `[Q_ROWS, HD]`, m, l `[Q_ROWS]`."""
    d = tl.arange(0, HD)
    m_run = tl.full([Q_ROWS], float("-inf"), tl.float32)
    l_run = tl.zeros([Q_ROWS], tl.float32)
    acc = tl.zeros([Q_ROWS, HD], tl.float32)
    last = tl.minimum(first + per, n_blocks)
    for blk in range(first, last):
        k_next, v_next = _kv_block(kc, vc, g, blk + 1, pos, blk + 1 < last, head_stride, HD, SPLIT)  # in flight
        k, v = k_cur, v_cur
        offs = blk * SPLIT + tl.arange(0, SPLIT)
        if blk == n_blocks - 1:  # this block holds the new token: K/V from the qkv buffer, written to the cache
            tl.store(kc + g * head_stride + pos * HD + d[None, :], _to_bf16(k_new))
            tl.store(vc + g * head_stride + pos * HD + d, v_new)
            new = (offs == pos)[:, None]
            k = tl.where(new, _to_bf16(k_new), k)
            v = tl.where(new, v_new[None, :], v)
        scores = tl.where((offs <= pos)[None, :], _dot(q, tl.trans(k), BF16_DOT) * scale, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(scores, axis=1))  # finite: every block sees position blk * 64
        keep = tl.exp(m_run - m_new)  # 0 for the first block (m_run = -inf)
        p = tl.exp(scores - m_new[:, None])
        l_run = l_run * keep + tl.sum(p, axis=1)
        acc = acc * keep[:, None] + _dot(p, v, BF16_DOT)
        m_run = m_new
        k_cur, v_cur = k_next, v_next
    return acc, m_run, l_run


@triton.jit
def _dot(a, b, BF16: tl.constexpr):
    """fp32 `a @ b` for fp32 `a` (holding what is to be rounded) and bf16 `b`: bf16 operands with BF16 (GPU),
    fp32 operands otherwise (Triton's CPU interpreter multiplies bf16 dot operands as raw integers)."""
    if BF16:
        return tl.dot(_to_bf16(a), b)
    return tl.dot(a, b.to(tl.float32), input_precision="ieee")


@triton.jit
def _merge(part_acc, part_m, part_l, attn_out, g, n_splits, max_splits, HD: tl.constexpr, G: tl.constexpr,
           BG: tl.constexpr, CS: tl.constexpr):
    """Combine KV head g's split partials in split order, CS splits per load (one round trip for up to CS splits):
    the online-softmax merge, rescaling what is summed so far whenever the running max grows."""
    d = tl.arange(0, HD)
    jj = tl.arange(0, BG)
    m_tot = tl.full([BG], float("-inf"), tl.float32)
    l_tot = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, HD], tl.float32)
    for c0 in range(0, n_splits, CS):  # every split holds >= 1 visible position, so its max is finite
        ss = c0 + tl.arange(0, CS)
        sm = (ss < n_splits)[:, None]
        idx = (g * max_splits + ss[:, None]) * BG + jj[None, :]
        m = tl.load(part_m + idx, mask=sm, other=float("-inf"), cache_modifier=".cg")
        s_l = tl.load(part_l + idx, mask=sm, other=0.0, cache_modifier=".cg")
        a = tl.load(part_acc + idx[:, :, None] * HD + d[None, None, :], mask=sm[:, :, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_tot, tl.max(m, axis=0))
        keep = tl.exp(m_tot - m_new)
        w = tl.exp(m - m_new[None, :])
        l_tot = l_tot * keep + tl.sum(w * s_l, axis=0)
        acc = acc * keep[:, None] + tl.sum(w[:, :, None] * a, axis=0)
        m_tot = m_new
    out = acc / l_tot[:, None]
    tl.store(attn_out + (g * G + jj[:, None]) * HD + d[None, :], _to_bf16(out), mask=(jj < G)[:, None])


@triton.jit
def _stage_merge(part_acc, part_m, part_l, attn_out, pid, nprog, n_splits, max_splits, H: tl.constexpr, HD: tl.constexpr,
                 G: tl.constexpr, BG: tl.constexpr, CS: tl.constexpr):
    """The per-stage kernels' merge: a program combines one q head's split partials at a time (the same
    online-softmax merge as `_merge`, CS splits per load) with a few warps, so that the sums over splits need no
    CTA-wide reduction (cheaper than the grid-barrier kernel's ticket-merge inside the attention stage)."""
    for h in range(pid, H, nprog):
        g, j = h // G, h % G
        d = tl.arange(0, HD)
        m_tot = tl.full([], float("-inf"), tl.float32)
        l_tot = tl.zeros([], tl.float32)
        acc = tl.zeros([HD], tl.float32)
        for c0 in range(0, n_splits, CS):  # every split holds >= 1 visible position, so its max is finite
            ss = c0 + tl.arange(0, CS)
            sm = ss < n_splits
            idx = (g * max_splits + ss) * BG + j
            m = tl.load(part_m + idx, mask=sm, other=float("-inf"), cache_modifier=".cg")
            s_l = tl.load(part_l + idx, mask=sm, other=0.0, cache_modifier=".cg")
            a = tl.load(part_acc + idx[:, None] * HD + d[None, :], mask=sm[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_tot, tl.max(m, axis=0))
            keep = tl.exp(m_tot - m_new)
            w = tl.exp(m - m_new)
            l_tot = l_tot * keep + tl.sum(w * s_l, axis=0)
            acc = acc * keep + tl.sum(w[:, None] * a, axis=0)
            m_tot = m_new
        tl.store(attn_out + h * HD + d, _to_bf16(acc / l_tot))


@triton.jit
def _stage_residual(w, w0, x, v_ptr, pid, nprog, rows_per, D: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
                    BK: tl.constexpr, STAGES: tl.constexpr):
    """x[rows] = bf16(x[rows] + bf16(w[rows] @ v)) (o_proj and down_proj with their residual add)."""
    for t in range(pid, tl.cdiv(D, rows_per), nprog):
        rows, rmask = _rows(t, rows_per, D, BR)
        if t != pid:
            w0 = _w_chunk(w, rows, rmask, K, 0, BK)
        res = tl.load(x + rows, mask=rmask, other=0.0, cache_modifier=".cg").to(tl.float32)  # same trip as v's
        out = round_bf16(_gemv(w0, 0.0, w, rows, rmask, K, v_ptr, v_ptr, 0.0, False, BK, BK, STAGES))
        tl.store(x + rows, _to_bf16(res + out), mask=rmask)


@triton.jit
def _stage_gate_up(w, norm, x, act, w0, s0, pid, nprog, eps, rows_per, D: tl.constexpr, FFN: tl.constexpr,
                   BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
    """act[r] = bf16(bf16(silu(gate[r])) * up[r]); the tile stacks `[gate rows; up rows]` into one GEMV."""
    for t in range(pid, tl.cdiv(FFN, rows_per), nprog):
        rows, rmask = _stacked_rows(t, rows_per, FFN, BR)
        if t != pid:
            w0 = _w_chunk(w, rows, rmask, D, 0, BK)
        out = round_bf16(_gemv(w0, s0, w, rows, rmask, D, x, norm, eps, True, BK, BD, STAGES))  # [2 BR]
        pair = tl.reshape(out, (2, BR))
        first = (tl.arange(0, 2) == 0)[:, None]
        gate = tl.sum(tl.where(first, pair, 0.0), axis=0)
        up = tl.sum(tl.where(first, 0.0, pair), axis=0)
        silu = round_bf16(gate / (1.0 + tl.exp(-gate)))
        r, rm = _rows(t, rows_per, FFN, BR)
        tl.store(act + r, _to_bf16(silu * up), mask=rm)


@triton.jit
def _pre_qkv(table, layer, pid, r_qkv, live, D: tl.constexpr, N: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Stage A's token-independent loads for program pid: its first QKV weight chunk (none unless `live`) and the
    input norm's first chunk."""
    rows, rmask = _rows(pid, r_qkv, N, BR)
    return (_w_chunk(_ptr(table, layer, QKV), rows, rmask & live, D, 0, BK),
            _norm_chunk(_ptr(table, layer, IN_NORM), D, BK))


@triton.jit
def attn_grid(pos, nprog, NKV: tl.constexpr, SPLIT: tl.constexpr, MIN_PER: tl.constexpr = 1):
    """The attention task grid at `pos` for `nprog` programs: (blocks per KV head, blocks per task, splits); a task
    holds at least MIN_PER blocks."""
    n_blocks = pos // SPLIT + 1  # 64-position blocks per KV head
    per = tl.maximum(tl.cdiv(NKV * n_blocks, nprog), MIN_PER)  # blocks per attention task: no more tasks than programs
    return n_blocks, per, tl.cdiv(n_blocks, per)


@triton.jit
def _pre_attend(table, layer, pid, nprog, pos, head_stride, NKV: tl.constexpr, HD: tl.constexpr,
                SPLIT: tl.constexpr, HAS_QK_NORM: tl.constexpr):
    """Stage B's: the task grid at `pos`, program pid's first K/V block, and the q/k norm weights."""
    n_blocks, per, n_splits = attn_grid(pos, nprog, NKV, SPLIT)
    kc, vc = _ptr(table, layer, K_CACHE), _ptr(table, layer, V_CACHE)
    g0, _, first0 = task(pid, n_splits, per)
    k0, v0 = _kv_block(kc, vc, g0, first0, pos, pid < NKV * n_splits, head_stride, HD, SPLIT)
    q_norm = _norm_pair(_ptr(table, layer, Q_NORM), HD, HAS_QK_NORM)
    k_norm = _norm_pair(_ptr(table, layer, K_NORM), HD, HAS_QK_NORM)
    return n_blocks, per, n_splits, kc, vc, k0, v0, q_norm, k_norm


@triton.jit
def _pre_rows(table, layer, col: tl.constexpr, pid, rows_per, N: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
              BK: tl.constexpr):
    """Stages C and E's: the weight and program pid's first chunk of it."""
    w = _ptr(table, layer, col)
    rows, rmask = _rows(pid, rows_per, N, BR)
    return w, _w_chunk(w, rows, rmask, K, 0, BK)


@triton.jit
def _pre_gate_up(table, layer, pid, r_gu, D: tl.constexpr, FFN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Stage D's: the stacked gate/up weight, program pid's first chunk of it and the post norm's first chunk."""
    w = _ptr(table, layer, GATE_UP)
    rows, rmask = _stacked_rows(pid, r_gu, FFN, BR)
    return w, _w_chunk(w, rows, rmask, D, 0, BK), _norm_chunk(_ptr(table, layer, POST_NORM), D, BK)


@triton.jit
def _rope_row(cos, sin, HD: tl.constexpr):
    """The token's RoPE row (cos, sin) as fp32 `[HD]`: the same for every layer."""
    d = tl.arange(0, HD)
    return tl.load(cos + d).to(tl.float32), tl.load(sin + d).to(tl.float32)


@triton.jit
def decode_stage(table, x, cos, sin, pos_ptr, qkv, attn, act, part_acc, part_m, part_l, sync, layer, eps,
                 scale, head_stride, max_splits, r_qkv, r_o, r_gu, r_dn,
                 D: tl.constexpr, H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, FFN: tl.constexpr,
                 G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr, CS: tl.constexpr,
                 HAS_QKV_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                 BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr,
                 BR_GU: tl.constexpr, BK_GU: tl.constexpr, BR_DN: tl.constexpr, BK_DN: tl.constexpr,
                 ST_QKV: tl.constexpr, ST_O: tl.constexpr, ST_GU: tl.constexpr, ST_DN: tl.constexpr,
                 BF16_DOT: tl.constexpr, STAGE: tl.constexpr, PDL: tl.constexpr, MIN_PER: tl.constexpr = 1):
    """ONE stage of one layer as its own kernel (`DecodeMegakernel.stage_sync` "pdl" / "launch"): the tasks and
    stage code of `decode_layers`, with the kernel boundary as the barrier. Each program first issues its
    token-independent loads (weights, cached K/V), then, with PDL (programmatic dependent launch, sm_90+), lets
    the next stage's kernel launch (`griddepcontrol.launch_dependents`: its programs can start their own loads
    wherever an SM has room) and waits for the previous stage's kernel to complete with its memory visible
    (`griddepcontrol.wait`). Every global store and every read of an activation comes after that wait.
    STAGE 5 merges the attention partials (between stages 1 and 2; in the grid-barrier kernel the attention
    stage's last task per KV head does)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_qkv: tl.constexpr = (H + 2 * NKV) * HD
    if STAGE == 0:
        w_a, s_a = _pre_qkv(table, layer, pid, r_qkv, True, D, n_qkv, BR_QKV, BK_QKV)
        _stage_boundary(PDL)
        _stage_qkv(_ptr(table, layer, QKV), _ptr(table, layer, IN_NORM), _ptr(table, layer, QKV_BIAS), x, qkv,
                   w_a, s_a, pid, nprog, eps, r_qkv, D, n_qkv, HAS_QKV_BIAS, BR_QKV, BK_QKV, BD, ST_QKV)
    elif STAGE == 1:
        pos = tl.load(pos_ptr).to(tl.int32)
        n_blocks, per, n_splits, kc, vc, k0, v0, q_norm, k_norm = _pre_attend(
            table, layer, pid, nprog, pos, head_stride, NKV, HD, SPLIT, HAS_QK_NORM)
        cos_v, sin_v = _rope_row(cos, sin, HD)
        _stage_boundary(PDL)
        _stage_attend(kc, vc, q_norm, k_norm, layer, qkv, cos_v, sin_v, pos, n_blocks, per, n_splits, k0, v0,
                      part_acc, part_m, part_l, sync + 1, attn, pid, nprog, eps, scale, head_stride, max_splits,
                      H, NKV, HD, G, BG, SPLIT, HAS_QK_NORM, CS, BF16_DOT, False)
    elif STAGE == 5:
        _, _, n_splits = attn_grid(tl.load(pos_ptr).to(tl.int32), nprog, NKV, SPLIT, MIN_PER)  # the attention's
        _stage_boundary(PDL)
        _stage_merge(part_acc, part_m, part_l, attn, pid, nprog, n_splits, max_splits, H, HD, G, BG, CS)
    elif STAGE == 2:
        w_o, w_c = _pre_rows(table, layer, O_PROJ, pid, r_o, D, H * HD, BR_O, BK_O)
        _stage_boundary(PDL)
        _stage_residual(w_o, w_c, x, attn, pid, nprog, r_o, D, H * HD, BR_O, BK_O, ST_O)
    elif STAGE == 3:
        w_gu, w_d, s_d = _pre_gate_up(table, layer, pid, r_gu, D, FFN, BR_GU, BK_GU)
        _stage_boundary(PDL)
        _stage_gate_up(w_gu, _ptr(table, layer, POST_NORM), x, act, w_d, s_d, pid, nprog, eps, r_gu, D, FFN, BR_GU,
                       BK_GU, BD, ST_GU)
    else:
        w_dn, w_e = _pre_rows(table, layer, DOWN, pid, r_dn, D, FFN, BR_DN, BK_DN)
        _stage_boundary(PDL)
        _stage_residual(w_dn, w_e, x, act, pid, nprog, r_dn, D, FFN, BR_DN, BK_DN, ST_DN)


@triton.jit
def _stage_boundary(PDL: tl.constexpr):
    """With PDL: let the next kernel launch, then wait until the previous one has completed (memory visible).
    Without it (plain stream order, and Triton's interpreter, which runs no inline PTX) the launch orders them."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def decode_layers(table, x, cos, sin, pos_ptr, qkv, attn, act, part_acc, part_m, part_l, sync, err,
                  num_layers, eps, scale, head_stride, max_splits, r_qkv, r_o, r_gu, r_dn,
                  D: tl.constexpr, H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, FFN: tl.constexpr,
                  G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr, CS: tl.constexpr,
                  HAS_QKV_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                  BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr,
                  BR_GU: tl.constexpr, BK_GU: tl.constexpr, BR_DN: tl.constexpr, BK_DN: tl.constexpr,
                  ST_QKV: tl.constexpr, ST_O: tl.constexpr, ST_GU: tl.constexpr, ST_DN: tl.constexpr,
                  MAX_SPINS: tl.constexpr, BF16_DOT: tl.constexpr):
    """Every decoder layer for one token: x `[D]` bf16 is updated in place. `sync[0]` is the barrier counter,
    `sync[1:]` the per-(layer, KV head) merge tickets, all zero at launch; `err[0]` is set on a barrier timeout."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    pos = tl.load(pos_ptr).to(tl.int32)
    tickets = sync + 1
    arrived = nprog * 0
    n_qkv: tl.constexpr = (H + 2 * NKV) * HD
    w_a, s_a = _pre_qkv(table, 0, pid, r_qkv, True, D, n_qkv, BR_QKV, BK_QKV)
    cos_v, sin_v = _rope_row(cos, sin, HD)
    for layer in range(num_layers):  # each barrier: arrive, load the next stage's weights (or K/V), wait
        _stage_qkv(_ptr(table, layer, QKV), _ptr(table, layer, IN_NORM), _ptr(table, layer, QKV_BIAS), x, qkv,
                   w_a, s_a, pid, nprog, eps, r_qkv, D, n_qkv, HAS_QKV_BIAS, BR_QKV, BK_QKV, BD, ST_QKV)
        arrived = _arrive(sync, arrived)
        n_blocks, per, n_splits, kc, vc, k0, v0, q_norm, k_norm = _pre_attend(
            table, layer, pid, nprog, pos, head_stride, NKV, HD, SPLIT, HAS_QK_NORM)
        _wait(sync, arrived, err, MAX_SPINS)
        _stage_attend(kc, vc, q_norm, k_norm, layer, qkv, cos_v, sin_v, pos, n_blocks, per, n_splits, k0, v0,
                      part_acc, part_m, part_l, tickets, attn, pid, nprog, eps, scale, head_stride, max_splits,
                      H, NKV, HD, G, BG, SPLIT, HAS_QK_NORM, CS, BF16_DOT)
        arrived = _arrive(sync, arrived)
        w_o, w_c = _pre_rows(table, layer, O_PROJ, pid, r_o, D, H * HD, BR_O, BK_O)
        _wait(sync, arrived, err, MAX_SPINS)
        _stage_residual(w_o, w_c, x, attn, pid, nprog, r_o, D, H * HD, BR_O, BK_O, ST_O)
        arrived = _arrive(sync, arrived)
        w_gu, w_d, s_d = _pre_gate_up(table, layer, pid, r_gu, D, FFN, BR_GU, BK_GU)
        _wait(sync, arrived, err, MAX_SPINS)
        _stage_gate_up(w_gu, _ptr(table, layer, POST_NORM), x, act, w_d, s_d, pid, nprog, eps, r_gu, D, FFN, BR_GU,
                       BK_GU, BD, ST_GU)
        arrived = _arrive(sync, arrived)
        w_dn, w_e = _pre_rows(table, layer, DOWN, pid, r_dn, D, FFN, BR_DN, BK_DN)
        _wait(sync, arrived, err, MAX_SPINS)
        _stage_residual(w_dn, w_e, x, act, pid, nprog, r_dn, D, FFN, BR_DN, BK_DN, ST_DN)
        arrived = _arrive(sync, arrived)
        # the next layer's first QKV chunk (none after the last)
        w_a, s_a = _pre_qkv(table, tl.minimum(layer + 1, num_layers - 1), pid, r_qkv, layer + 1 < num_layers, D,
                            n_qkv, BR_QKV, BK_QKV)
        _wait(sync, arrived, err, MAX_SPINS)
