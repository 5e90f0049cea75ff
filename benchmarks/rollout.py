"""Rollout throughput: the torch engine vs Hugging Face `generate`, same model, prompts and lengths.

    python benchmarks/rollout.py --device cpu --preset small
    python benchmarks/rollout.py --device cuda --preset qwen3-0.6b-shape --batch-sizes 1 16 64 256 \\
        --prompt-len 512 --new-tokens 1024 --out bench_rollout.json

Both sides sample at T=1 (no top-k/top-p) and ignore EOS, so every sample has exactly the requested length.
Tokens/s counts generated tokens over the wall time of the whole call (prefill included). On CUDA it
also measures the batch-1 decode step against the memory-bandwidth floor (weight bytes / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rlbench.engine.protocol import SamplingParams
from rlbench.engine.torch_engine import KV_FLOOR, TorchEngine, TorchEngineConfig, bucket
from rlbench.models import build_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def bench_engine(engine: TorchEngine, prompts, new_tokens: int, device: str) -> float:
    """Generated tokens per second of one `generate` call."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    _sync(device)
    assert all(len(g.token_ids) == new_tokens for g in out)
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


@torch.inference_mode()
def bench_hf(model, prompts, new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=0, attention_mask=torch.ones_like(ids))
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    _sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def decode_step_ms(engine: TorchEngine, prompt_len: int, new_tokens: int, steps: int = 200) -> float:
    """Batch-1 decode step time (ms) at kv-length bucket of the mid-generation position.

    The timed steps run the `steps` positions just below the mid-generation position: the compiled step reads
    the whole bucket either way, but the megakernel reads up to the position (left at the end of the last
    generate, it would time the longest context instead)."""
    runner = engine.runner
    b = bucket(1, engine.cache.shape.num_slots, runner.min_batch)
    mid = prompt_len + new_tokens // 2
    kv = bucket(mid, engine.cache.shape.max_seq_len, KV_FLOOR)
    for _ in range(3):
        runner.decode(b, kv, "sample")
    runner.state.positions[:b].fill_(max(0, mid - steps))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.decode(b, kv, "sample")
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def profile_step(engine: TorchEngine, b: int, kv: int, steps: int = 10, group: int = 1) -> str:
    """CUDA kernel table of `steps` compiled (not graph-replayed) decode steps: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    runner.decode(b, kv, "sample", group)  # compiled + captured already; the eager call below reuses the compile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        for _ in range(steps):
            runner._decode_eager(b, kv, "sample", group)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    kernels = sum(e.count for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return f"batch {b}, kv {kv}: {kernels / steps:.0f} kernels per step\n{table}"


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=None,
                    help="cap HF generate's length to save time (its tok/s only rises when shorter)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-fused", action="store_true", help="run the HF layers' own matmuls (fused_weights=False)")
    ap.add_argument("--decode-attention", default=TorchEngineConfig.decode_attention, choices=["auto", "split", "sdpa", "split_kv"])
    ap.add_argument("--gemv-batch1", action=argparse.BooleanOptionalAction, default=TorchEngineConfig.gemv_batch1,
                    help="batch 1 in its own GEMV-lowered graph")
    ap.add_argument("--megakernel", action=argparse.BooleanOptionalAction, default=None,
                    help="batch-1 decode as one persistent Triton kernel (CUDA, bf16)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth for the floor (H200: 4.3)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", type=int, nargs="*", default=None,
                    help="CUDA: print the kernel table of the decode step at these batch sizes (default: 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    hf_new = args.hf_new_tokens or args.new_tokens
    seq_len = args.prompt_len + args.new_tokens
    cfg = TorchEngineConfig(max_seq_len=seq_len, num_slots=max(args.batch_sizes), mem_fraction=args.mem_fraction,
                            cuda_graphs=not args.no_cuda_graph, compile=not args.no_compile,
                            fused_weights=not args.no_fused, decode_attention=args.decode_attention,
                            gemv_batch1=args.gemv_batch1, megakernel=args.megakernel)
    engine = TorchEngine(build_model(args.preset, device=args.device, dtype=dtype), cfg)
    t0 = time.perf_counter()
    n_buckets = engine.warm_up() if cuda and cfg.cuda_graphs else 0
    warm_s = time.perf_counter() - t0
    n_graphs = len(engine.runner._graphs)  # what was really captured (a failed capture warns and runs eager)
    engine.generate(_prompts(2, args.prompt_len, engine.model.config.vocab_size, 99), SamplingParams(max_new_tokens=8))
    hf_model = None if args.skip_hf else build_model(args.preset, device=args.device, dtype=dtype)
    rows = []
    for b in args.batch_sizes:
        prompts = _prompts(b, args.prompt_len, engine.model.config.vocab_size, seed=b)
        ours = bench_engine(engine, prompts, args.new_tokens, args.device)
        hf = None if hf_model is None else bench_hf(hf_model, prompts, hf_new, args.device)
        rows.append(dict(batch=b, engine_tok_s=ours, hf_tok_s=hf, speedup=None if hf is None else ours / hf))
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", preset=args.preset, dtype=str(dtype),
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, hf_new_tokens=hf_new,
                  cuda_graphs=engine.runner.cuda_graphs, compiled=engine.runner.compiled, fused=engine.runner.fused,
                  decode_attention=cfg.decode_attention, gemv_batch1=cfg.gemv_batch1, megakernel=cfg.megakernel.enabled,
                  buckets_warmed=n_buckets, graphs_captured=n_graphs, warm_up_s=warm_s, threads=torch.get_num_threads(), rows=rows)
    if cuda:
        step = decode_step_ms(engine, args.prompt_len, args.new_tokens)
        floor = weight_bytes(engine.model) / (args.bandwidth_tbs * 1e12) * 1e3
        result.update(decode_b1_ms=step, floor_ms=floor, decode_over_floor=step / floor)
    _print(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if cuda and args.profile is not None:
        kv = bucket(args.prompt_len + args.new_tokens // 2, engine.cache.shape.max_seq_len, KV_FLOOR)
        for b in args.profile or [1]:
            print(profile_step(engine, bucket(b, engine.cache.shape.num_slots, engine.runner.min_batch), kv))
    return result


def _print(r: dict) -> None:
    print(f"{r['preset']} {r['dtype']} on {r['device']}: prompt {r['prompt_len']}, new {r['new_tokens']} "
          f"(HF new {r['hf_new_tokens']}), graphs={r['cuda_graphs']} compiled={r['compiled']}")
    print(f"{'batch':>6} {'engine tok/s':>14} {'HF tok/s':>12} {'speedup':>8}")
    for row in r["rows"]:
        hf = "-" if row["hf_tok_s"] is None else f"{row['hf_tok_s']:.1f}"
        sp = "-" if row["speedup"] is None else f"{row['speedup']:.1f}x"
        print(f"{row['batch']:>6} {row['engine_tok_s']:>14.1f} {hf:>12} {sp:>8}")
    print(f"warm_up_s {r['warm_up_s']:.1f} ({r['graphs_captured']} graphs captured of "
          f"{r['buckets_warmed']} buckets)")
    if "decode_b1_ms" in r:
        print(f"batch-1 decode step {r['decode_b1_ms']:.3f} ms; floor {r['floor_ms']:.3f} ms "
              f"({r['decode_over_floor']:.2f}x)")


if __name__ == "__main__":
    main()
