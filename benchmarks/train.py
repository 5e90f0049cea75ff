"""FSDP2 training-step benchmark: fwd + bwd + optimizer step on packed micro-batches.

Reports tokens/s/GPU, MFU = (6 * N_params * tokens + attention FLOPs) / step_time / peak_flops, peak
memory, the old-log-prob (forward only) time, and sleep / wake_up times with the bytes they free.
Warm-up steps (compilation with `--compile`) are reported apart from the steady state: `first_train_s`,
`first_logprob_s`, `warmup_total_s`, and dynamo's `dynamo_unique_graphs` / `dynamo_compile_s` (a graph
count that grows with the layer count means per-layer recompiles).

    python benchmarks/train.py --preset qwen3-0.6b-shape --attn flex_attention          # 1 GPU
    torchrun --nproc_per_node 2 benchmarks/train.py --preset qwen3-4b-shape --attn flex_attention
    python benchmarks/train.py --device cpu --preset tiny --tokens-per-gpu 256 --seq-len 64 --attn sdpa   # smoke

Every rank gets `--tokens-per-gpu` tokens per step, packed from sequences of `--seq-len` tokens
(or random lengths with `--random-lengths`), in `--micro-batches` packs (gradient accumulation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from rlbench.backends.attention import document_block_mask
from rlbench.backends.fsdp.actor import FSDPBackend
from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig
from rlbench.packing.pack import pack_samples
from rlbench.trainer import PEAK_FLOPS
from rlbench.types import Sample

_COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")  # dynamo+forward, lazy backward compile
CPU_PEAK_FLOPS = 1e12  # nominal: a CPU smoke run prints a number, not an MFU


def peak_flops(device: str) -> float | None:
    """The MFU denominator: the GPU's dense bf16 peak from `rlbench.trainer.PEAK_FLOPS` (the one convention of
    every MFU number: 989 TFLOP/s on H100 / H200), None for a GPU not listed there."""
    if device == "cpu":
        return CPU_PEAK_FLOPS
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b-shape")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--attn", default="flex_attention", choices=["sdpa", "flex_attention", "eager", "flash_attention_2"])
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--random-lengths", action="store_true", help="lengths uniform in [seq_len/8, 2*seq_len]")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--no-ac", action="store_true", help="disable activation checkpointing")
    p.add_argument("--ac-every", type=int, default=1, help="checkpoint every k-th layer (1 = all)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--param-dtype", default="bf16")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-invariant", action="store_true",
                   help="the true on-policy mode's batch-invariant layers (rlbench.numerics; eager)")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one more step (torch.profiler)")
    p.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    return p.parse_args()


def seq_lengths(total: int, seq_len: int, random_lengths: bool, rng: random.Random) -> list[int]:
    if not random_lengths:
        return [seq_len] * (total // seq_len) + ([total % seq_len] if total % seq_len >= 2 else [])
    out: list[int] = []
    while sum(out) < total:
        out.append(min(rng.randint(max(2, seq_len // 8), 2 * seq_len), total - sum(out)))
    return [n for n in out if n >= 2]


def make_step(args, vocab: int, rank: int, step: int) -> tuple[list, list]:
    """This rank's packs and loss inputs: response = last 3/4 of each sequence, token-mean weights."""
    rng = random.Random(1000 * step + rank)
    lengths = seq_lengths(args.tokens_per_gpu, args.seq_len, args.random_lengths, rng)
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    samples = [
        Sample(tokens=torch.randint(0, vocab, (n,), generator=g).tolist(), response_length=max(1, 3 * n // 4))
        for n in lengths
    ]
    ids = list(range(len(samples)))
    groups = [ids[k :: args.micro_batches] for k in range(args.micro_batches)]
    n_tokens = sum(s.response_length for s in samples) * int(os.environ.get("WORLD_SIZE", "1"))
    packs = [pack_samples(samples, grp, pad_multiple=128) for grp in groups]
    inputs = [{"w": torch.full((int(p.response_index.numel()),), 1.0 / n_tokens)} for p in packs]
    return packs, inputs


def loss_fn(logp, entropy, inputs):
    loss = -(inputs["w"] * logp).sum()
    return loss, {}


def model_flops(backend: FSDPBackend, packs: list) -> tuple[float, int]:
    """6 * N * tokens + causal attention (fwd+bwd: 3 x 2 matmuls x 2 FLOPs x H x d x len^2 / 2 per layer)."""
    c = backend.hf_config
    n_params = sum(p.numel() for p in backend.model.parameters())  # tied embedding counted once
    tokens = sum(p.num_tokens for p in packs)
    sq = sum(int((p.seq_lengths.double() ** 2).sum()) for p in packs)
    head_dim = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    attn = 6.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * sq
    return 6.0 * n_params * tokens + attn, n_params


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_step(backend: FSDPBackend, packs: list, inputs: list, device: str) -> tuple[float, float, dict]:
    """(no-grad log-prob seconds, train-step seconds, train metrics) of one step."""
    sync(device)
    t = time.perf_counter()
    backend.compute_log_prob(packs)
    sync(device)
    t_fwd = time.perf_counter()
    metrics = backend.train(packs, inputs)
    sync(device)
    return t_fwd - t, time.perf_counter() - t_fwd, metrics


def profile_step(backend: FSDPBackend, packs: list, inputs: list, device: str) -> None:
    """The kernels of one log-prob pass + train step, by total device time (where a step's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_step(backend, packs, inputs, device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)


def mask_build_s(packs: list, device: str) -> float:
    """Seconds to build the document BlockMask of the first pack (flex only; includes no compile)."""
    sync(device)
    t = time.perf_counter()
    document_block_mask(packs[0].position_ids.to(device))
    sync(device)
    return time.perf_counter() - t


def compile_report(warm: list[tuple[float, float]]) -> dict:
    """Warm-up (compile) time apart from steady state, and dynamo's graph / compile counts."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "first_train_s": warm[0][0] if warm else None, "first_logprob_s": warm[0][1] if warm else None,
        "warmup_total_s": sum(a + b for a, b in warm), "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
        "dynamo_graph_breaks": int(sum(counters["graph_break"].values())),
        "dynamo_compile_s": sum(sum(compilation_time_metrics.get(k, [])) for k in _COMPILE_KEYS),
    }


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg = TrainConfig(model=args.preset, device=args.device, param_dtype=args.param_dtype, batch_invariant=args.batch_invariant, optim=OptimConfig(lr=1e-6), fsdp=FSDPOptions(attn_implementation=args.attn, gradient_checkpointing=not args.no_ac, checkpoint_every=args.ac_every, compile=args.compile, cpu_offload=args.cpu_offload))
    backend = FSDPBackend(cfg, loss_fn=loss_fn)
    t0 = time.perf_counter()
    backend.init()
    init_time = time.perf_counter() - t0
    env, vocab = backend.env, backend.hf_config.vocab_size
    times, fwd_times, warm, metrics = [], [], [], {}
    for step in range(args.warmup + args.steps):
        packs, inputs = make_step(args, vocab, env.rank, step)
        t_fwd, t_train, metrics = timed_step(backend, packs, inputs, args.device)
        (times if step >= args.warmup else warm).append((t_train, t_fwd))
        if env.is_main:
            print(f"step {step}: train {t_train:.3f}s  logprob {t_fwd:.3f}s  loss {metrics['train/loss']:.4f}", flush=True)
    times, fwd_times = [t for t, _ in times], [f for _, f in times]
    flops, n_params = model_flops(backend, packs)
    step_time = sum(times) / len(times)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    peak_reserved = torch.cuda.max_memory_reserved() if args.device == "cuda" else 0
    cold_sleep, cold_wake = backend.sleep(), backend.wake_up()  # first call also pins the host buffers
    sleep = backend.sleep()
    after_sleep = torch.cuda.memory_allocated() if args.device == "cuda" else 0
    wake = backend.wake_up()
    again = backend.train(*make_step(args, vocab, env.rank, 999))
    if args.profile and env.is_main:
        profile_step(backend, *make_step(args, vocab, env.rank, 1000), args.device)
    result = compile_report(warm) | {
        "preset": args.preset, "attn": args.attn, "world_size": env.world_size, "ac": not args.no_ac, "ac_every": args.ac_every,
        "compile": args.compile, "batch_invariant": args.batch_invariant, "micro_batches": args.micro_batches, "tokens_per_gpu": sum(p.num_tokens for p in packs),
        "seq_len": args.seq_len, "random_lengths": args.random_lengths, "n_params": n_params,
        "step_time_s": step_time, "logprob_time_s": sum(fwd_times) / len(fwd_times),
        "tokens_per_s_per_gpu": sum(p.num_tokens for p in packs) / step_time,
        "mfu": flops / step_time / peak_f if (peak_f := peak_flops(args.device)) else None, "mfu_peak_flops": peak_f,
        "peak_mem_gib": peak / 2**30, "peak_reserved_gib": peak_reserved / 2**30,
        "sleep_cold_s": cold_sleep["perf/sleep_time"], "wake_up_cold_s": cold_wake["perf/wake_up_time"],
        "sleep_s": sleep["perf/sleep_time"], "sleep_freed_gib": sleep["memory/freed_bytes"] / 2**30,
        "allocated_after_sleep_gib": after_sleep / 2**30, "wake_up_s": wake["perf/wake_up_time"],
        "step_after_wake_finite": again["train/skipped"] == 0.0, "init_s": init_time,
        "mask_build_s": mask_build_s(packs, args.device) if args.attn == "flex_attention" else None,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    if env.is_main:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
