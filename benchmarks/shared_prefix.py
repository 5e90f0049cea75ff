"""Rollout with and without the shared-prefix KV layout (`TorchEngineConfig.shared_prefix`), side by side.

    python benchmarks/shared_prefix.py --device cuda --preset qwen3-0.6b-shape --prompts 8 --n 8 \\
        --prompt-len 510 --new-tokens 256 --compile 0 1 --decode-attention sdpa split_kv --out $OUT/shared_prefix.json

The RL shape: `prompts` prompts x `n` samples each, T = 1, EOS ignored. Per (compile, shared_prefix) variant, one
fresh engine on the same model: the first `generate` (compile and graph capture: `first_s`) and the median of
`--repeats` more (`tok_s`). Against the copied-prefix variant of the same compile setting it reports how many
samples came out token for token equal and the log-prob gap over each pair's common prefix (the two layouts run
different attention shapes, so in bf16 the samples may part ways after a near-tie). `--decode-attention` runs the
shared layout once per decode attention (`TorchEngineConfig.decode_attention`; the copied layout keeps "auto").
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from rlbench.configs.engine import TorchEngineConfig
from rlbench.engine.protocol import SamplingParams
from rlbench.engine.torch_engine import TorchEngine
from rlbench.models import build_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_variant(model, args, compile_: bool, shared: bool, attention: str, prompts) -> tuple[dict, list]:
    cfg = TorchEngineConfig(max_seq_len=args.prompt_len + args.new_tokens + 16, compile=compile_,
                            shared_prefix=shared, num_slots=args.prompts * args.n, decode_attention=attention)
    engine = TorchEngine(model, cfg.on_device(args.device.startswith("cuda")))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, ignore_eos=True, seed=7)
    times, out = [], None
    for _ in range(1 + args.repeats):
        _sync(args.device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(g.token_ids) for g in out)
    row = dict(compile=compile_, shared_prefix=shared, decode_attention=attention, first_s=times[0], median_s=statistics.median(times[1:]),
               tok_s=tokens / statistics.median(times[1:]), graphs=len(engine.runner._graphs))
    if args.profile and compile_:
        print(profile_generate(engine, prompts, sampling), flush=True)
    del engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row, out


def profile_generate(engine: TorchEngine, prompts, sampling: SamplingParams) -> str:
    """One warm `generate` under torch.profiler: wall vs GPU-busy time (the difference is the host: launches,
    syncs, Python), the kernels per decode step, and the top kernels and host ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, sampling)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    avgs = prof.key_averages()
    kernels = [e for e in avgs if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    steps = sampling.max_new_tokens
    head = (f"profiled generate: wall {wall:.3f} s (profiler on), GPU busy {busy:.3f} s ({busy / wall:.0%}), "
            f"{launches} kernels = {launches / steps:.0f} per decode step, {busy / steps * 1e3:.2f} ms GPU per step")
    return "\n".join([head, avgs.table(sort_by="self_device_time_total", row_limit=25),
                      avgs.table(sort_by="self_cpu_time_total", row_limit=15)])


def agreement(a: list, b: list) -> dict:
    """Samples equal token for token, and max |log-prob difference| over each pair's common token prefix."""
    equal, gap = 0, 0.0
    for x, y in zip(a, b):
        equal += x.token_ids == y.token_ids
        common = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        if common:
            gap = max(gap, max(abs(p - q) for p, q in zip(x.log_probs[:common], y.log_probs[:common])))
    return dict(equal_samples=equal, samples=len(a), max_logprob_gap_common_prefix=gap)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=510)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--compile", type=int, nargs="+", default=[0], choices=[0, 1])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-attention", nargs="+", default=["auto"],
                    choices=["auto", "sdpa", "split", "split_kv"], help="the shared layout's decode attentions")
    ap.add_argument("--profile", action="store_true", help="CUDA: print a profile of one more generate per compiled variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    model = build_model(args.preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    rows = []
    for compile_ in args.compile:
        copied = None
        for shared, attention in [(False, "auto")] + [(True, a) for a in args.decode_attention]:
            row, out = run_variant(model, args, bool(compile_), shared, attention, prompts)
            rows.append(row)
            print(f"compile={compile_} shared_prefix={int(shared)} decode_attention={attention}: {row['tok_s']:,.0f} "
                  f"tok/s (median {row['median_s']:.3f} s, first {row['first_s']:.1f} s, {row['graphs']} graphs)",
                  flush=True)
            if not shared:
                copied = (row, out)
                continue
            row |= agreement(out, copied[1])
            row["speedup"] = row["tok_s"] / copied[0]["tok_s"]
            print(f"  shared / copied: {row['speedup']:.2f}x; {row['equal_samples']}/{row['samples']} samples equal; "
                  f"max |dlogp| on common prefixes {row['max_logprob_gap_common_prefix']:.2e}", flush=True)
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  preset=args.preset, prompts=args.prompts, n=args.n, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
