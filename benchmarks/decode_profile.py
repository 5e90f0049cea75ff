"""Where the batch-1 decode step's time goes: step time (graph replay) vs the HBM floor, and the kernel table.

    python benchmarks/decode_profile.py --preset qwen3-0.6b-shape --kv 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import profile_step, weight_bytes  # noqa: E402

from rlbench.models import build_model  # noqa: E402
from rlbench.rollout.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402


def step_ms(engine: TorchEngine, b: int, kv: int, mode: str, steps: int = 200) -> float:
    runner = engine.runner
    for _ in range(3):
        runner.decode(b, kv, mode)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.decode(b, kv, mode)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--kv", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batch", type=int, nargs="+", default=[2])
    ap.add_argument("--max-seq-len", type=int, default=1536)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model = build_model(args.preset, device="cuda", dtype=torch.bfloat16)
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=args.max_seq_len, num_slots=max(args.batch)))
    floor = weight_bytes(model) / 4.3e12 * 1e3
    print(f"{args.preset}: weights {weight_bytes(model) / 2**30:.2f} GiB, floor {floor:.3f} ms")
    for b in args.batch:
        for kv in args.kv:
            for mode in ("greedy", "sample"):
                t0 = time.perf_counter()
                ms = step_ms(engine, b, kv, mode)
                print(f"batch {b} kv {kv} {mode}: {ms:.3f} ms/step ({ms / floor:.2f}x floor); "
                      f"first use + 200 steps {time.perf_counter() - t0:.1f} s", flush=True)
            if args.profile:
                print(profile_step(engine, b, kv), flush=True)


if __name__ == "__main__":
    main()
