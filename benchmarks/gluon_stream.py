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

    python benchmarks/gluon_stream.py --preset qwen3-0.6b-shape --slots 8 24 48 --modes stream gemv

Shared memory (227 KB per block): ring slots * 4 KB plus, in mode gemv, the x buffer (0.6B 16 KB, 4B 48 KB), so
the 4B preset fits 24 slots, not 48.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BR = gl.constexpr(8)  # rows per TMA box
BK = gl.constexpr(256)  # columns per TMA box: a box is 4 KB of bf16
XR = gl.constexpr(16)  # rows of BK stage-input values per global load into the shared x buffer (16 KB of fp32)
MODES = ("stream", "gemv")


def box_layout():
    """Unswizzled boxes: a 512-byte row per box row, read by a warp as 32 x 16 bytes (no bank conflicts)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def x_bytes(kmax: int) -> int:
    """Bytes of the shared x buffer (mode gemv): KMAX // BK rows of BK fp32 values, rounded up to whole XR-row
    chunks."""
    return triton.cdiv(kmax // BK.value, XR.value) * XR.value * BK.value * 4


@gluon.jit
def _produce_stage(desc, ring, ready, empty, i, base, row0, N: gl.constexpr, ROWS: gl.constexpr, K: gl.constexpr,
                   SLOTS: gl.constexpr):
    """Issue this program's boxes of one stage (ROWS rows from row0 < N, all K columns) into the ring; `base` is
    the layer's first row in the stacked weights."""
    for r in gl.static_range(ROWS // BR):
        for c in range(gl.where(row0 + r * BR < N, K // BK, 0)):
            slot = i % SLOTS
            mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(ready.index(slot), BR * BK * 2)
            tma.async_copy_global_to_shared(desc, [base + row0 + r * BR, c * BK], ready.index(slot),
                                            ring.index(slot))
            i += 1
    return i


@gluon.jit
def _producer(d_qkv, d_o, d_gu, d_dn, ring, ready, empty, n_layers, pid,
              N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr,
              R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, R_DN: gl.constexpr,
              K_QKV: gl.constexpr, K_O: gl.constexpr, K_GU: gl.constexpr, K_DN: gl.constexpr, SLOTS: gl.constexpr):
    i = 0
    for layer in range(n_layers):
        i = _produce_stage(d_qkv, ring, ready, empty, i, layer * N_QKV, pid * R_QKV, N_QKV, R_QKV, K_QKV, SLOTS)
        i = _produce_stage(d_o, ring, ready, empty, i, layer * N_O, pid * R_O, N_O, R_O, K_O, SLOTS)
        i = _produce_stage(d_gu, ring, ready, empty, i, layer * N_GU, pid * R_GU, N_GU, R_GU, K_GU, SLOTS)
        i = _produce_stage(d_dn, ring, ready, empty, i, layer * N_DN, pid * R_DN, N_DN, R_DN, K_DN, SLOTS)


@gluon.jit
def _grid_barrier(sync, arrived, nprog):
    gl.thread_barrier()
    gl.atomic_add(sync, 1, sem="release", scope="gpu")
    target = arrived + nprog
    seen = gl.atomic_add(sync, 0, sem="relaxed", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(sync, 0, sem="relaxed", scope="gpu")
    gl.atomic_add(sync, 0, sem="acquire", scope="gpu")
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
def _consume_stage(x, out, ring, ready, empty, xbuf, i, row0, n_rows, ROWS: gl.constexpr, K: gl.constexpr,
                   SLOTS: gl.constexpr, MODE: gl.constexpr, layout: gl.constexpr):
    """out[rows] = W[rows] @ x[:K] for this program's ROWS rows, box by box from the ring (MODE "gemv"); MODE
    "stream" only takes each box and hands its slot back (no shared-memory read, no math) and stores zeros."""
    rs = gl.arange(0, BR, layout=gl.SliceLayout(1, layout))
    if MODE == "gemv":
        _load_x(x, xbuf, K, layout)
    # the same bytes as rows of BK (unswizzled, row-major either way): .index(c) is x[c * BK:(c + 1) * BK]
    xrow = xbuf._reinterpret(gl.float32, [xbuf.shape[0] * XR, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for r in gl.static_range(ROWS // BR):
        acc = gl.zeros([BR, BK], gl.float32, layout=layout)
        for c in range(gl.where(row0 + r * BR < n_rows, K // BK, 0)):  # the producer skips the same boxes
            slot = i % SLOTS
            if MODE == "gemv":
                xv = xrow.index(c).load(gl.SliceLayout(0, layout))  # does not wait for the box
                mbarrier.wait(ready.index(slot), (i // SLOTS) & 1)
                w = ring.index(slot).load(layout)
                mbarrier.arrive(empty.index(slot))
                acc += w.to(gl.float32) * xv[None, :]  # lanes reduce once per row group, below
            else:
                mbarrier.wait(ready.index(slot), (i // SLOTS) & 1)
                mbarrier.arrive(empty.index(slot))
            i += 1
        rows = row0 + r * BR + rs
        gl.store(out + rows, gl.sum(acc, axis=1), mask=rows < n_rows)
    return i


@gluon.jit
def _consumer(x_qkv, x_o, x_gu, x_dn, ring, ready, empty, xbuf, sync, n_layers, pid, nprog,
              N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr,
              R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, R_DN: gl.constexpr,
              K_QKV: gl.constexpr, K_O: gl.constexpr, K_GU: gl.constexpr, K_DN: gl.constexpr,
              SLOTS: gl.constexpr, BARRIERS: gl.constexpr, MODE: gl.constexpr, NUM_WARPS: gl.constexpr):
    # stage s reads the output of stage s - 1 (x_dn -> QKV -> x_qkv -> o -> x_o -> gate/up -> x_gu -> down -> x_dn)
    gl.static_assert(gl.num_warps() == NUM_WARPS, "NUM_WARPS must be the launch's num_warps")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    i = 0
    arrived = 0
    for _layer in range(n_layers):
        i = _consume_stage(x_dn, x_qkv, ring, ready, empty, xbuf, i, pid * R_QKV, N_QKV, R_QKV, K_QKV, SLOTS, MODE,
                           layout)
        if BARRIERS:
            arrived = _grid_barrier(sync, arrived, nprog)
        i = _consume_stage(x_qkv, x_o, ring, ready, empty, xbuf, i, pid * R_O, N_O, R_O, K_O, SLOTS, MODE, layout)
        if BARRIERS:
            arrived = _grid_barrier(sync, arrived, nprog)
        i = _consume_stage(x_o, x_gu, ring, ready, empty, xbuf, i, pid * R_GU, N_GU, R_GU, K_GU, SLOTS, MODE,
                           layout)
        if BARRIERS:
            arrived = _grid_barrier(sync, arrived, nprog)
        i = _consume_stage(x_gu, x_dn, ring, ready, empty, xbuf, i, pid * R_DN, N_DN, R_DN, K_DN, SLOTS, MODE,
                           layout)
        if BARRIERS:
            arrived = _grid_barrier(sync, arrived, nprog)


@gluon.jit
def stream_layers(d_qkv, d_o, d_gu, d_dn, x_qkv, x_o, x_gu, x_dn, sync, n_layers,
                  N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr,
                  R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, R_DN: gl.constexpr,
                  K_QKV: gl.constexpr, K_O: gl.constexpr, K_GU: gl.constexpr, K_DN: gl.constexpr, KMAX: gl.constexpr,
                  SLOTS: gl.constexpr, BARRIERS: gl.constexpr, MODE: gl.constexpr, NUM_WARPS: gl.constexpr):
    gl.static_assert(K_QKV <= KMAX and K_O <= KMAX and K_GU <= KMAX and K_DN <= KMAX, "KMAX is the largest K")
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
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (x_qkv, x_o, x_gu, x_dn, ring, ready, empty, xbuf, sync, n_layers, pid, nprog, N_QKV, N_O, N_GU,
                     N_DN, R_QKV, R_O, R_GU, R_DN, K_QKV, K_O, K_GU, K_DN, SLOTS, BARRIERS, MODE, NUM_WARPS)),
        (_producer, (d_qkv, d_o, d_gu, d_dn, ring, ready, empty, n_layers, pid, N_QKV, N_O, N_GU, N_DN,
                     R_QKV, R_O, R_GU, R_DN, K_QKV, K_O, K_GU, K_DN, SLOTS)),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 24, 48], help="ring slots of 4 KB")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["stream", "gemv"],
                    help="stream: the consumer only takes each box and hands its slot back (the producer/TMA "
                         "ceiling); gemv: the GEMVs")
    ap.add_argument("--warps", type=int, default=4, help="consumer warps (num_warps), a multiple of 4")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    args = ap.parse_args()
    if args.warps < 4 or args.warps % 4:
        ap.error("--warps must be a positive multiple of 4 (warp specialization)")
    dims, layers = shapes(args.preset)
    kmax = max(k for _, k in dims.values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    br, bk = BR.value, BK.value
    rows = {k: triton.cdiv(triton.cdiv(n, sms), br) * br for k, (n, _) in dims.items()}  # per program, whole boxes
    assert all(k % bk == 0 for _, k in dims.values()), "K must be a multiple of BK"
    ws = {k: torch.randn(layers * n, kk, device="cuda", dtype=torch.bfloat16) * 0.03 for k, (n, kk) in dims.items()}
    descs = {k: TensorDescriptor(w, list(w.shape), list(w.stride()), [br, bk], box_layout()) for k, w in ws.items()}
    xs = {k: torch.randn(max(n, 4096), device="cuda", dtype=torch.float32) for k, (n, _) in dims.items()}
    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
    weight_bytes = sum(w.numel() * 2 for w in ws.values())
    floor_us = weight_bytes / args.bandwidth_tbs / 1e6
    print(f"{args.preset}: {layers} layers, {weight_bytes / 1e9:.3f} GB of GEMV weights, {sms} programs, "
          f"rows per program {rows}; floor {floor_us:.1f} us at {args.bandwidth_tbs} TB/s; shared x buffer "
          f"{x_bytes(kmax) // 1024} KB (mode gemv)", flush=True)
    for mode, slots, barriers in itertools.product(args.modes, args.slots, (False, True)):
        def call(slots=slots, barriers=barriers, mode=mode):
            sync.zero_()
            stream_layers[(sms,)](descs["qkv"], descs["o"], descs["gu"], descs["dn"], xs["qkv"], xs["o"],
                                  xs["gu"], xs["dn"], sync, layers,
                                  *(dims[k][0] for k in ("qkv", "o", "gu", "dn")),
                                  *(rows[k] for k in ("qkv", "o", "gu", "dn")),
                                  *(dims[k][1] for k in ("qkv", "o", "gu", "dn")), kmax,
                                  slots, barriers, mode, args.warps, num_warps=args.warps)
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
            print(f"{mode:6} slots {slots:3} ({slots * 4} KB) barriers {int(barriers)}: {us:8.1f} us per call, "
                  f"{weight_bytes / us / 1e6:6.2f} TB/s, {us / layers:6.2f} us per layer, "
                  f"{us / floor_us:4.2f}x floor", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or launch is a row
            print(f"{mode:6} slots {slots:3} barriers {int(barriers)}: FAILED {type(e).__name__}: {str(e)[:300]}",
                  flush=True)


if __name__ == "__main__":
    main()
