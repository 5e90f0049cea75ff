"""The batch-1 decode megakernel alone: time per call (all decoder layers, no embedding/head) against the
bytes it must read (layer weights + the K/V of `pos` cached positions), per stage sync (a kernel per stage with
PDL, grid barriers, plain launches), warp count, GEMV tile size and programs per SM; and the cost of one grid
barrier and of one kernel boundary on their own (5 per layer).

    python benchmarks/megakernel.py --preset qwen3-0.6b-shape --pos 256 1024 --warps 4 8 16
    python benchmarks/megakernel.py --tile-elems 4096 8192 --programs-per-sm 1 2 --warps 4 8 --barriers
    python benchmarks/megakernel.py --pos 256 1024 --stages   # where a layer's time goes, per stage
    python benchmarks/megakernel.py --stage-sync pdl barrier launch --stages   # kernel per stage vs grid barriers
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from rlbench.engine.config import TorchEngineConfig
from rlbench.engine.kv_cache import CacheShape, KVCache
from rlbench.engine.megakernel import host as megakernel
from rlbench.engine.megakernel.triton_stages import _grid_sync, _stage_boundary
from rlbench.engine.runner import ModelRunner
from rlbench.models import build_model


@triton.jit
def _barriers_only(sync, err, n, MAX_SPINS: tl.constexpr):
    arrived = tl.num_programs(0) * 0
    for _ in range(n):
        arrived = _grid_sync(sync, arrived, err, MAX_SPINS)


@triton.jit
def _boundary_only(PDL: tl.constexpr):
    _stage_boundary(PDL)


def timed(fn, iters: int) -> float:
    """ms per call of `fn`, captured once in a CUDA graph and replayed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def barrier_cost(sms: int, per_sm: int, warps: int, n: int = 140, iters: int = 100) -> float:
    """us per grid barrier with `sms * per_sm` programs (n barriers per launch, launch cost amortised)."""
    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")

    def launch(k):
        sync.zero_()
        _barriers_only[(sms * per_sm,)](sync, err, k, MAX_SPINS=megakernel.MAX_SPINS, num_warps=warps)

    ms = timed(lambda: launch(n), iters) - timed(lambda: launch(0), iters)
    assert int(err.item()) == 0, "a barrier timed out"
    return ms * 1e3 / n


def boundary_cost(sms: int, warps: int, pdl: bool, n: int = 140, iters: int = 100) -> float:
    """us per kernel boundary: n empty dependent kernels of `sms` programs in one graph (launch amortised)."""
    def chain(k):
        for _ in range(k):
            _boundary_only[(sms,)](PDL=pdl, num_warps=warps, launch_pdl=pdl)

    return (timed(lambda: chain(n), iters) - timed(lambda: chain(1), iters)) * 1e3 / (n - 1)


STAGES = ("qkv", "attend", "o_proj", "gate_up", "down")
STAGE_NAMES = (*STAGES, "merge")  # decode_stage's STAGE numbers


def stage_table(mk, call, layers: int) -> str:
    """Run `call` on a TIMED build of the kernel and tabulate its per-program laps (us per layer)."""
    mk.timed = True
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    mk.timed = False
    laps = mk.laps.double().cpu()
    ghz = laps[:, 10] / laps[:, 11]  # SM cycles per ns, per program (clock64 vs globaltimer)
    us = laps[:, :10] / ghz[:, None] / 1e3 / layers
    rows = [f"  {'stage':8} {'work mean':>9} {'work max':>9} {'wait mean':>9}   (us per layer, {ghz.mean():.2f} GHz)"]
    for i, name in enumerate(STAGES):
        work, wait = us[:, 2 * i], us[:, 2 * i + 1]
        rows.append(f"  {name:8} {work.mean():9.2f} {work.max():9.2f} {wait.mean():9.2f}")
    sub = laps[:, 12:15] / ghz[:, None] / 1e3 / layers
    for i, name in enumerate(("  blocks", "  ticket", "  merge")):  # attention's parts, over the programs doing them
        on = sub[:, i] > 0
        if on.any():
            rows.append(f"  {name:8} {sub[on, i].mean():9.2f} {sub[on, i].max():9.2f}      ({int(on.sum())} programs)")
    rows.append(f"  total    {laps[:, 11].mean() / 1e3 / layers:9.2f} us per layer (globaltimer, in-kernel)")
    return "\n".join(rows)


def stage_timeline(mk, call, layers: int) -> str:
    """Run `call` with TIMED per-stage kernels and tabulate, per stage (mean over layers 1..), in us from the moment
    the previous stage's last program ended: when this stage's programs started (first / mean), when their wait
    returned (mean / last), and when its last program ended (the stage's share of the critical path)."""
    mk.timed = True
    timed(call, 3)  # replayed from a CUDA graph: launched from Python, 168 kernels would wait for the host
    mk.timed = False
    order = list(megakernel.STAGE_ORDER)
    t = mk.stage_laps.view(layers, 6, mk.programs, 4)[:, order, :, :4].double().cpu().flatten(0, 1)
    t = (t - t[:, :, 2].amax(1).roll(1)[:, None, None])[len(order):] / 1e3  # from the previous end; layers 1..
    t = t.view(layers - 1, len(order), mk.programs, 4)
    gluon = set(mk.gluon_active()) | ({1} if mk.gluon_attention_active() else set())
    rows = [f"  {'stage':8} {'start 1st':>9} {'start avg':>9} {'start last':>10} {'wait avg':>9} {'wait last':>9} "
            f"{'end avg':>8} {'end':>7} {'ready avg':>9} {'ready last':>10}  (us; ready: Gluon tile landed / attention's q normed)"]
    for i, stage in enumerate(order):
        s = t[:, i]
        ready = (f" {s[..., 3].mean():9.2f} {s[..., 3].amax(1).mean():10.2f}" if stage in gluon else "")
        rows.append(f"  {STAGE_NAMES[stage]:8} {s[..., 0].amin(1).mean():9.2f} {s[..., 0].mean():9.2f} "
                    f"{s[..., 0].amax(1).mean():10.2f} {s[..., 1].mean():9.2f} {s[..., 1].amax(1).mean():9.2f} "
                    f"{s[..., 2].mean():8.2f} {s[..., 2].amax(1).mean():7.2f}{ready}")
    rows.append(f"  layer    {t[:, :, :, 2].amax(2).sum(1).mean():7.2f} us (sum of the stages' ends)")
    for i, stage in enumerate(order):  # is the last program to end the same one every layer?
        end = t[:, i, :, 2].mean(0)
        late = end.argsort(descending=True)[:6].tolist()
        rows.append(f"  latest {STAGE_NAMES[stage]:8} " + " ".join(
            f"pid {p:3} end {end[p]:5.2f} (wait {t[:, i, p, 1].mean():5.2f} ready {t[:, i, p, 3].mean():5.2f} "
            f"last in {int((t[:, i, :, 2].argmax(1) == p).sum()):2} layers)" for p in late[:3]))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--pos", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--warps", type=int, nargs="+", default=[8])
    ap.add_argument("--tile-elems", type=int, nargs="+", default=[megakernel.TILE_ELEMS])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1])
    ap.add_argument("--carveout", type=int, nargs="+", default=[0],
                    help="preferred shared-memory carveout in percent (-1: the driver's choice; default 0)")
    ap.add_argument("--merge-chunk", type=int, nargs="+", default=[megakernel.MERGE_CHUNK],
                    help="attention split partials merged per load (a power of 2)")
    ap.add_argument("--stage-sync", nargs="+", default=["pdl"], choices=list(megakernel.STAGE_SYNC),
                    help="grid barriers in one persistent kernel, or a kernel per stage (with/without PDL)")
    ap.add_argument("--merge-warps", type=int, nargs="+", default=[1],
                    help="warps of the per-stage kernels' attention merge (one q head per program)")
    ap.add_argument("--gluon", nargs="+", default=["default"],
                    help="per-stage kernels: the GEMV stages run as Gluon kernels (tile in shared memory, "
                         "DecodeMegakernel.gluon_gemv): 'default', '-' (none), or the stages as digits (unpaced, "
                         "early launch), then optionally ',gGxF' (TMA boxes per barrier, groups in flight), ',pS=GxF' "
                         "(the same for stage S), ',L[digits]' (those stages, all without digits, let the next "
                         "kernel launch after their wait), ',wN' (warps), ',f' (FFMAs, not the tensor cores), ',a' "
                         "(the Triton attention stage, not mk_attend's), ',hN' (N K/V blocks copied before its wait), ',s' "
                         "(a 2-block task's blocks one after the other), ',mN' (N blocks per attention task at "
                         "least); 'default,OPTS' applies OPTS to the default 0234,g2x2,L03")
    ap.add_argument("--barriers", action="store_true",
                    help="also time grid barriers alone and empty kernel boundaries (PDL and plain)")
    ap.add_argument("--stages", action="store_true",
                    help="also run a TIMED build: per stage, when programs start, wait and end (per-stage kernels) "
                         "or us per layer each program works and waits (barrier)")
    ap.add_argument("--max-seq-len", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.barriers:
        for per_sm, warps in [(p, w) for p in args.programs_per_sm for w in args.warps]:
            try:
                us = f"{barrier_cost(sms, per_sm, warps):.2f} us"
            except Exception as e:  # noqa: BLE001 - e.g. a grid whose programs are not all resident
                us = f"FAILED {type(e).__name__}: {str(e)[:120]}"
            print(f"grid barrier, {sms * per_sm} programs x {warps} warps: {us}", flush=True)
        for pdl in (True, False):
            print(f"kernel boundary, {sms} programs x {args.warps[0]} warps, {'pdl' if pdl else 'plain'}: "
                  f"{boundary_cost(sms, args.warps[0], pdl):.2f} us", flush=True)
    model = build_model(args.preset, device="cuda", dtype=torch.bfloat16).eval()
    c = model.config
    cache = KVCache(CacheShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, args.max_seq_len),
                    torch.bfloat16, "cuda")
    for t in (*cache.k, *cache.v):  # cached K/V that are not all equal, so that the output checks below can fail
        t.normal_(0.0, 1.0)
    runner = ModelRunner(model, cache, TorchEngineConfig(compile=False, cuda_graphs=False, megakernel=True))
    assert runner.megakernel is not None, "megakernel unsupported here"
    layer_bytes = sum(t.numel() * 2 for w in runner.layers for t in (w.qkv, w.o, w.gate_up, w.down))
    hidden = torch.randn(1, 1, c.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.1
    cos = torch.ones(1, 1, c.head_dim, device="cuda", dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    x = hidden.clone()
    print(f"{args.preset}: {sms} SMs, layer weights {layer_bytes / 1e9:.3f} GB", flush=True)
    # a grid barrier needs every program resident: more than one per SM only for the per-stage kernels
    configs = [(t, p, w, v, m, y, mw, g) for y in args.stage_sync for t in args.tile_elems
               for p in (args.programs_per_sm if y != "barrier" else [1]) for w in args.warps
               for v in args.carveout for m in args.merge_chunk for mw in (args.merge_warps if y != "barrier" else [0])
               for g in (args.gluon if y != "barrier" else ["-"])]
    first_out: dict[int, torch.Tensor] = {}
    for tile, per_sm, warps, carve, chunk, sync, merge_warps, gluon in configs:
        mk = megakernel.DecodeMegakernel(model, runner.layers, args.max_seq_len, torch.device("cuda"),
                                         programs=sms * per_sm, tile_elems=tile)
        mk.bind(runner.layers, cache.k, cache.v)
        mk.num_warps, mk.carveout, mk.merge_chunk = warps, None if carve < 0 else carve, chunk
        mk.stage_sync, mk.merge_warps, mk.gluon_gemv = sync, merge_warps or mk.merge_warps, gluon != "-"
        if gluon != "-":  # e.g. "0234,g2x2,L034,p0=8x2,w8": stages, pacing (all / one stage), late launch (all /
            # those stages), warps; "default,a": the defaults but the Triton attention stage
            stages, *opts = gluon.split(",")
            if stages != "default":
                mk.gluon_stages, mk.gluon_late_launch = tuple(int(c) for c in stages), ()  # unpaced, early launch
                mk.gluon_pacing = {st: (64, 1) for st in mk.gluon_pacing}
            for o in opts:
                if o[0] == "g":
                    mk.gluon_pacing = {st: tuple(map(int, o[1:].split("x"))) for st in mk.gluon_pacing}
                elif o[0] == "p":
                    st, gf = o[1:].split("=")
                    mk.gluon_pacing[int(st)] = tuple(map(int, gf.split("x")))
                elif o[0] == "L":
                    mk.gluon_late_launch = tuple(int(c) for c in (o[1:] or mk.gluon_stages))
                elif o[0] == "w":
                    mk.gluon_warps = int(o[1:])
                elif o == "f":
                    mk.gluon_mma = False
                elif o == "a":
                    mk.gluon_attention = False
                elif o[0] == "h":
                    mk.attention_ahead = int(o[1:])
                elif o == "s":
                    mk.attention_pair = False
                elif o[0] == "m":
                    mk.attention_min_blocks = int(o[1:])
        label = (f"tile {tile:5} programs {mk.programs:3} warps {warps:2} carveout {carve:3} merge {chunk:2} {sync:7}"
                 + (f" merge warps {merge_warps}" if merge_warps else "")
                 + (f" gluon {gluon}" if mk.gluon_active() else "")
                 + (f" gluon-attention ahead {mk.attention_ahead}{' pair' if mk.attention_pair else ''} min {mk.attention_min_blocks}"
                    if mk.gluon_attention_active() else ""))
        for pos in args.pos:
            p = torch.tensor([pos], device="cuda")
            try:
                ms = timed(lambda mk=mk, p=p: mk(x.copy_(hidden), cos, sin, p), args.iters)
                mk.check()
            except Exception as e:  # noqa: BLE001 - a configuration that does not launch is a row, not the end
                print(f"{label} pos {pos:5}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            outs = [x.clone()] + [mk(x.copy_(hidden), cos, sin, p).clone() for _ in range(3)]
            bits = [o.view(torch.int16) for o in outs]  # bitwise, NaN-proof
            repeatable = all(torch.equal(bits[0], b) for b in bits[1:])
            same = torch.equal(first_out.setdefault(pos, bits[0]), bits[0])
            diff = (outs[0].float() - first_out[pos].view(torch.bfloat16).float()).abs().max().item()
            kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * (pos + 1)
            total = layer_bytes + kv_bytes
            print(f"{label} pos {pos:5}: {ms * 1e3:7.1f} us per call, {total / ms / 1e6:6.0f} GB/s "
                  f"({total / ms / 1e7 / args.bandwidth_tbs:4.1f}% of {args.bandwidth_tbs} TB/s), "
                  f"{ms * 1e3 / c.num_hidden_layers:5.1f} us per layer; output repeatable (4 calls): {repeatable}, "
                  f"== the first config's: {same} (max |diff| {diff:.3g})", flush=True)
            if args.stages:
                table = stage_table if sync == "barrier" else stage_timeline
                print(table(mk, lambda mk=mk, p=p: mk(x.copy_(hidden), cos, sin, p), c.num_hidden_layers))


if __name__ == "__main__":
    main()
