"""The batch-1 decode megakernel alone: time per call (all decoder layers, no embedding/head) against the
bytes it must read (layer weights + the K/V of `pos` cached positions), per warp count.

    python benchmarks/megakernel.py --preset qwen3-0.6b-shape --pos 256 1024 --warps 4 8 16
"""

from __future__ import annotations

import argparse

import torch

from rlbench.models import build_model
from rlbench.rollout.kv_cache import CacheShape, KVCache
from rlbench.rollout.runner import ModelRunner, StepOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--pos", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--warps", type=int, nargs="+", default=[8])
    ap.add_argument("--max-seq-len", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    args = ap.parse_args()
    model = build_model(args.preset, device="cuda", dtype=torch.bfloat16).eval()
    c = model.config
    cache = KVCache(CacheShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, args.max_seq_len),
                    torch.bfloat16, "cuda")
    runner = ModelRunner(model, cache, StepOptions(compile=False, cuda_graphs=False, megakernel=True))
    mk = runner.megakernel
    assert mk is not None, "megakernel unsupported here"
    mk.bind(runner.layers, cache.k, cache.v)
    layer_bytes = sum(t.numel() * 2 for w in runner.layers for t in (w.qkv, w.o, w.gate_up, w.down))
    print(f"{args.preset}: {mk.programs} programs, layer weights {layer_bytes / 1e9:.3f} GB, "
          f"tiles qkv {mk.t_qkv} o {mk.t_o} gate_up {mk.t_gu} down {mk.t_dn}", flush=True)
    hidden = torch.randn(1, 1, c.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.1
    cos = torch.ones(1, 1, c.head_dim, device="cuda", dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    for warps in args.warps:
        mk.num_warps = warps
        for pos in args.pos:
            p = torch.tensor([pos], device="cuda")
            x = hidden.clone()
            for _ in range(3):
                mk(x.copy_(hidden), cos, sin, p)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                mk(x, cos, sin, p)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.iters
            kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * (pos + 1)
            total = layer_bytes + kv_bytes
            print(f"warps {warps:2} pos {pos:5}: {ms * 1e3:7.1f} us per call, {total / ms / 1e9:6.0f} GB/s "
                  f"({total / ms / 1e9 / (args.bandwidth_tbs * 1e3) * 100:4.1f}% of {args.bandwidth_tbs} TB/s), "
                  f"{ms * 1e3 / c.num_hidden_layers:5.1f} us per layer", flush=True)


if __name__ == "__main__":
    main()
