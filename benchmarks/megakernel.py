"""The batch-1 decode megakernel alone: time per call (all decoder layers, no embedding/head) against the
bytes it must read (layer weights + the K/V of `pos` cached positions), per `MegakernelConfig` stage sync and
Gluon setting, as the engine builds it (`rlbench.engine.megakernel.build`).

    python benchmarks/megakernel.py --preset qwen3-0.6b-shape --pos 256 1024 1500 --sync pdl barrier --gluon 1 0
"""

from __future__ import annotations

import argparse

import torch

from rlbench.configs.engine import STAGE_SYNC, MegakernelConfig, TorchEngineConfig
from rlbench.engine import megakernel
from rlbench.engine.kv_cache import CacheShape, KVCache
from rlbench.engine.runner import ModelRunner
from rlbench.models import build_model


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--pos", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--sync", nargs="+", default=["auto"], choices=["auto", *STAGE_SYNC],
                    help="MegakernelConfig.sync: a kernel per stage (with/without PDL) or grid barriers")
    ap.add_argument("--gluon", type=int, nargs="+", default=[-1], choices=[-1, 0, 1],
                    help="MegakernelConfig.gluon: the GEMV and attention stages in Gluon where they fit (-1: default)")
    ap.add_argument("--max-seq-len", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    model = build_model(args.preset, device="cuda", dtype=torch.bfloat16).eval()
    c = model.config
    cache = KVCache(CacheShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, args.max_seq_len),
                    torch.bfloat16, "cuda")
    for t in (*cache.k, *cache.v):  # cached K/V that are not all equal, so that the output checks below can fail
        t.normal_(0.0, 1.0)
    runner = ModelRunner(model, cache, TorchEngineConfig(compile=False, cuda_graphs=False, megakernel=False))
    layer_bytes = sum(t.numel() * 2 for w in runner.layers for t in (w.qkv, w.o, w.gate_up, w.down))
    hidden = torch.randn(1, 1, c.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.1
    cos = torch.ones(1, 1, c.head_dim, device="cuda", dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    x = hidden.clone()
    print(f"{args.preset}: {sms} SMs, layer weights {layer_bytes / 1e9:.3f} GB", flush=True)
    first_out: dict[int, torch.Tensor] = {}
    for sync in args.sync:
        for gluon in args.gluon:
            cfg = MegakernelConfig(enabled=True, sync=sync, gluon=None if gluon < 0 else bool(gluon), head=False)
            decoder = megakernel.build(model, runner.base, runner.layers, args.max_seq_len, torch.device("cuda"), cfg)
            assert decoder is not None, "megakernel unsupported here"
            mk = decoder.layers
            mk.bind(runner.layers, cache.k, cache.v)
            label = (f"sync {mk.stage_sync:7} gluon stages {''.join(map(str, sorted(mk.gluon_active()))) or '-':4} "
                     f"gluon attention {int(mk.gluon_attention_active())}")
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
                      f"{ms * 1e3 / c.num_hidden_layers:5.1f} us per layer; output repeatable (4 calls): "
                      f"{repeatable}, == the first config's: {same} (max |diff| {diff:.3g})", flush=True)


if __name__ == "__main__":
    main()
