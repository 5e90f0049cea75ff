"""Can a persistent decode kernel stream weights at HBM speed THROUGH its grid barriers? (Gluon, Hopper+.)

The Triton megakernel (`rlbench/rollout/mk_kernels.py`) streams a stage's weights only while registers hold them:
one tile per program is in flight across a barrier, and HBM idles through attention and the barrier waits (26 us
per 0.6B layer against 7.3 us of weight reads, docs/LOG.md 2026-11-30). The design this measures: a 1-warp
producer partition per program TMA-loads the program's weight boxes ([8, 256] bf16, 4 KB) for every stage of every
layer into a ring of shared-memory slots, as far ahead as the ring allows, and never waits for a grid barrier; the
consumer partition waits for each box, multiplies it with the stage's input (the previous stage's output), stores
its rows and meets the other programs at a grid barrier.

Stages: one layer's GEMVs of a preset (0.6B: QKV 4096x1024, o 1024x2048, gate/up 6144x1024, down 1024x3072) for
every layer; no attention, norms or activations, so the number is an upper bound on what the weight stream
allows. Variants side by side in one run: mode, with and without the grid barriers, ring depths.

v1 (measured on the H200): 0.6B (0.881 GB, floor 205 us) 784 us per call without barriers (1.12 TB/s), ~1000 us
with them; 4B 6,905 us without, 8,550 us with; ring depths 8, 24 and 48 alike. The ring depth making no
difference says the producer was not the limit: the consumer was, latency-bound at ~0.48 us per box (a layer is
~58 boxes per program). Per box it loaded its x chunk from global memory (an L2 round trip on the critical path of
every box), waited for the box, read it from shared memory and reduced across lanes (gl.sum) per box.

v2 takes the L2 round trip and the per-box reduction off the box loop, and measures the producer alone:
- mode gemv: a stage's input x (fp32, K <= KMAX values) is read from global memory once per stage and program
  into a shared buffer (KMAX // 256 rows of 256, in 16-row chunks), between two consumer thread barriers; each
  box reads its x chunk from shared memory, which does not wait for the box. The consumer accumulates a
  [8, 256] fp32 product over a row group's boxes and reduces across lanes once per row group.
- mode stream: the consumer only waits for each box and hands its slot back (no shared-memory read, no math; it
  stores zeros for its rows): the producer/TMA ceiling. If stream is also far from the floor, the 4 KB TMA boxes
  from one producer warp are the limit, not the consumer.

v2 (measured on the H200), 0.6B, 28 layers, 0.881 GB, floor 205 us; ring depths 8, 24 and 48 alike again:
    stream  barriers 0: 209-217 us (4.1-4.2 TB/s)   barriers 1: 337-350 us (2.5-2.6 TB/s, 12.0 us per layer)
    gemv    barriers 0: 280-286 us (3.1 TB/s)       barriers 1: 396-402 us (2.2 TB/s, 14.2 us per layer)
  4B: stream 1732 / 1901 us, gemv 1967 / 2118 us (without / with barriers). The producer alone streams at the
  floor without barriers; two open questions: why the consumer is slower (3.1 vs 4.1 TB/s), and why the barriers
  do not overlap with the stream (stream: 7.5 us per layer without, 12.0 with, although the producer never waits
  for a grid barrier and the ring holds about a stage).

v3 answers them in one run:
- Q1, the consumer. mbarrier.arrive is executed by one thread of the partition, so the compiler puts a 128-thread
  bar.sync before it (every warp done reading the slot) and, because an arrive counts as touching all of shared
  memory, another before the next box's shared-memory accesses: 2 bar.sync per box in stream and gemv alike, the
  first one waiting for the box's ld.shared to complete. Modes *_thread (gemv_thread, stream_thread) release each
  slot from every consumer thread (cp.async.mbarrier.arrive.noinc with no cp.async pending: an immediate arrive
  per thread, `empty` initialised to 32 * num_warps arrivals), right after that thread's own reads: 1 bar.sync per
  box is left (before the wait for the next box), none between the reads and the release.
- Q2, the overlap. --timed adds, after each variant's timing, one launch of the TIMED build, which reads %clock64
  around the waits and the grid barriers and %globaltimer around the consumer, and prints per layer (mean/max over
  programs, cycles converted at each program's own cycles/ns): prod_wait_empty (the producer waits for a free slot:
  the ring is full, consumer-bound), cons_wait_ready (the consumer waits for a box: HBM/TMA-bound),
  cons_grid_barrier (what the consumer spends in grid barriers), cons_x_load (gemv*: the x chunk loads with their
  thread barriers), totals. The un-timed builds read no clock.

    python benchmarks/gluon_stream.py --slots 24 48 --modes stream gemv gemv_thread --timed

v3 (measured on the H200, docs/LOG.md 2026-11-30 session 6): the stream with barriers is barrier-bound. The
producer waits for a free slot 9.4 of 11.2 us per layer (ring full, 24 or 48 slots alike) while the consumers,
their data ready, sit in the 4 grid barriers ~1.9 us each. Per-thread release: -2% (0.6B), 2.3x slower (4B).
Modes barrier_only / barrier_load / barrier_load_half (the consumer only meets the grid barriers; nobody, every
program or every odd program streams meanwhile): 0.90 us per grid barrier idle, 2.43 under the full stream,
1.47 under half of it -- the same for the SMs that do not stream: the barrier's L2 round trips slow with the
GPU-wide memory load.

Modes chase_only / chase_load (session 7): the consumer does CHASE dependent L2 loads where the barriers were
(nobody / every program streams meanwhile); the stall table prints the mean L2 round trip. A grid barrier has at
least three round trips on its critical path (the arrive's release, the poll that sees the count, the load of the
data after it) and any cross-SM dependency at least two (the signal, the data), whatever its protocol. Measured
(docs/LOG.md session 7): 150 ns idle, 507 ns under the stream; a grid barrier costs about 6 and 5 of them.

    python benchmarks/gluon_stream.py --slots 24 --modes chase_only chase_load barrier_only barrier_load --timed

Shared memory (227 KB per block): ring slots * 4 KB plus, in modes gemv*, the x buffer (0.6B 16 KB, 4B 48 KB), so
the 4B preset fits 24 slots, not 48.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rlbench.engine.megakernel.gluon_gemv import (
    box_layout,  # unswizzled [8, 256] bf16 boxes, as the megakernel's
)

BR = gl.constexpr(8)  # rows per TMA box
BK = gl.constexpr(256)  # columns per TMA box: a box is 4 KB of bf16
XR = gl.constexpr(16)  # rows of BK stage-input values per global load into the shared x buffer (16 KB of fp32)
MODES = ("stream", "stream_thread", "gemv", "gemv_thread", "barrier_only", "barrier_load", "barrier_load_half",
         "chase_only", "chase_load")
CHASE = gl.constexpr(4)  # modes chase_*: dependent L2 loads in place of each grid barrier
CHASE_LEN = gl.constexpr(4096)  # entries of the chase table (x_qkv's first 4096 values; x buffers hold >= 4096)
CHASE_STRIDE = 1031  # entries (4 KB) between consecutive loads of the chase: a different L2 line every time
# columns of the TIMED output, one row per program (SM cycles unless named ns)
STATS = ("prod_wait_empty", "prod_total", "cons_wait_ready", "cons_grid_barrier", "cons_x_load", "cons_total",
         "cons_total_ns", "boxes")


def x_bytes(kmax: int) -> int:
    """Bytes of the shared x buffer (mode gemv): KMAX // BK rows of BK fp32 values, rounded up to whole XR-row
    chunks."""
    return triton.cdiv(kmax // BK.value, XR.value) * XR.value * BK.value * 4


@gluon.jit
def _clock(TIMED: gl.constexpr):
    """The SM's cycle counter with TIMED, else 0 (the un-timed variants read no clock)."""
    if TIMED:
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    else:
        return 0


@gluon.jit
def _globaltimer(TIMED: gl.constexpr):
    if TIMED:
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)
    else:
        return 0


@gluon.jit
def _produce_stage(desc, ring, ready, empty, i, tw, base, row0, N: gl.constexpr, ROWS: gl.constexpr,
                   K: gl.constexpr, SLOTS: gl.constexpr, TIMED: gl.constexpr, SELF: gl.constexpr):
    """Issue this program's boxes of one stage (ROWS rows from row0 < N, all K columns) into the ring; `base` is
    the layer's first row in the stacked weights. With TIMED, `tw` adds the cycles spent waiting for a free slot.
    SELF (mode barrier_load): nobody consumes; a slot is free once its previous box has landed."""
    for r in gl.static_range(ROWS // BR):
        for c in range(gl.where(row0 + r * BR < N, K // BK, 0)):
            slot = i % SLOTS
            t0 = _clock(TIMED)
            if SELF:
                if i >= SLOTS:
                    mbarrier.wait(ready.index(slot), ((i // SLOTS) - 1) & 1)
            else:
                mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1
            tw += _clock(TIMED) - t0
            mbarrier.expect(ready.index(slot), BR * BK * 2)
            tma.async_copy_global_to_shared(desc, [base + row0 + r * BR, c * BK], ready.index(slot),
                                            ring.index(slot))
            i += 1
    return i, tw


@gluon.jit
def _producer(d_qkv, d_o, d_gu, d_dn, ring, ready, empty, stats, n_layers, pid,
              N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr,
              R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, R_DN: gl.constexpr,
              K_QKV: gl.constexpr, K_O: gl.constexpr, K_GU: gl.constexpr, K_DN: gl.constexpr, SLOTS: gl.constexpr,
              TIMED: gl.constexpr, MODE: gl.constexpr):
    SELF: gl.constexpr = MODE == "barrier_load" or MODE == "barrier_load_half" or MODE == "chase_load"
    i = 0
    tw = _clock(TIMED) * 0  # an int64 with TIMED
    t_start = _clock(TIMED)
    n_stream = n_layers
    if MODE == "barrier_only" or MODE == "chase_only":
        n_stream = 0
    if MODE == "barrier_load_half":  # odd programs stream, even ones only meet the barriers
        n_stream = gl.where(pid % 2 == 1, n_layers, 0)
    for layer in range(n_stream):
        i, tw = _produce_stage(d_qkv, ring, ready, empty, i, tw, layer * N_QKV, pid * R_QKV, N_QKV, R_QKV, K_QKV,
                               SLOTS, TIMED, SELF)
        i, tw = _produce_stage(d_o, ring, ready, empty, i, tw, layer * N_O, pid * R_O, N_O, R_O, K_O, SLOTS, TIMED,
                               SELF)
        i, tw = _produce_stage(d_gu, ring, ready, empty, i, tw, layer * N_GU, pid * R_GU, N_GU, R_GU, K_GU, SLOTS,
                               TIMED, SELF)
        i, tw = _produce_stage(d_dn, ring, ready, empty, i, tw, layer * N_DN, pid * R_DN, N_DN, R_DN, K_DN, SLOTS,
                               TIMED, SELF)
    if SELF:  # every box must land before the kernel's shared memory goes away
        for j in range(gl.maximum(i - SLOTS, 0), i):
            mbarrier.wait(ready.index(j % SLOTS), (j // SLOTS) & 1)
    if TIMED:  # the producer's total ends when its last box is issued, not when it lands
        gl.store(stats + pid * 8 + 0, tw)
        gl.store(stats + pid * 8 + 1, _clock(TIMED) - t_start)


@gluon.jit
def _grid_barrier(sync, arrived, nprog):
    """As the megakernel's: one thread's release add, then acquire polls whose value the loop reads (an unused
    acquire add of 0 after relaxed polls is dropped by the compiler: no acquire at all; docs/LOG.md session 6)."""
    gl.thread_barrier()
    gl.atomic_add(sync, 1, sem="release", scope="gpu")
    target = arrived + nprog
    seen = gl.atomic_add(sync, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(sync, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()
    return target


@gluon.jit
def _load_x(x, xbuf, K: gl.constexpr, layout: gl.constexpr):
    """xbuf[c] = x[c * BK:(c + 1) * BK] for c < K // BK: the stage input (the previous stage's output, in L2) read
    from global memory once per stage, XR rows at a time (one 2D load each; a chunk's loads are in flight together)."""
    rs = gl.arange(0, XR, layout=gl.SliceLayout(1, layout))
    ks = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    gl.thread_barrier()  # every consumer warp is done reading the previous stage's x
    for j in gl.static_range((K // BK + XR - 1) // XR):
        rows = j * XR + rs
        mask = (rows[:, None] < K // BK) & (ks[None, :] < BK)
        xv = gl.load(x + rows[:, None] * BK + ks[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        xbuf.index(j).store(xv)
    gl.thread_barrier()  # this stage's x is in shared memory for every consumer warp


@gluon.jit
def _release(empty, THREAD_ARRIVE: gl.constexpr):
    """Hand a ring slot back to the producer. mbarrier.arrive is executed by one thread of the partition, so the
    compiler puts a partition-wide bar.sync before it (every warp must be done reading the slot) and another one
    after it. THREAD_ARRIVE: every consumer thread arrives on its own after its own reads (cp.async.mbarrier.arrive
    .noinc, which no cp.async is pending on; `empty` counts one arrival per consumer thread), with no bar.sync
    between the reads and the release."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(empty, increment_count=False)
    else:
        mbarrier.arrive(empty)


@gluon.jit
def _consume_stage(x, out, ring, ready, empty, xbuf, i, tr, tx, row0, n_rows, ROWS: gl.constexpr, K: gl.constexpr,
                   SLOTS: gl.constexpr, MODE: gl.constexpr, TIMED: gl.constexpr, layout: gl.constexpr):
    """out[rows] = W[rows] @ x[:K] for this program's ROWS rows, box by box from the ring (MODE "gemv*"); MODE
    "stream*" only takes each box and hands its slot back (no shared-memory read, no math) and stores zeros. With
    TIMED, `tr` adds the cycles spent waiting for boxes and `tx` those spent loading x."""
    GEMV: gl.constexpr = MODE == "gemv" or MODE == "gemv_thread"
    THREAD_ARRIVE: gl.constexpr = MODE == "stream_thread" or MODE == "gemv_thread"
    rs = gl.arange(0, BR, layout=gl.SliceLayout(1, layout))
    if GEMV:
        t0 = _clock(TIMED)
        _load_x(x, xbuf, K, layout)
        tx += _clock(TIMED) - t0
    # the same bytes as rows of BK (unswizzled, row-major either way): .index(c) is x[c * BK:(c + 1) * BK]
    xrow = xbuf._reinterpret(gl.float32, [xbuf.shape[0] * XR, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for r in gl.static_range(ROWS // BR):
        acc = gl.zeros([BR, BK], gl.float32, layout=layout)
        for c in range(gl.where(row0 + r * BR < n_rows, K // BK, 0)):  # the producer skips the same boxes
            slot = i % SLOTS
            if GEMV:
                xv = xrow.index(c).load(gl.SliceLayout(0, layout))  # does not wait for the box
            t0 = _clock(TIMED)
            mbarrier.wait(ready.index(slot), (i // SLOTS) & 1)
            tr += _clock(TIMED) - t0
            if GEMV:
                w = ring.index(slot).load(layout)
                _release(empty.index(slot), THREAD_ARRIVE)
                acc += w.to(gl.float32) * xv[None, :]  # lanes reduce once per row group, below
            else:
                _release(empty.index(slot), THREAD_ARRIVE)
            i += 1
        rows = row0 + r * BR + rs
        gl.store(out + rows, gl.sum(acc, axis=1), mask=rows < n_rows)
    return i, tr, tx


@gluon.jit
def _timed_barrier(sync, arrived, nprog, tb, TIMED: gl.constexpr):
    t0 = _clock(TIMED)
    arrived = _grid_barrier(sync, arrived, nprog)
    return arrived, tb + (_clock(TIMED) - t0)


@gluon.jit
def _timed_chase(table, idx, tb, TIMED: gl.constexpr):
    """Modes chase_*: CHASE loads, each from the address the previous one returned (`table` holds the chase as
    fp32 integers, `.cg`: L2), in place of a grid barrier: the L2 round trip alone, idle or under the stream."""
    t0 = _clock(TIMED)
    for _ in gl.static_range(CHASE):
        idx = gl.load(table + idx, cache_modifier=".cg").to(gl.int32)
    return idx, tb + (_clock(TIMED) - t0)


@gluon.jit
def _between_stages(sync, arrived, nprog, table, idx, tb, BARRIERS: gl.constexpr, CHASED: gl.constexpr,
                    TIMED: gl.constexpr):
    """What the consumer does between two stages: the chase (modes chase_*), a grid barrier, or nothing."""
    if CHASED:
        idx, tb = _timed_chase(table, idx, tb, TIMED)
    elif BARRIERS:
        arrived, tb = _timed_barrier(sync, arrived, nprog, tb, TIMED)
    return arrived, idx, tb


@gluon.jit
def _consumer(x_qkv, x_o, x_gu, x_dn, ring, ready, empty, xbuf, sync, stats, n_layers, pid, nprog,
              N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr,
              R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, R_DN: gl.constexpr,
              K_QKV: gl.constexpr, K_O: gl.constexpr, K_GU: gl.constexpr, K_DN: gl.constexpr,
              SLOTS: gl.constexpr, BARRIERS: gl.constexpr, MODE: gl.constexpr, NUM_WARPS: gl.constexpr,
              TIMED: gl.constexpr):
    # stage s reads the output of stage s - 1 (x_dn -> QKV -> x_qkv -> o -> x_o -> gate/up -> x_gu -> down -> x_dn)
    gl.static_assert(gl.num_warps() == NUM_WARPS, "NUM_WARPS must be the launch's num_warps")
    CONSUME: gl.constexpr = not MODE.startswith("barrier_") and not MODE.startswith("chase_")  # only barriers
    CHASED: gl.constexpr = MODE.startswith("chase_")  # dependent L2 loads instead of the barriers
    idx = (pid * 37) % CHASE_LEN
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    i = 0
    arrived = 0
    tr = _clock(TIMED) * 0  # int64 cycle sums with TIMED: waiting for boxes, in grid barriers, loading x
    tb = tr
    tx = tr
    t_start = _clock(TIMED)
    ns_start = _globaltimer(TIMED)
    for _layer in range(n_layers):
        if CONSUME:
            i, tr, tx = _consume_stage(x_dn, x_qkv, ring, ready, empty, xbuf, i, tr, tx, pid * R_QKV, N_QKV, R_QKV,
                                       K_QKV, SLOTS, MODE, TIMED, layout)
        arrived, idx, tb = _between_stages(sync, arrived, nprog, x_qkv, idx, tb, BARRIERS, CHASED, TIMED)
        if CONSUME:
            i, tr, tx = _consume_stage(x_qkv, x_o, ring, ready, empty, xbuf, i, tr, tx, pid * R_O, N_O, R_O, K_O, SLOTS,
                                       MODE, TIMED, layout)
        arrived, idx, tb = _between_stages(sync, arrived, nprog, x_qkv, idx, tb, BARRIERS, CHASED, TIMED)
        if CONSUME:
            i, tr, tx = _consume_stage(x_o, x_gu, ring, ready, empty, xbuf, i, tr, tx, pid * R_GU, N_GU, R_GU, K_GU,
                                       SLOTS, MODE, TIMED, layout)
        arrived, idx, tb = _between_stages(sync, arrived, nprog, x_qkv, idx, tb, BARRIERS, CHASED, TIMED)
        if CONSUME:
            i, tr, tx = _consume_stage(x_gu, x_dn, ring, ready, empty, xbuf, i, tr, tx, pid * R_DN, N_DN, R_DN, K_DN,
                                       SLOTS, MODE, TIMED, layout)
        arrived, idx, tb = _between_stages(sync, arrived, nprog, x_qkv, idx, tb, BARRIERS, CHASED, TIMED)
    if CHASED:  # where the chase ended (unused, but without a use the compiler drops the loads)
        gl.store(sync, idx)
    if TIMED:  # every consumer thread stores the same columns; their values differ by a few cycles at most
        t_total = _clock(TIMED) - t_start
        ns_total = _globaltimer(TIMED) - ns_start
        gl.store(stats + pid * 8 + 2, tr)
        gl.store(stats + pid * 8 + 3, tb)
        gl.store(stats + pid * 8 + 4, tx)
        gl.store(stats + pid * 8 + 5, t_total)
        gl.store(stats + pid * 8 + 6, ns_total)
        gl.store(stats + pid * 8 + 7, i.to(gl.int64))


@gluon.jit
def stream_layers(d_qkv, d_o, d_gu, d_dn, x_qkv, x_o, x_gu, x_dn, sync, stats, n_layers,
                  N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr,
                  R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, R_DN: gl.constexpr,
                  K_QKV: gl.constexpr, K_O: gl.constexpr, K_GU: gl.constexpr, K_DN: gl.constexpr, KMAX: gl.constexpr,
                  SLOTS: gl.constexpr, BARRIERS: gl.constexpr, MODE: gl.constexpr, NUM_WARPS: gl.constexpr,
                  TIMED: gl.constexpr):
    """`stats` ([programs, 8] int64, columns STATS) is written only with TIMED."""
    gl.static_assert(K_QKV <= KMAX and K_O <= KMAX and K_GU <= KMAX and K_DN <= KMAX, "KMAX is the largest K")
    gl.static_assert(MODE == "stream" or MODE == "stream_thread" or MODE == "gemv" or MODE == "gemv_thread"
                     or MODE == "barrier_only" or MODE == "barrier_load" or MODE == "barrier_load_half"
                     or MODE == "chase_only" or MODE == "chase_load", "MODE: one of MODES")
    THREAD_ARRIVE: gl.constexpr = MODE == "stream_thread" or MODE == "gemv_thread"
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BR, BK], d_qkv.layout)
    # the stage input in XR-row chunks of BK values (a chunk's shape must be a power of 2, their number need not)
    xbuf = gl.allocate_shared_memory(gl.float32, [(KMAX // BK + XR - 1) // XR, XR, BK],
                                     gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(ready.index(s), count=1)
        if THREAD_ARRIVE:
            mbarrier.init(empty.index(s), count=NUM_WARPS * 32)  # one arrival per consumer thread
        else:
            mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (x_qkv, x_o, x_gu, x_dn, ring, ready, empty, xbuf, sync, stats, n_layers, pid, nprog, N_QKV, N_O,
                     N_GU, N_DN, R_QKV, R_O, R_GU, R_DN, K_QKV, K_O, K_GU, K_DN, SLOTS, BARRIERS, MODE, NUM_WARPS,
                     TIMED)),
        (_producer, (d_qkv, d_o, d_gu, d_dn, ring, ready, empty, stats, n_layers, pid, N_QKV, N_O, N_GU, N_DN,
                     R_QKV, R_O, R_GU, R_DN, K_QKV, K_O, K_GU, K_DN, SLOTS, TIMED, MODE)),
    ], [1], [40])


def shapes(preset: str) -> tuple[dict[str, tuple[int, int]], int]:
    """(rows, K) of one layer's four GEMVs (QKV, o, gate/up stacked, down) from the preset's config, and the
    number of layers."""
    from rlbench.models import build_model

    c = build_model(preset, meta=True).config
    hd = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return dict(qkv=(q + 2 * kv, c.hidden_size), o=(c.hidden_size, q), gu=(2 * c.intermediate_size, c.hidden_size),
                dn=(c.hidden_size, c.intermediate_size)), c.num_hidden_layers


def stall_table(stats: torch.Tensor, layers: int, halves: bool = False, chase: bool = False) -> str:
    """Mean and max over programs of the TIMED columns in us per layer; cycles become ns at each program's own
    rate (its consumer's cycles over its globaltimer ns). `halves` (mode barrier_load_half): also the mean time in
    the grid barriers of the streaming (odd) and the idle (even) programs. `chase` (modes chase_*): also the
    mean L2 round trip, from the time cons_grid_barrier holds there (4 x CHASE dependent loads per layer)."""
    st = stats.double()
    ghz = st[:, STATS.index("cons_total")] / st[:, STATS.index("cons_total_ns")].clamp(min=1)

    def us(name):  # per program, us per layer
        return st[:, STATS.index(name)] / 1e3 / layers / (1.0 if name.endswith("_ns") else ghz.clamp(min=1e-3))

    parts = []
    if halves:
        b = us("cons_grid_barrier")
        parts.append(f"cons_grid_barrier streaming/idle programs {b[1::2].mean().item():.2f}/"
                     f"{b[0::2].mean().item():.2f}")
    if chase:
        parts.append(f"l2_round_trip_ns {us('cons_grid_barrier').mean().item() * 1e3 / (4 * CHASE.value):.0f}")
    for name in STATS[:-1]:
        parts.append(f"{name} {us(name).mean().item():.2f}/{us(name).max().item():.2f}")
    parts.append(f"boxes/layer {st[:, STATS.index('boxes')].mean().item() / layers:.1f}")
    return f"clock {ghz.mean().item():.2f} GHz; us per layer (mean/max over programs): " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 24, 48], help="ring slots of 4 KB")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["stream", "gemv"],
                    help="stream: the consumer only takes each box and hands its slot back (the producer/TMA "
                         "ceiling); gemv: the GEMVs; *_thread: every consumer thread releases the slot itself "
                         "(no bar.sync between the box reads and the release)")
    ap.add_argument("--warps", type=int, default=4, help="consumer warps (num_warps), a multiple of 4")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    ap.add_argument("--programs", type=int, default=0,
                    help="the grid (default 0: one program per SM); fewer programs get more rows each: how much of "
                         "HBM's bandwidth that many SMs can pull (e.g. one thread-block cluster's 16)")
    ap.add_argument("--timed", action="store_true",
                    help="after each variant's timing, one TIMED launch (clock64 around the waits and barriers): "
                         "print its stall table")
    args = ap.parse_args()
    if args.warps < 4 or args.warps % 4:
        ap.error("--warps must be a positive multiple of 4 (warp specialization)")
    dims, layers = shapes(args.preset)
    kmax = max(k for _, k in dims.values())
    sms = args.programs or torch.cuda.get_device_properties(0).multi_processor_count
    br, bk = BR.value, BK.value
    rows = {k: triton.cdiv(triton.cdiv(n, sms), br) * br for k, (n, _) in dims.items()}  # per program, whole boxes
    assert all(k % bk == 0 for _, k in dims.values()), "K must be a multiple of BK"
    ws = {k: torch.randn(layers * n, kk, device="cuda", dtype=torch.bfloat16) * 0.03 for k, (n, kk) in dims.items()}
    descs = {k: TensorDescriptor(w, list(w.shape), list(w.stride()), [br, bk], box_layout()) for k, w in ws.items()}
    xs = {k: torch.randn(max(n, CHASE_LEN.value), device="cuda", dtype=torch.float32) for k, (n, _) in dims.items()}
    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
    stats = torch.zeros(sms, len(STATS), dtype=torch.int64, device="cuda")
    weight_bytes = sum(w.numel() * 2 for w in ws.values())
    floor_us = weight_bytes / args.bandwidth_tbs / 1e6
    print(f"{args.preset}: {layers} layers, {weight_bytes / 1e9:.3f} GB of GEMV weights, {sms} programs, "
          f"rows per program {rows}; floor {floor_us:.1f} us at {args.bandwidth_tbs} TB/s; shared x buffer "
          f"{x_bytes(kmax) // 1024} KB (modes gemv*)", flush=True)
    if args.timed:
        print(f"TIMED columns (per program, us per layer): {', '.join(STATS[:-1])}; prod_wait_empty: the producer "
              "waits for a free slot (ring full: consumer-bound); cons_wait_ready: the consumer waits for a box "
              "(HBM/TMA-bound); cons_grid_barrier: the consumer in grid barriers", flush=True)
    for mode, slots, barriers in itertools.product(args.modes, args.slots, (False, True)):
        if mode.startswith("chase_") and not barriers:
            continue  # the chase stands in for the barriers: one row
        if mode.startswith("chase_"):  # x_qkv holds the chase: entry i -> i + CHASE_STRIDE (mod CHASE_LEN)
            n = CHASE_LEN.value
            xs["qkv"][:n] = ((torch.arange(n, device="cuda") + CHASE_STRIDE) % n).float()
        def call(slots=slots, barriers=barriers, mode=mode, timed=False):
            sync.zero_()
            stream_layers[(sms,)](descs["qkv"], descs["o"], descs["gu"], descs["dn"], xs["qkv"], xs["o"],
                                  xs["gu"], xs["dn"], sync, stats, layers,
                                  *(dims[k][0] for k in ("qkv", "o", "gu", "dn")),
                                  *(rows[k] for k in ("qkv", "o", "gu", "dn")),
                                  *(dims[k][1] for k in ("qkv", "o", "gu", "dn")), kmax,
                                  slots, barriers, mode, args.warps, timed, num_warps=args.warps)
        name = f"{mode:13} slots {slots:3} ({slots * 4:3} KB) barriers {int(barriers)}"
        try:
            call()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                call()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) / args.iters * 1e3
            print(f"{name}: {us:8.1f} us per call, {weight_bytes / us / 1e6:6.2f} TB/s, {us / layers:6.2f} us per "
                  f"layer, {us / floor_us:4.2f}x floor", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or launch is a row
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        if not args.timed:
            continue
        try:
            call(timed=True)  # compiles the TIMED build and warms it up
            torch.cuda.synchronize()
            stats.zero_()
            start.record()
            call(timed=True)
            end.record()
            end.synchronize()
            table = stall_table(stats, layers, halves=mode == "barrier_load_half", chase=mode.startswith("chase_"))
            print(f"{name} TIMED: {start.elapsed_time(end) * 1e3:8.1f} us per call; {table}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name} TIMED: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
