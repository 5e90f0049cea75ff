"""Padded micro-batches vs sequence packing on long-tailed response lengths.

CPU part (always): padding fraction, micro-batch count, balance and the time of first-fit /
Karmarkar–Karp / make_step_packs on lognormal lengths capped at 16k.
GPU part (--gpu): forward+backward time of the same tokens padded (`[B, Lmax]` + attention mask) vs
packed (`[1, T]`, position_ids restarting per sequence, use_cache=False) with sdpa and flex_attention.

    python benchmarks/packing.py --out packing_cpu.json
    python benchmarks/packing.py --gpu --out packing_gpu.json
    python benchmarks/packing.py --gpu --device cpu --preset tiny --gpu-samples 8 --out /tmp/smoke.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from rlbench.packing import PackingReport, first_fit_count, karmarkar_karp, make_step_packs, partition


def lognormal_lengths(n: int, seed: int, cap: int = 16384, mu: float = 7.0, sigma: float = 1.0) -> list[int]:
    """Prompt+response lengths: lognormal (median ~1.1k tokens) with a long tail cut at `cap`."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mu, sigma, n).astype(int) + 64, 64, cap).tolist()


def padded_batches(lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """The classic layout: consecutive groups of `micro_batch_size` sequences, each padded to its max."""
    return [list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)]


def padded_stats(lengths: list[int], batches: list[list[int]]) -> dict:
    slots = [len(b) * max(lengths[i] for i in b) for b in batches]
    real = sum(lengths)
    return {"micro_batches": len(batches), "padding_fraction": 1 - real / sum(slots), "max_batch_tokens": max(slots)}


def timed(fn, repeats: int, clock=time.perf_counter) -> tuple[float, object]:
    """Median seconds of `repeats` calls and the last result. The CPU part passes
    `time.process_time` (CPU seconds of this process): wall time on a shared machine measures the
    neighbours."""
    times, out = [], None
    for _ in range(repeats):
        t0 = clock()
        out = fn()
        times.append(clock() - t0)
    return statistics.median(times), out


def cpu_part(args) -> dict:
    lengths = lognormal_lengths(args.samples, args.seed)
    budget = args.max_tokens
    res = {"samples": args.samples, "total_tokens": sum(lengths), "max_len": max(lengths),
           "mean_len": float(np.mean(lengths)), "max_tokens_per_gpu": budget}
    res["padded"] = {f"mbs={m}": padded_stats(lengths, padded_batches(lengths, m)) for m in args.padded_mbs}
    cpu = time.process_time
    t_ff, n_mb = timed(lambda: first_fit_count(lengths, budget), args.repeats, cpu)
    tokens = lengths_as_tokens(lengths)
    t_pack, packs = timed(lambda: make_step_packs(tokens, n_mb, budget, args.pad_multiple), args.repeats, cpu)
    report = PackingReport.from_packs(packs, budget)
    res["packed"] = {"micro_batches": len(packs), "first_fit_count": n_mb, "padding_fraction": report.padding_fraction,
                     "imbalance": report.imbalance, "max_batch_tokens": report.to_dict()["max_pack_tokens"],
                     "first_fit_ms": 1e3 * t_ff, "make_step_packs_ms": 1e3 * t_pack, "report": report.to_dict()}
    big = lognormal_lengths(8192, args.seed + 1)
    for k in (8, 64, 256):
        t_kk, parts = timed(lambda k=k: karmarkar_karp(big, k), args.repeats, cpu)
        sums = [sum(big[i] for i in p) for p in parts]
        res[f"kk_8192_into_{k}"] = {"ms": 1e3 * t_kk, "imbalance": max(sums) / float(np.mean(sums))}
    t_part, _ = timed(lambda: partition(big, 64, max_tokens=int(1.002 * sum(big) / 64)), args.repeats, cpu)
    res["partition_8192_into_64_tight_budget_ms"] = 1e3 * t_part
    return res


def lengths_as_tokens(lengths: list[int]) -> list[list[int]]:
    return [[1] * n for n in lengths]


def print_cpu(res: dict) -> None:
    print(f"\n{res['samples']} samples, {res['total_tokens']} tokens (mean {res['mean_len']:.0f}, max {res['max_len']}),"
          f" max_tokens_per_gpu={res['max_tokens_per_gpu']}")
    print(f"{'layout':<16}{'micro-batches':>14}{'padding':>10}{'max tokens/mb':>15}")
    for name, r in res["padded"].items():
        print(f"{'padded ' + name:<16}{r['micro_batches']:>14}{r['padding_fraction']:>10.1%}{r['max_batch_tokens']:>15}")
    r = res["packed"]
    print(f"{'packed (KK)':<16}{r['micro_batches']:>14}{r['padding_fraction']:>10.1%}{r['max_batch_tokens']:>15}"
          f"   imbalance {r['imbalance']:.4f}")
    print(f"CPU time (process_time, median, torch threads {torch.get_num_threads()}):")
    print(f"first_fit {r['first_fit_ms']:.2f} ms, make_step_packs {r['make_step_packs_ms']:.1f} ms")
    for k in (8, 64, 256):
        kk = res[f"kk_8192_into_{k}"]
        print(f"karmarkar_karp 8192 -> {k}: {kk['ms']:.1f} ms (imbalance {kk['imbalance']:.5f})")
    print(f"partition 8192 -> 64 at 1.002x mean budget: {res['partition_8192_into_64_tight_budget_ms']:.1f} ms")


# ---- GPU part -------------------------------------------------------------------------------------------


def _fwd_bwd(model, input_ids, targets, **kw) -> None:
    logits = model(input_ids=input_ids, use_cache=False, **kw).logits  # [B, L, V]
    # bf16 logits straight into cross_entropy (fp32 accumulation inside): no [B*L, V] fp32 copy
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()


def padded_inputs(seqs: list[list[int]], batch: list[int], device) -> tuple:
    lmax = max(len(seqs[i]) for i in batch)
    ids = torch.zeros(len(batch), lmax, dtype=torch.long)
    mask = torch.zeros(len(batch), lmax, dtype=torch.long)
    for row, i in enumerate(batch):
        ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        mask[row, : len(seqs[i])] = 1
    has_next = mask.bool() & mask.roll(-1, 1).bool()  # position t predicts t+1 only inside a sequence
    has_next[:, -1] = False
    targets = torch.where(has_next, ids.roll(-1, 1), -100)
    return ids.to(device), targets.to(device), {"attention_mask": mask.to(device)}


def packed_inputs(pack, device) -> tuple:
    targets = torch.full_like(pack.tokens, -100)
    targets[pack.response_index] = pack.tokens[pack.response_index + 1]
    kw = {"position_ids": pack.position_ids[None].to(device)}
    return pack.tokens[None].to(device), targets[None].to(device), kw


def time_step(model, batches, repeats: int, device) -> float:
    """Median seconds for forward+backward over all micro-batches of one step (after one warm-up step)."""
    def step():
        for ids, tgt, kw in batches:
            _fwd_bwd(model, ids, tgt, **kw)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    step()
    return timed(step, repeats)[0]


def gpu_part(args) -> dict:
    from rlbench.models import build_model

    device = torch.device(args.device)
    cap = args.gpu_max_len
    lengths = lognormal_lengths(args.gpu_samples, args.seed, cap=cap)
    vocab = 128 if args.preset == "tiny" else 151936
    g = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    budget = args.gpu_max_tokens
    n_mb = first_fit_count(lengths, budget)
    layouts = {
        f"padded mbs={args.gpu_mbs}": [padded_inputs(seqs, b, device) for b in padded_batches(lengths, args.gpu_mbs)],
        "packed": [packed_inputs(p, device) for p in make_step_packs(seqs, n_mb, budget, 128)],
        # flex_attention compiles per shape: pad every pack to the budget so there is one shape
        "packed fixed-T": [packed_inputs(p, device) for p in make_step_packs(seqs, n_mb, budget, budget)],
    }
    res = {"preset": args.preset, "samples": len(seqs), "real_tokens": sum(lengths), "max_tokens": budget,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or "cpu"), "runs": {}}
    for impl in args.attn:
        model = build_model(args.preset, device=device, dtype=torch.bfloat16, attn_implementation=impl)
        for name, batches in layouts.items():
            if impl == "flex_attention" and name != "packed fixed-T":
                continue  # flex compiles per shape: varying shapes would recompile every micro-batch
            torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
            sec = time_step(model, batches, args.repeats_gpu, device)
            padded = sum(int(ids.numel()) for ids, _, _ in batches)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            res["runs"][f"{impl} / {name}"] = {"seconds": sec, "micro_batches": len(batches), "tokens_processed": padded,
                                               "real_tokens_per_s": sum(lengths) / sec, "peak_mem_gib": peak}
        del model
    return res


def print_gpu(res: dict) -> None:
    print(f"\n{res['preset']} on {res['device']}: {res['samples']} samples, {res['real_tokens']} real tokens, "
          f"budget {res['max_tokens']} tokens/micro-batch")
    print(f"{'attention / layout':<36}{'mbs':>5}{'tokens':>9}{'fwd+bwd s':>11}{'real tok/s':>12}{'peak GiB':>10}")
    for name, r in res["runs"].items():
        print(f"{name:<36}{r['micro_batches']:>5}{r['tokens_processed']:>9}{r['seconds']:>11.3f}"
              f"{r['real_tokens_per_s']:>12.0f}{r['peak_mem_gib']:>10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write results JSON here")
    ap.add_argument("--samples", type=int, default=512, help="CPU part: samples in one step of one rank")
    ap.add_argument("--max-tokens", type=int, default=32768, help="CPU part: max_tokens_per_gpu")
    ap.add_argument("--padded-mbs", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--pad-multiple", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for the CPU part (0 = torch default); 16 mimics a GPU host")
    ap.add_argument("--gpu", action="store_true", help="also time forward+backward on a model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--attn", nargs="+", default=["sdpa", "flex_attention"])
    ap.add_argument("--gpu-samples", type=int, default=64)
    ap.add_argument("--gpu-max-len", type=int, default=8192)
    ap.add_argument("--gpu-max-tokens", type=int, default=16384)
    ap.add_argument("--gpu-mbs", type=int, default=4)
    ap.add_argument("--repeats-gpu", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_part(args)}
    print_cpu(results["cpu"])
    if args.gpu:
        results["gpu"] = gpu_part(args)
        print_gpu(results["gpu"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
