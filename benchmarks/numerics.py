"""The batch-invariant Triton kernels (`rlbench/numerics/triton_ops.py`) against the torch ops they replace,
on CUDA: matmul vs `F.linear` (cuBLAS) at Qwen3-0.6B/4B layer shapes, training and decode M; attention vs
SDPA (causal prefill, and decode against a cache with a mask, as the engine's "sdpa" decode); RMSNorm vs the
HF formula in eager torch; logsumexp_rows vs `torch.logsumexp`. Times are medians of CUDA-event timed calls.

    python3 benchmarks/numerics.py            # all shapes (a few minutes)
    python3 benchmarks/numerics.py --quick    # one model, fewer shapes and iterations

Needs only torch and triton: the module is loaded from its file, not through the rlbench package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rlbench.numerics import layout


def _load_ops():
    path = Path(__file__).resolve().parents[1] / "rlbench" / "numerics" / "triton_ops.py"
    spec = importlib.util.spec_from_file_location("triton_ops", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["triton_ops"] = mod
    spec.loader.exec_module(mod)
    return mod


ops = _load_ops()

MODELS = {"qwen3-0.6b": dict(hidden=1024, q=2048, kv=1024, ffn=3072, heads=16, kv_heads=8),
          "qwen3-4b": dict(hidden=2560, q=4096, kv=1024, ffn=9728, heads=32, kv_heads=8)}
VOCAB = 151936


def timed(iters: int, fn, *args, **kwargs) -> float:
    """Median ms of `iters` calls `fn(*args, **kwargs)`, each between two CUDA events (after 3 untimed)."""
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def row(rows, op, shape, ours_ms, torch_ms, work, unit):
    """`work` is FLOP (unit TFLOP/s) or bytes (unit GB/s)."""
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    rows.append(dict(op=op, shape=shape, ours_ms=ours_ms, torch_ms=torch_ms, unit=unit,
                     ours_rate=work / ours_ms / 1e-3 / scale, torch_rate=work / torch_ms / 1e-3 / scale,
                     slowdown=ours_ms / torch_ms))
    r = rows[-1]
    print(f"  {op:10} {shape:34} {ours_ms:9.4f} {torch_ms:9.4f}  {r['ours_rate']:8.1f} {r['torch_rate']:8.1f} "
          f"{unit:8} {r['slowdown']:6.2f}x", flush=True)


def bench_matmul(rows, models, ms, iters, dtype):
    for name in models:
        c = MODELS[name]
        h = c["hidden"]
        shapes = [("q_proj", c["q"], h), ("k/v_proj", c["kv"], h), ("o_proj", h, c["q"]), ("gate/up", c["ffn"], h),
                  ("down", h, c["ffn"]), ("lm_head", VOCAB, h)]
        for m in ms:
            for layer, n, k in shapes:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5
                n_it = max(3, iters // 4) if n * m > 2**30 else iters
                ours = timed(n_it, ops.matmul, x, w, None)
                ref = timed(n_it, F.linear, x, w)
                row(rows, "matmul", f"{name} {layer} M={m} N={n} K={k}", ours, ref, 2 * m * n * k, "TFLOP/s")
                del x, w


def bench_attention(rows, t_values, batches, iters, dtype, heads=16, kv_heads=8, hd=128):
    group = heads // kv_heads
    scale = hd**-0.5
    for t, docs in [(t, 1) for t in t_values] + [(max(t_values), 4)]:
        q = torch.randn(1, t, heads, hd, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, t, kv_heads, hd, device="cuda", dtype=dtype) for _ in range(2))
        n = t // docs
        starts = torch.arange(docs) * n
        positions = torch.arange(n, device="cuda").repeat(docs)
        tiles = layout.tiles_for_documents(starts, torch.full((docs,), n), torch.zeros(docs), starts, ops.tokens_per_tile(group), "cuda")
        # SDPA on the same documents as a [docs, H, n, hd] batch, K/V expanded to H heads beforehand (flash path)
        qs = q.view(docs, n, heads, hd).transpose(1, 2)
        ks, vs = (x.view(docs, n, kv_heads, hd).transpose(1, 2).repeat_interleave(group, 1) for x in (k, v))
        ours = timed(iters, ops.attention, q, k, v, positions, *tiles, scale)
        ref = timed(iters, F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, scale=scale)
        flops = docs * 4 * heads * hd * n * (n + 1) / 2
        label = f"prefill T={t}" + (f" ({docs} docs)" if docs > 1 else "") + f" H={heads}/{kv_heads}"
        row(rows, "attention", label, ours, ref, flops, "TFLOP/s")
    length = 1024
    for b in batches:
        kc, vc = (torch.randn(b, kv_heads, length, hd, device="cuda", dtype=dtype) for _ in range(2))
        q = torch.randn(b, 1, heads, hd, device="cuda", dtype=dtype)
        positions = torch.full((b,), length - 1, device="cuda")
        tiles = layout.tiles_for_decode(torch.arange(b, device="cuda"))
        mask = (torch.arange(length, device="cuda")[None, :] <= positions[:, None])[:, None, None, :]
        qd = q.view(b, kv_heads, group, hd)
        ours = timed(iters, ops.attention, q, kc.transpose(1, 2), vc.transpose(1, 2), positions, *tiles, scale)
        ref = timed(iters, F.scaled_dot_product_attention, qd, kc, vc, attn_mask=mask, scale=scale)
        row(rows, "attention", f"decode B={b} kv_len={length} H={heads}/{kv_heads}", ours, ref,
            2 * kc.numel() * kc.element_size(), "GB/s")


def hf_rms_norm(x, w, eps):
    """HF Qwen3RMSNorm in eager torch."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def bench_rms_norm(rows, iters, dtype):
    for m, d in [(16384, 1024), (16384, 2560), (16384 * 16, 128), (256, 1024)]:
        x = torch.randn(m, d, device="cuda", dtype=dtype)
        w = torch.rand(d, device="cuda", dtype=dtype)

        ours, ref = timed(iters, ops.rms_norm, x, w, 1e-6), timed(iters, hf_rms_norm, x, w, 1e-6)
        row(rows, "rms_norm", f"M={m} D={d}", ours, ref, 2 * x.numel() * x.element_size(), "GB/s")


def bench_logsumexp(rows, iters):
    for m in (1, 64, 4096):
        z = torch.randn(m, VOCAB, device="cuda")
        ours, ref = timed(iters, ops.logsumexp_rows, z), timed(iters, torch.logsumexp, z, -1)
        row(rows, "logsumexp", f"M={m} V={VOCAB} fp32", ours, ref, z.numel() * 4, "GB/s")


# Tile configs the GPU test (tests/test_numerics_gpu.py, CANDIDATES) found bit-identical to MATMUL_LARGE.
SWEEP = [ops.MatmulConfig(16, 32, 4, 4, 16), ops.MatmulConfig(32, 64, 4, 4, 16), ops.MatmulConfig(64, 32, 4, 4, 16),
         ops.MatmulConfig(64, 64, 4, 4, 16), ops.MatmulConfig(128, 64, 4, 4, 8), ops.MatmulConfig(128, 128, 8, 4, 8),
         ops.MatmulConfig(128, 256, 8, 3, 8)]


def graph_timed(iters: int, fn) -> float:
    """ms per call of `fn`, `iters` calls captured in one CUDA graph and replayed (launch cost excluded, as in the
    engine's decode graphs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def sweep_matmul(dtype, out: str) -> None:
    """Time every SWEEP config at the models' layer shapes, per M; write the fastest small-M (M <= 512) and
    large-M config as `{"small": [...], "large": [...]}` (MatmulConfig fields) to `out`."""
    best = {}
    for group, ms in (("small", (64, 256)), ("large", (8192, 16384))):
        totals = {}
        for cfg in SWEEP:
            ops.MATMUL_CONFIGS = ((0, cfg),)
            times = []
            for c in MODELS.values():
                h = c["hidden"]
                for n, k in ((c["q"], h), (c["kv"], h), (h, c["q"]), (c["ffn"], h), (h, c["ffn"]), (VOCAB, h)):
                    for m in ms:
                        x = torch.randn(m, k, device="cuda", dtype=dtype)
                        w = torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5
                        iters = 20 if m * n < 2**28 else 3
                        times.append(graph_timed(iters, lambda x=x, w=w: ops.matmul(x, w)))
                        torch_ms = graph_timed(iters, lambda x=x, w=w: F.linear(x, w))
                        times[-1] = times[-1] / torch_ms  # time relative to cuBLAS at this shape
            totals[cfg] = statistics.geometric_mean(times)
            print(f"sweep {group:5} {cfg}: {totals[cfg]:.3f}x cuBLAS (geometric mean over {len(times)} shapes)",
                  flush=True)
        best[group] = list(min(totals, key=totals.get))
    Path(out).write_text(json.dumps(best))
    print("best", best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3-0.6B only, fewer shapes and iterations")
    ap.add_argument("--iters", type=int, default=0, help="timed calls per case (default 30, --quick 10)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default="", help="also write the rows as JSON to this file")
    ap.add_argument("--sweep", default="", help="time the bit-identical matmul tile configs, write the best to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    iters = args.iters or (10 if args.quick else 30)
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    if args.sweep:
        with torch.no_grad():
            sweep_matmul(dtype, args.sweep)
        return

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}")
    print(f"MATMUL_CONFIGS {ops.MATMUL_CONFIGS}  BLOCK_K {ops.MATMUL_BLOCK_K}")
    print(f"attention BLOCK_M {ops.ATTN_BLOCK_M} BLOCK_N {ops.ATTN_BLOCK_N} warps {ops.ATTN_NUM_WARPS} "
          f"stages {ops.ATTN_NUM_STAGES}")
    print(f"  {'op':10} {'shape':34} {'ours ms':>9} {'torch ms':>9}  {'ours':>8} {'torch':>8} {'unit':8} "
          f"{'ours/torch':>6}")
    rows: list[dict] = []
    with torch.no_grad():
        models = ["qwen3-0.6b"] if args.quick else list(MODELS)
        bench_matmul(rows, models, [4096, 64] if args.quick else [4096, 16384, 64, 256], iters, dtype)
        bench_attention(rows, [1024] if args.quick else [1024, 4096], [64] if args.quick else [64, 256], iters,
                        dtype)
        bench_rms_norm(rows, iters, dtype)
        bench_logsumexp(rows, iters)
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r["slowdown"] for r in rows if r["op"] == op]
        print(f"{op}: time vs torch, geometric mean {statistics.geometric_mean(mine):.2f}x over {len(mine)} shapes")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
