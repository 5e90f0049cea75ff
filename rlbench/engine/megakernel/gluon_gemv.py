"""The megakernel's GEMV stages in Gluon: the weight tile lands in SHARED memory by TMA, not in registers.

Why: with PDL a stage's programs can start, and issue their weight loads, only where an SM has room. The Triton
stage kernels hold their in-flight weights in registers (125-250 per thread x 256 threads), so the next stage's
program gets an SM only when this stage's program leaves it, and QKV, gate/up and down load their weights on the
critical path while HBM idles. Here a program asks for few registers (4 warps) and keeps its whole tile (QKV 64 KB,
o_proj 32 KB, gate/up 96 KB, down 48 KB on the 0.6B shape) in shared memory, so the next GEMV stage's programs fit
beside the current ones and stream their tiles a stage ahead.

One kernel, `gemv_stage`, for the four GEMV stages (STAGE as in `triton_stages.decode_stage`: 0 QKV, 2 o_proj, 3
gate/up, 4 down). Program pid owns rows `[pid * R, pid * R + R)` (R a multiple of BOX_ROWS): before its PDL wait it
issues the TMA copies of its tile, paced (`_producer`: a few groups of boxes in flight, so that 132 programs do not
queue a whole stage's megabytes in front of the latency-bound work of the stages on the critical path); after the
wait it reads the stage input (RMSNorm'd for QKV and gate/up) into shared memory, waits for the rest of the tile,
and multiplies it on the tensor cores (`_consumer_mma`: the tile in 128-byte swizzled [4 rows, 8 chunks, 64]
boxes, one m16n8k16 mma per 8 K chunks of 8 rows). Each warp owns rows: the row sums stay inside a warp. When
the next kernel may launch (before or after the wait) is a per-stage choice (`layout.GLUON_LATE_LAUNCH`): it
decides how far ahead the next stage's tiles stream. Rounding as in `triton_stages`: every value HF holds in
bf16 is rounded to bf16 at the same point (integer round-to-nearest-even). The sums run in another order than the
Triton stages', so the two paths agree to bf16 rounding, not bit for bit. GPU only (no interpreter).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from rlbench.engine.megakernel import layout

BOX_ROWS = gl.constexpr(layout.BOX_ROWS)
MMA_CHUNK = gl.constexpr(layout.MMA_CHUNK)
MMA_SLICES = gl.constexpr(layout.MMA_SLICES)
MMA_BOX_ROWS = gl.constexpr(layout.MMA_BOX_ROWS)
MMA_IN = gl.constexpr(layout.MMA_IN)


def mma_box_layout() -> gl.NVMMASharedLayout:
    """The shared-memory layout of a tensor-core tile's TMA box [1 block, 4 rows, 8 chunks, 64] (the weight viewed
    as `[K / 512, rows, 8, 64]`): 128-byte swizzle, so that ldmatrix reads 8 chunks of one 16-byte column without
    bank conflicts."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)


@gluon.jit
def _bf(x):
    """fp32 rounded to the nearest bf16 (ties to even), kept as fp32 (as `triton_stages.round_bf16`)."""
    b = x.to(gl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return ((b >> 16) << 16).to(gl.float32, bitcast=True)


@gluon.jit
def inline_ptx(text: gl.constexpr):
    """One PTX instruction with side effects (e.g. `griddepcontrol.wait; // $0`: the dummy output keeps it)."""
    return gl.inline_asm_elementwise(text, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _store_rows(out, bias, rows, rmask, o, up, GATED: gl.constexpr, HAS_BIAS: gl.constexpr):
    """A row group's results, rounded as HF: silu(gate) * up for gate/up (`o` the gate sums, `up` the up sums),
    else the sums (+ the QKV bias)."""
    if GATED:
        g = _bf(o)
        silu = _bf(g / (1.0 + gl.exp(-g)))
        gl.store(out + rows, _bf(silu * _bf(up)).to(gl.bfloat16), mask=rmask)
    else:
        if HAS_BIAS:
            o += gl.load(bias + rows, mask=rmask, other=0.0).to(gl.float32)
        gl.store(out + rows, _bf(o).to(gl.bfloat16), mask=rmask)


@gluon.jit
def _mma_box_coords(j, row0, N: gl.constexpr, H: gl.constexpr, S: gl.constexpr):
    """Box j of a tensor-core tile, in the order the consumer reads them: (row group, gate/up, 512-wide K block,
    half of the 8 rows) -> its [block, row, 0, 0] in the weight's view `[K / 512, rows, 8, 64]`."""
    HALVES: gl.constexpr = BOX_ROWS // MMA_BOX_ROWS
    p = j % HALVES
    h = (j // HALVES) % H
    u = (j // (HALVES * H)) % S
    r = j // (HALVES * H * S)
    return h, row0 + r * BOX_ROWS + u * N + p * MMA_BOX_ROWS


@gluon.jit
def _chunk_rows(tile, tile_hi, c: gl.constexpr, n: gl.constexpr, LO: gl.constexpr):
    """Rows [c, c + n) (each a weight row's 8 chunks of 64 of one K block) of a tensor-core tile held in two
    buffers of power-of-two sizes (Gluon's layouts need them): `tile` has the first LO, `tile_hi` the rest."""
    if c < LO:
        return tile.slice(c, n)
    else:
        return tile_hi.slice(c - LO, n)


@gluon.jit
def _producer(desc, tile, tile_hi, LO: gl.constexpr, bars, row0, live, N: gl.constexpr, NC: gl.constexpr, S: gl.constexpr,
              NBOX: gl.constexpr, GROUP: gl.constexpr, IN_FLIGHT: gl.constexpr):
    """Issue the tile's TMA boxes in groups of GROUP on one mbarrier each, at most IN_FLIGHT groups in flight
    (before the PDL wait): with a small window a paced stream instead of one burst of the whole tile from every
    SM at once, which queues the latency-bound accesses of the stages on the critical path behind it. (A producer
    warp via warp_specialize would not hold up the PDL wait, but Triton then asks for 256 threads x 256
    registers per program: no neighbour could share the SM.)"""
    for g in gl.static_range((NBOX + GROUP - 1) // GROUP):
        if g >= IN_FLIGHT:
            mbarrier.wait(bars.index(g - IN_FLIGHT), 0, pred=live)
        mbarrier.expect(bars.index(g), min(GROUP, NBOX - g * GROUP) * MMA_BOX_ROWS * MMA_SLICES * MMA_CHUNK * 2,
                        pred=live)
        for jj in gl.static_range(min(GROUP, NBOX - g * GROUP)):
            h, row = _mma_box_coords(g * GROUP + jj, row0, N, NC // MMA_SLICES, S)
            dst = _chunk_rows(tile, tile_hi, (g * GROUP + jj) * MMA_BOX_ROWS, MMA_BOX_ROWS, LO)
            tma.async_copy_global_to_shared(desc, [h, row, 0, 0], bars.index(g),
                                            dst._reinterpret(gl.bfloat16, [1, MMA_BOX_ROWS, MMA_SLICES, MMA_CHUNK],
                                                             desc.layout), pred=live)


@gluon.jit
def _mma_rows(tile, tile_hi, LO: gl.constexpr, xs, b0, b1, rg: gl.constexpr, H: gl.constexpr, WARPS: gl.constexpr):
    """Row group `rg` (8 weight rows) of the tile times the input on the tensor cores -> `[8]`, in the layout the
    sums leave it in (converting it costs a CTA barrier, which would serialise the row groups).

    A 512-wide K block is cut into 8 chunks of 64 that one m16n8k16 mma multiplies side by side: A row (n, s)
    is weight row n's chunk s (the tile as landed: [8 rows x 8 chunks, 64]), B column c is the input's chunk c
    (`xs`), so C[(n, s)][c] is a partial dot product where s == c (the rest is discarded). Warp w owns weight
    rows 2w and 2w + 1, so no sum crosses warps; every weight is read from shared memory once, by ldmatrix, and
    goes through one mma (16 chunks side by side would need two n8 tiles: twice the mma work)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    NROW: gl.constexpr = BOX_ROWS * MMA_SLICES
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
    acc0 = gl.zeros([NROW, MMA_SLICES], gl.float32, layout=mma)
    acc1 = gl.zeros([NROW, MMA_SLICES], gl.float32, layout=mma)
    for h in gl.static_range(H):  # two accumulators: two chains of dependent mma, not one
        if h == 0:
            b = b0
        elif h == 1:
            b = b1
        else:
            b = xs.slice(h * MMA_SLICES, MMA_SLICES).permute([1, 0]).load(gl.DotOperandLayout(1, mma, 2))
        a = _chunk_rows(tile, tile_hi, (rg * H + h) * BOX_ROWS, BOX_ROWS, LO)._reinterpret(
            gl.bfloat16, [NROW, MMA_CHUNK], swz).load(gl.DotOperandLayout(0, mma, 2))
        if h % 2 == 0:
            acc0 = mma_v2(a, b, acc0)
        else:
            acc1 = mma_v2(a, b, acc1)
    i = gl.arange(0, NROW, layout=gl.SliceLayout(1, mma))
    c = gl.arange(0, MMA_SLICES, layout=gl.SliceLayout(0, mma))
    acc = gl.where((i % MMA_SLICES)[:, None] == c[None, :], acc0 + acc1, 0.0)  # the diagonal: chunk s x chunk s
    return gl.sum(gl.sum(gl.reshape(acc, [BOX_ROWS, MMA_SLICES, MMA_SLICES]), axis=2), axis=1)


@gluon.jit
def _consumer_mma(tile, tile_hi, LO: gl.constexpr, bars, xs, inp, norm, bias, out, eps, row0, live,
                  N: gl.constexpr, K: gl.constexpr, R: gl.constexpr, STAGE: gl.constexpr, HAS_BIAS: gl.constexpr,
                  LATE_LAUNCH: gl.constexpr, NG: gl.constexpr, IN_FLIGHT: gl.constexpr, WARPS: gl.constexpr):
    """After the PDL wait: the stage input (RMSNorm'd for QKV and gate/up) to shared memory as bf16 (every stage
    input is bf16-exact: HF rounds it there) as [K / 64, 64], then the rest of the tile, multiplied on the tensor
    cores (`_mma_rows`) row group by row group, and the results (+ bias, silu(gate) * up, or + the residual)."""
    NCH: gl.constexpr = K // MMA_CHUNK
    KC: gl.constexpr = NCH // MMA_IN
    H: gl.constexpr = NCH // MMA_SLICES
    NRG: gl.constexpr = R // BOX_ROWS
    GATED: gl.constexpr = STAGE == 3
    NORMED: gl.constexpr = STAGE == 0 or STAGE == 3
    RESIDUAL: gl.constexpr = STAGE == 2 or STAGE == 4
    S: gl.constexpr = 2 if GATED else 1
    BLOCK: gl.constexpr = MMA_IN * MMA_CHUNK
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    xr = gl.arange(0, MMA_IN, layout=gl.SliceLayout(1, xl))
    xc = gl.arange(0, MMA_CHUNK, layout=gl.SliceLayout(0, xl))
    xoff = xr[:, None] * MMA_CHUNK + xc[None, :]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    rs = gl.arange(0, BOX_ROWS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    if NORMED and KC == 1:  # token-independent: before the wait
        s0 = gl.load(norm + xoff).to(gl.float32)
    inline_ptx("griddepcontrol.wait; // $0")
    if LATE_LAUNCH:
        inline_ptx("griddepcontrol.launch_dependents; // $0")
    if RESIDUAL:
        res0 = gl.load(out + row0 + rs, mask=row0 + rs < N, other=0.0,
                       cache_modifier=".cg").to(gl.float32)
    if KC == 1:
        v = gl.load(inp + xoff, cache_modifier=".cg").to(gl.float32)
        if NORMED:
            rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(v * v, axis=1), axis=0) / K + eps)
            v = _bf(s0 * _bf(v * rstd))
        xs.slice(0, MMA_IN).store(v.to(gl.bfloat16))
    else:
        if NORMED:
            ss = 0.0
            for kc in gl.static_range(KC):
                v = gl.load(inp + kc * BLOCK + xoff, cache_modifier=".cg").to(gl.float32)
                ss += gl.sum(gl.sum(v * v, axis=1), axis=0)
            rstd = 1.0 / gl.sqrt(ss / K + eps)
        for kc in gl.static_range(KC):
            v = gl.load(inp + kc * BLOCK + xoff, cache_modifier=".cg").to(gl.float32)
            if NORMED:
                v = _bf(gl.load(norm + kc * BLOCK + xoff).to(gl.float32) * _bf(v * rstd))
            xs.slice(kc * MMA_IN, MMA_IN).store(v.to(gl.bfloat16))
    gl.thread_barrier()
    for g in gl.static_range(max(0, NG - IN_FLIGHT), NG):  # the groups the producer did not wait for
        mbarrier.wait(bars.index(g), 0, pred=live)
    b0 = xs.slice(0, MMA_SLICES).permute([1, 0]).load(gl.DotOperandLayout(1, mma, 2))
    b1 = xs.slice(MMA_SLICES, MMA_SLICES).permute([1, 0]).load(gl.DotOperandLayout(1, mma, 2))
    for r in gl.static_range(NRG):
        o = _mma_rows(tile, tile_hi, LO, xs, b0, b1, r * S, H, WARPS)
        if RESIDUAL:  # the residual came with the input (one row group here): bring the sum to its layout
            rows = row0 + r * BOX_ROWS + rs
            rmask = rows < N
            if r == 0:
                res = res0
            else:
                res = gl.load(out + rows, mask=rmask, other=0.0, cache_modifier=".cg").to(gl.float32)
            o = gl.convert_layout(o, res.type.layout)
            gl.store(out + rows, _bf(res + _bf(o)).to(gl.bfloat16), mask=rmask)
        else:
            rows = row0 + r * BOX_ROWS + gl.arange(0, BOX_ROWS, layout=o.type.layout)
            rmask = rows < N
            up = _mma_rows(tile, tile_hi, LO, xs, b0, b1, r * S + 1, H, WARPS) if GATED else o
            _store_rows(out, bias, rows, rmask, o, up, GATED, HAS_BIAS)


@gluon.jit
def gemv_stage(desc, inp, norm, bias, out, eps,
               N: gl.constexpr, K: gl.constexpr, R: gl.constexpr, KCP: gl.constexpr, STAGE: gl.constexpr,
               HAS_BIAS: gl.constexpr, LATE_LAUNCH: gl.constexpr, GROUP: gl.constexpr, IN_FLIGHT: gl.constexpr,
               WARPS: gl.constexpr, LO: gl.constexpr):
    """`desc`: TMA descriptor of this layer's `[rows, K]` weight (gate/up stacked `[2 N, K]`) viewed as
    `[K / 512, rows, 8, 64]`, boxes [1, 4, 8, 64] (`DecodeMegakernel._gluon_descs`). `inp`: the stage input `[K]`
    (bf16); `norm`: its RMSNorm weight (QKV, gate/up); `bias`: QKV bias (HAS_BIAS); `out`: qkv (QKV), act
    (gate/up), or the residual x, read and written (o_proj, down). KCP: K // `layout.BOX_K` (256) rounded up to a
    power of two (the input buffer: KCP // 4 loads of [16, 64]). LATE_LAUNCH: let the next kernel launch only
    after this one's wait (its programs then arrive one stage ahead, not as many as fit). GROUP, IN_FLIGHT: TMA
    boxes per mbarrier and such groups in flight per program (`_producer`). LO: the tile lives in two buffers of
    which the first holds LO rows of [8 chunks, 64] (`host.mma_tile_split`)."""
    NC: gl.constexpr = K // MMA_CHUNK
    S: gl.constexpr = 2 if STAGE == 3 else 1
    NBOX: gl.constexpr = R * S * NC // MMA_SLICES // MMA_BOX_ROWS
    blocks: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    tile = gl.allocate_shared_memory(gl.bfloat16, [LO, MMA_SLICES, MMA_CHUNK], blocks)
    if LO == NBOX * MMA_BOX_ROWS:
        tile_hi = tile
    else:
        tile_hi = gl.allocate_shared_memory(gl.bfloat16, [NBOX * MMA_BOX_ROWS - LO, MMA_SLICES, MMA_CHUNK],
                                            blocks)
    xs = gl.allocate_shared_memory(gl.bfloat16, [KCP // 4 * MMA_IN, MMA_CHUNK],
                                   gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16))
    NG: gl.constexpr = (NBOX + GROUP - 1) // GROUP
    bars = gl.allocate_shared_memory(gl.int64, [NG, 1], mbarrier.MBarrierLayout())
    for g in gl.static_range(NG):
        mbarrier.init(bars.index(g), count=1)
    fence_async_shared()
    row0 = gl.program_id(0) * R
    live = row0 < N
    if not LATE_LAUNCH:
        inline_ptx("griddepcontrol.launch_dependents; // $0")
    _producer(desc, tile, tile_hi, LO, bars, row0, live, N, NC, S, NBOX, GROUP, IN_FLIGHT)
    _consumer_mma(tile, tile_hi, LO, bars, xs, inp, norm, bias, out, eps, row0, live, N, K, R,
                  STAGE, HAS_BIAS, LATE_LAUNCH, NG, IN_FLIGHT, WARPS)
    # (no mbarrier.inval: the barriers' shared memory is not reused before the program exits, and each
    # invalidation is a CTA barrier on the way to the grid's completion, which the next stage waits for)
