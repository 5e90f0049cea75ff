"""The megakernel's attention stage in Gluon: each warp runs its own online softmax over a quarter of a block.

Why: the Triton attention stage (`triton_stages._stage_attend`) was the longest stage of a layer; its sm_90 SASS
has 19 CTA barriers (the q/k norms, the row max and row sum of every block, the conversions of q, K, V and p into
tensor-core operands), most of them after the PDL wait. Here no reduction of a block crosses warps, and the cached
K and V are copied to shared memory (cp.async) before the wait, ldmatrix'd into operands after it.

Tasks are those of `triton_stages._stage_attend` (`attn_grid`: a task is a KV head and a split of `per`
consecutive 64-position blocks), and so are the partial slots the merge kernel (`triton_stages._stage_merge`)
reads. Within a task, warp w takes positions [16 w, 16 w + 16) of every block: the scores `q @ K^T` and `p @ V`
are batched mma (the warp is the batch dimension), and each warp keeps its own running max, sum and accumulator.
The four warps' partials are combined once, at the end of the task, through shared memory. A task of exactly two
blocks (`PAIR`) takes both in one step: two independent score chains and one softmax update instead of a second,
serial block; tasks hold MIN_PER blocks at least (the merge kernel's grid too). Longer tasks run block after block,
a two-buffer ring copying the block after next. The KV group's q heads are padded to 16 rows (mma's M). After the
wait every load of a task goes out in one round trip (the group's q heads and the new token's k and v; the norm
weights and the RoPE row were loaded before the wait). q and the new k are normed and rotated in a small layout
(the real q rows only); q reaches the mma through shared memory. The block loop reads cached positions only
(`< pos`); the new token is a rank-1 term, its score `scale * q . k_new` computed once per task and joined to the
partial where the warps' partials are combined (not selected into the mma operands, which cost most of the block
loop's instructions). Rounding as in `triton_stages`: q and the new K are bf16 values, p is rounded to bf16 for
`p @ V` (the new token's too), sums in fp32; the sums run in another order than the Triton stage's (per warp, then
across warps, then the new token), so the two agree to rounding, not bit for bit. GPU only (no interpreter).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from rlbench.engine.megakernel import layout
from rlbench.engine.megakernel.gluon_gemv import inline_ptx
from rlbench.engine.megakernel.triton_stages import attn_grid, task

WARPS = gl.constexpr(layout.ATTENTION_WARPS)
SPLIT = gl.constexpr(layout.SPLIT)
"""Positions per block, the merge kernel's (its task grid must be this one's); a warp takes SPLIT // WARPS."""
QR = gl.constexpr(layout.ATTENTION_ROWS)


@gluon.jit
def _iota(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """0 .. n - 1 along `dim` of a rank-3 tensor in `layout` (shape n there, 1 elsewhere)."""
    if dim == 0:
        i = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(i, 1), 2)
    elif dim == 1:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(i, 0), 2)
    else:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        return gl.expand_dims(gl.expand_dims(i, 0), 1)


@gluon.jit
def _fetch(kc, vc, ks, vs, g, blk, pos, head_stride, HD: gl.constexpr, layout: gl.constexpr):
    """Start copying KV head g's cached K and V of block `blk` into `ks`/`vs` `[WARPS, 16, HD]` (warp w:
    positions blk * 64 + 16 w + j; each warp copies its own rows), as one cp.async group; zeros at and after
    `pos` (the new token is not in the cache yet)."""
    P: gl.constexpr = SPLIT // WARPS
    p = blk * SPLIT + _iota(WARPS, 0, layout) * P + _iota(P, 1, layout)
    off = g * head_stride + p * HD + _iota(HD, 2, layout)
    async_copy.async_copy_global_to_shared(ks, kc + off, mask=p < pos, cache_modifier=".cg")
    async_copy.async_copy_global_to_shared(vs, vc + off, mask=p < pos, cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _q3(qs, la: gl.constexpr):
    """The task's q rows from shared memory as every warp's mma A operand `[WARPS, QR, HD]`."""
    q3, _w = gl.broadcast(gl.expand_dims(qs.load(gl.SliceLayout(0, la)), 0), gl.full([WARPS, 1, 1], 0, gl.bfloat16, la))
    return q3


@gluon.jit
def _scores(kbuf, q3, blk, pos, ws, scale, lb: gl.constexpr, mma: gl.constexpr):
    """Block `blk`'s scaled scores `[WARPS, QR, 16]` from its K in `kbuf` (`[WARPS, 16, HD]`), -inf at and after
    `pos` (cached positions only; `ws` where the block's positions sit)."""
    P: gl.constexpr = SPLIT // WARPS
    sc = mma_v2(q3, kbuf.permute([0, 2, 1]).load(lb), gl.zeros([WARPS, QR, P], gl.float32, mma)) * scale
    return gl.where(blk * SPLIT + ws < pos, sc, float("-inf"))


@gluon.jit
def _rn(x):
    """fp32 rounded to the nearest bf16 (ties to even), kept as fp32: the GPU's cvt.rn (Gluon has no CPU
    interpreter, so no integer emulation is needed; two instructions instead of `gluon_gemv._bf`'s five)."""
    return x.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _rot_pair(src, rows, rmask, HD: gl.constexpr, layout: gl.constexpr, CG: gl.constexpr):
    """Rows `rows` `[R, 1]` of `src` (`[*, HD]`) and the same rows permuted for rotate_half, as fp32 `[R, HD]`
    (both loads issued here, waited for at their first use)."""
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, layout))[None, :]
    rot = (d + HD // 2) % HD
    if CG:
        return (gl.load(src + rows * HD + d, mask=rmask, other=0.0, cache_modifier=".cg").to(gl.float32),
                gl.load(src + rows * HD + rot, mask=rmask, other=0.0, cache_modifier=".cg").to(gl.float32))
    return (gl.load(src + rows * HD + d, mask=rmask, other=0.0).to(gl.float32),
            gl.load(src + rows * HD + rot, mask=rmask, other=0.0).to(gl.float32))


@gluon.jit
def _norm_rope(a, b, norm, cos, sin, eps, HD: gl.constexpr, HAS_NORM: gl.constexpr, layout: gl.constexpr):
    """Head rows `a` and their rotate_half permutation `b` (`_rot_pair`) -> RMSNorm (Qwen3's q/k norm; `norm`
    the weight pair from `_rot_pair`) then HF RoPE (`cos`, `sin` `[1, HD]`): fp32 `[R, HD]` holding bf16 values,
    as `triton_stages._norm_rope`."""
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, layout))[None, :]
    if HAS_NORM:
        r = gl.expand_dims(1.0 / gl.sqrt(gl.sum(a * a, axis=1) / HD + eps), 1)
        a = _rn(norm[0] * _rn(a * r))
        b = _rn(norm[1] * _rn(b * r))
    b = gl.where(d < HD // 2, -b, b)
    return _rn(_rn(a * cos) + _rn(b * sin))


@gluon.jit
def attend_stage(qkv, kc, vc, q_norm, k_norm, cos, sin, pos_ptr, part_acc, part_m, part_l, eps,
                 scale, head_stride, max_splits, H: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr,
                 G: gl.constexpr, BG: gl.constexpr, HAS_NORM: gl.constexpr,
                 AHEAD: gl.constexpr, PAIR: gl.constexpr, MIN_PER: gl.constexpr):
    """One layer's attention for the token at `pos`: `qkv` the QKV stage's output (bf16, q heads then K then V),
    `kc`/`vc` this layer's cache `[slots, NKV, positions, HD]` (slot 0; `head_stride` between KV heads; the new
    K/V are written at `pos`), `q_norm`/`k_norm` the head norms (unread without HAS_NORM), `cos`/`sin` the
    token's RoPE row. Task (g, s)'s partial (unnormalised sums, running max, sum of exponentials of its BG q
    rows) goes to slot `g * max_splits + s` of `part_acc`/`part_m`/`part_l`. The next kernel launches at once
    (it is the merge: few registers). AHEAD: K/V blocks (1 or 2) copied before the wait; PAIR: a two-block task
    in one step; MIN_PER: blocks per task at least."""
    P: gl.constexpr = SPLIT // WARPS
    gl.static_assert(WARPS * QR == SPLIT)  # the exchanged accumulators [W, QR / 2, HD] fp32 fit one K buffer
    gl.static_assert(BG <= QR // 2)
    kv_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [WARPS, 1, 1], [2, 1, 0])  # 16-byte copies
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8])
    la: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    lb: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    rows_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])  # a warp holds whole rows
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    kv_sh: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[2, 1, 0])
    ksm = gl.allocate_shared_memory(gl.bfloat16, [2, WARPS, P, HD], kv_sh)  # two blocks: this one and the next
    vsm = gl.allocate_shared_memory(gl.bfloat16, [2, WARPS, P, HD], kv_sh)
    qs = gl.allocate_shared_memory(gl.bfloat16, [QR, HD], plain)
    vs = gl.allocate_shared_memory(gl.bfloat16, [1, HD], plain)
    ns = gl.allocate_shared_memory(gl.float32, [QR], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # new token's
    ms = gl.allocate_shared_memory(gl.float32, [WARPS, QR], plain)  # the warps' partials, exchanged
    ls = gl.allocate_shared_memory(gl.float32, [WARPS, QR], plain)
    # the warps' accumulators (8 rows, fp32, swizzled: mma's row-per-lane stores without bank conflicts) are
    # exchanged in the K buffers' bytes, once the task's blocks are done
    accs = ksm._reinterpret(gl.float32, [WARPS, QR // 2, HD], gl.SwizzledSharedLayout(2, 1, 8, order=[2, 1, 0]))
    red_l: gl.constexpr = gl.BlockedLayout([WARPS, 1, 1], [1, 1, 32], [1, 1, WARPS], [2, 1, 0])  # sums in-thread
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    pos = gl.load(pos_ptr).to(gl.int32)
    n_blocks, per, n_splits = attn_grid(pos, nprog, NKV, SPLIT, MIN_PER)
    n_tasks = NKV * n_splits
    g0, _, first0 = task(pid, n_splits, per)
    if pid < n_tasks:  # this program's first task's first AHEAD blocks (1 or 2), before the wait
        _fetch(kc, vc, ksm.index(0), vsm.index(0), g0, first0, pos, head_stride, HD, kv_l)
        if AHEAD == 2 and first0 + 1 < gl.minimum(first0 + per, n_blocks):
            _fetch(kc, vc, ksm.index(1), vsm.index(1), g0, first0 + 1, pos, head_stride, HD, kv_l)
    # token-independent rows (the RoPE row is written before the first layer's kernels): before the wait
    zero = gl.arange(0, 1, layout=gl.SliceLayout(1, rows_l))[:, None]
    d1 = gl.arange(0, HD, layout=gl.SliceLayout(0, rows_l))[None, :]
    live = zero >= 0
    q_nrm = _rot_pair(q_norm, zero, live & HAS_NORM, HD, rows_l, False)
    k_nrm = _rot_pair(k_norm, zero, live & HAS_NORM, HD, rows_l, False)
    cs = gl.load(cos + d1).to(gl.float32)
    sn = gl.load(sin + d1).to(gl.float32)
    qs.store(gl.zeros([QR, HD], gl.bfloat16, rows_l))  # the padding rows (q rows >= BG) stay zero
    gl.thread_barrier()
    inline_ptx("griddepcontrol.launch_dependents; // $0")
    inline_ptx("griddepcontrol.wait; // $0")
    jq = gl.arange(0, BG, layout=gl.SliceLayout(1, rows_l))[:, None]
    ws = _iota(WARPS, 0, mma) * P + _iota(P, 2, mma)  # [W, 1, P]: where a block's positions sit in the scores
    for t in range(pid, n_tasks, nprog):  # one per program (a second only where `per` rounds up short)
        g, s, first = task(t, n_splits, per)
        last = gl.minimum(first + per, n_blocks)
        # every load of the task in one round trip: the group's q heads, the new token's k and v
        qa, qb = _rot_pair(qkv, g * G + jq, jq < G, HD, rows_l, True)
        ka, kb = _rot_pair(qkv, H + g + zero, live, HD, rows_l, True)
        v_new = gl.load(qkv + (H + NKV + g) * HD + d1 + zero, cache_modifier=".cg")
        gl.thread_barrier()  # the previous task's reads of the shared buffers are done (unconditional: one barrier)
        if t != pid:
            _fetch(kc, vc, ksm.index(0), vsm.index(0), g, first, pos, head_stride, HD, kv_l)
        if (t != pid or AHEAD == 1) and first + 1 < last:
            _fetch(kc, vc, ksm.index(1), vsm.index(1), g, first + 1, pos, head_stride, HD, kv_l)
        q = _norm_rope(qa, qb, q_nrm, cs, sn, eps, HD, HAS_NORM, rows_l)
        k_new = _norm_rope(ka, kb, k_nrm, cs, sn, eps, HD, HAS_NORM, rows_l)
        holds = last == n_blocks  # this task holds the new token: into the cache, and its rank-1 term
        if holds:
            gl.store(kc + g * head_stride + pos * HD + d1 + zero, k_new.to(gl.bfloat16))
            gl.store(vc + g * head_stride + pos * HD + d1 + zero, v_new)
        qs.slice(0, BG).store(q.to(gl.bfloat16))
        ns.slice(0, BG).store(gl.sum(q * k_new, axis=1) * scale)
        vs.store(v_new)
        m_run = gl.full([WARPS, QR], float("-inf"), gl.float32, gl.SliceLayout(2, mma))
        l_run = gl.zeros([WARPS, QR], gl.float32, gl.SliceLayout(2, mma))
        acc = gl.zeros([WARPS, QR, HD], gl.float32, mma)
        start = first
        if PAIR and last - first == 2:  # both blocks at once: two independent score chains, one softmax step
            async_copy.wait_group(0)
            gl.thread_barrier()  # every thread's copies and the rows above visible
            q3 = _q3(qs, la)
            sa = _scores(ksm.index(0), q3, first, pos, ws, scale, lb, mma)
            sb = _scores(ksm.index(1), q3, first + 1, pos, ws, scale, lb, mma)
            m_run = gl.maximum(gl.max(sa, axis=2), gl.max(sb, axis=2))
            m_safe = gl.expand_dims(gl.where(m_run == float("-inf"), 0.0, m_run), 2)  # a warp may see none
            pa = gl.exp(sa - m_safe)
            pb = gl.exp(sb - m_safe)
            l_run = gl.sum(pa, axis=2) + gl.sum(pb, axis=2)
            acc = mma_v2(gl.convert_layout(pa.to(gl.bfloat16), la), vsm.index(0).load(lb), acc)
            acc = mma_v2(gl.convert_layout(pb.to(gl.bfloat16), la), vsm.index(1).load(lb), acc)
            start = last
        for blk in range(start, last):
            i = blk - first
            if blk + 1 < last:  # this block's copy has landed (the next one's may be in flight)
                async_copy.wait_group(1)
            else:
                async_copy.wait_group(0)
            gl.thread_barrier()  # every thread's copies (and, at the first block, the rows above) visible
            sc = _scores(ksm.index(i % 2), _q3(qs, la), blk, pos, ws, scale, lb, mma)
            m_new = gl.maximum(m_run, gl.max(sc, axis=2))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp may see no position yet
            keep = gl.exp(m_run - m_safe)
            p = gl.exp(sc - gl.expand_dims(m_safe, 2))
            l_run = l_run * keep + gl.sum(p, axis=2)
            acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), la), vsm.index(i % 2).load(lb),
                         acc * gl.expand_dims(keep, 2))
            m_run = m_new
            if blk + 2 < last:  # the block after next into this one's buffer
                gl.thread_barrier()
                _fetch(kc, vc, ksm.index(i % 2), vsm.index(i % 2), g, blk + 2, pos, head_stride, HD, kv_l)
        # the warps' partials and the new token into the task's, through shared memory (one barrier): every task
        # sees >= 1 position (the new token's task may see no cached one), so the max is finite; a warp that saw
        # none weighs 0. Only the first 8 q rows are exchanged: rows 8-15 are the other half of mma's registers,
        # split off for free
        acc8, _hi = gl.split(gl.permute(gl.reshape(acc, [WARPS, 2, QR // 2, HD]), [0, 2, 3, 1]))
        gl.thread_barrier()  # the previous task's reads of the exchange buffers are done
        ms.store(m_run)
        ls.store(l_run)
        accs.store(acc8)
        gl.thread_barrier()
        m = ms.slice(0, QR // 2, dim=1).load(gl.SliceLayout(2, red_l))  # [W, 8]
        s_new = ns.slice(0, QR // 2).load(gl.SliceLayout(0, gl.SliceLayout(2, red_l)))  # [8]
        m_tot = gl.max(m, axis=0)
        m_tot = gl.where(holds, gl.maximum(m_tot, s_new), m_tot)
        w = gl.exp(m - gl.expand_dims(m_tot, 0))
        p_new = gl.where(holds, gl.exp(s_new - m_tot), 0.0)
        l_tot = gl.sum(ls.slice(0, QR // 2, dim=1).load(gl.SliceLayout(2, red_l)) * w, axis=0) + p_new
        v_new3 = gl.expand_dims(vs.load(gl.SliceLayout(0, red_l)).to(gl.float32), 0)  # [1, 1, HD]
        p_new3 = gl.expand_dims(gl.expand_dims(_rn(p_new), 0), 2)  # [1, 8, 1]
        a_tot = gl.sum(accs.load(red_l) * gl.expand_dims(w, 2), axis=0) + gl.sum(p_new3 * v_new3, axis=0)  # [8, HD]
        slot = g * max_splits + s
        jr = gl.arange(0, QR // 2, layout=gl.SliceLayout(1, gl.SliceLayout(0, red_l)))
        dd = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(0, red_l)))
        gl.store(part_acc + (slot * BG + jr[:, None]) * HD + dd[None, :], a_tot, mask=(jr < BG)[:, None])
        jm = gl.arange(0, QR // 2, layout=m_tot.type.layout)
        gl.store(part_m + slot * BG + jm, m_tot, mask=jm < BG)
        gl.store(part_l + slot * BG + jm, l_tot, mask=jm < BG)
