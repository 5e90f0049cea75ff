"""rlbench on Ray: weight-sync time per mode, RL step time, and the async speed-up over a synchronous run.

Three runs on the same 2 GPUs (one `ray.init`), each `--steps` RL steps of the Qwen3-0.6B shape:
    colocated      2 trainer ranks (FSDP2, NCCL) + 2 engines sharing GPUs 0 and 1; CUDA IPC weight sync; offload
    disagg-sync    1 trainer rank on GPU 0 + 1 engine on GPU 1; NCCL broadcast weight sync
    disagg-async   the same, one-step off-policy (generation of rollout r+1 overlaps training on r)
Reported per run (median over steps after `--warmup`): step time, weight-sync time (driver wall and rank-0 send),
bytes synced, rollout and train time; then async speed-up = disagg-sync step / disagg-async step.

    python benchmarks/ray_gpu.py                                   # 2x H200, ~5 min
    python benchmarks/ray_gpu.py --device cpu --preset tiny --steps 3 --warmup 1   # CPU smoke (2 CPU "GPUs")

Random weights (the model is a preset shape) and a cheap reward (fraction of digits in the response): the work per
step is what a real run does. `--json FILE` appends one line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

MODES = {
    "colocated": dict(actor_num_gpus_per_node=2, colocate=True),
    "disagg-sync": dict(actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1),
    "disagg-async": dict(actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1, async_rollout=True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b-shape")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (compile, graph capture)")
    p.add_argument("--rollout-batch-size", type=int, default=32)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    p.add_argument("--workdir", default="runs/bench-ray")
    p.add_argument("--json", default=None, help="append one JSON line per run to this file")
    return p.parse_args()


def digit_reward(response: str, label) -> float:
    """A cheap reward that varies on random-weight samples (math_verify is not needed on the GPU machine)."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def run_config(args):
    """The RunConfig of every mode (only the cluster differs)."""
    from rlbench import presets
    from rlbench.configs import EvalConfig, WeightSyncConfig
    from rlbench.metrics import LoggingConfig
    from rlbench.rewards import REWARDS

    REWARDS["bench_digits"] = digit_reward

    cpu = args.device == "cpu"
    cfg = presets.cpu_test(model=args.preset, workdir=args.workdir) if cpu else \
        presets.qwen3_0p6b_gpu(model=args.preset, workdir=args.workdir, num_rollout=args.steps)
    return cfg.replace(
        data=replace(cfg.data, metadata_key=None),  # per-row rm_type "math" would override the cheap reward
        rollout=replace(cfg.rollout, rollout_batch_size=args.rollout_batch_size, rm_type="bench_digits",
                        n_samples_per_prompt=args.n_samples_per_prompt, max_response_len=args.max_response_len),
        batch=replace(cfg.batch, global_batch_size=args.global_batch_size, num_rollout=args.steps, balance_data=True),
        engine=replace(cfg.engine, max_seq_len=64 + args.max_response_len, compile=False,
                       num_slots=args.rollout_batch_size * args.n_samples_per_prompt),
        weights=WeightSyncConfig(bucket_bytes=args.bucket_mb << 20, dtype=None if cpu else "bfloat16"),
        eval=EvalConfig(), logging=LoggingConfig(console=False),
    )


def median(history: list[dict], key: str, warmup: int) -> float:
    values = [h[key] for h in history[warmup:] if key in h]
    return statistics.median(values) if values else float("nan")


def bench_mode(mode: str, args) -> dict:
    from rlbench.configs.cluster import ClusterConfig
    from rlbench.orchestration.ray_trainer import RayTrainer

    start = time.perf_counter()
    trainer = RayTrainer(run_config(args), cluster=ClusterConfig(backend="ray", timeout_s=900, **MODES[mode]))
    build = time.perf_counter() - start
    try:
        history = trainer.fit(args.steps)
        # Outside the timed steps: push once more and compare bit checksums on every engine (IPC / NCCL path).
        verified = trainer.cluster.sync_weights(trainer.version, verify=True).get("weights/verified", 0.0)
    finally:
        trainer.close()
    w = args.warmup
    return {
        "mode": mode, "device": args.device, "preset": args.preset, "steps": args.steps, "warmup": w,
        "build_s": build,
        "step_s": median(history, "perf/step_time", w),
        "rollout_s": median(history, "perf/rollout_time", w),
        "train_s": median(history, "perf/train_time", w),
        "log_probs_s": median(history, "perf/log_probs_time", w),
        "sync_s": median(history, "perf/update_weights_time", w),
        "sync_send_s": median(history, "perf/update_weights_send_time", w),
        "sync_gb": median(history, "weights/bytes", w) / 1e9,
        "buckets": median(history, "weights/num_buckets", w),
        "staleness": median(history, "rollout/staleness_max", w),
        "peak_gb": median(history, "perf/peak_memory_gb", w),
        "tokens_per_s": median(history, "perf/tokens_per_sec", w),
        "verified": verified,
    }


def main() -> None:
    args = parse_args()
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(8, os.cpu_count() or 8), include_dashboard=False)
    rows = [bench_mode(mode, args) for mode in args.modes.split(",")]
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    cols = ["mode", "step_s", "rollout_s", "train_s", "sync_s", "sync_send_s", "sync_gb", "buckets", "staleness", "peak_gb", "verified", "build_s"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    by = {r["mode"]: r for r in rows}
    if "disagg-sync" in by and "disagg-async" in by:
        print(f"async speed-up over sync (disaggregated, step time): {by['disagg-sync']['step_s'] / by['disagg-async']['step_s']:.2f}x")


if __name__ == "__main__":
    main()
