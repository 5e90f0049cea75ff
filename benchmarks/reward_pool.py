"""Reward scoring inline after generation vs in worker processes during it (`RolloutConfig.reward_workers`).

A GPU engine leaves the host CPU idle while it decodes, and samples stop at different steps. This benchmark
stands in for such an engine: `generate` takes `--gen-s` seconds of wall time (sleeping, like a host waiting
on the GPU) and reports the samples through `on_finish` spread evenly over that time. The rewards are real:
`math` (math_verify) on answers that miss its integer fast path (fractions, decimals, expressions), through
`RolloutManager` exactly as the Trainer runs it.

    python benchmarks/reward_pool.py --samples 256 --gen-s 1.0 --workers 0 2

Prints, per worker count, the rollout's wall time, the time spent waiting for rewards after generation
(`perf/reward_wait_time`) and the rewards' checksum (identical across worker counts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from rlbench.configs import RolloutConfig
from rlbench.data import build_tokenizer
from rlbench.engine.protocol import Generation
from rlbench.rollout.manager import RolloutManager


class Item:
    def __init__(self, prompt_ids, label):
        self.prompt_token_ids, self.prompt, self.label, self.metadata = prompt_ids, "p", label, {}


class Prompts:
    """`next_batch(n)`: prompts whose labels are fractions, decimals and small expressions."""

    def __init__(self, tok, seed=0):
        self.tok, self.rng = tok, random.Random(seed)

    def next_batch(self, n):
        items = []
        for _ in range(n):
            a, b = self.rng.randint(1, 9), self.rng.randint(2, 9)
            items.append(Item(self.tok("q", add_special_tokens=False)["input_ids"], f"\\frac{{{a}}}{{{b}}}"))
        return items


class PacedEngine:
    """Answers every prompt, right or wrong at random, and reports the samples over `gen_s` seconds."""

    weight_version = 0

    def __init__(self, tok, gen_s: float, seed=0):
        self.tok, self.gen_s, self.rng = tok, gen_s, random.Random(seed)

    def generate(self, prompts, sampling, seeds=None, on_finish=None):
        forms = ["\\boxed{{\\frac{{{a}}}{{{b}}}}}", "\\boxed{{{a}/{b}}}", "\\boxed{{{q:.4f}}}", "\\boxed{{\\dfrac{{{a}}}{{{b}}}}}"]
        out = []
        for i in range(len(prompts)):
            for j in range(sampling.n):
                a, b = self.rng.randint(1, 9), self.rng.randint(2, 9)
                text = "so the answer is " + self.rng.choice(forms).format(a=a, b=b, q=a / b)
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                out.append(Generation(i, ids, [-0.1] * len(ids), "stop", 0, j))
        start = time.perf_counter()
        for k, g in enumerate(out):  # the k-th sample stops at (k + 1) / N of the generation time
            time.sleep(max(0.0, start + self.gen_s * (k + 1) / len(out) - time.perf_counter()))
            if on_finish is not None:
                on_finish(g)
        return out


def run(workers: int, args, tok) -> dict:
    prompts = args.samples // args.n
    cfg = RolloutConfig(rollout_batch_size=prompts, n_samples_per_prompt=args.n, rm_type="math")
    manager = RolloutManager(cfg, PacedEngine(tok, args.gen_s), Prompts(tok), tok, reward_workers=workers)
    manager.generate(0)  # warm-up: math_verify's first call imports sympy (in each worker too)
    times, waits, sums = [], [], []
    for r in range(args.repeats):
        manager.engine.rng = random.Random(r)
        batch = manager.generate(r + 1)
        times.append(batch.metrics["perf/rollout_time"])
        waits.append(batch.metrics["perf/reward_wait_time"])
        sums.append(sum(s.reward for s in batch.samples))
    if manager.reward_pool is not None:
        manager.reward_pool.close()
    return {"workers": workers, "rollout_s": min(times), "reward_wait_s": min(waits), "reward_sums": sums}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--gen-s", type=float, default=1.0, help="the stand-in engine's generation time per rollout")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tok = build_tokenizer()
    rows = [run(w, args, tok) for w in args.workers]
    for row in rows:
        print(f"workers {row['workers']}: rollout {row['rollout_s']:.3f} s (generation {args.gen_s:.3f} s), waiting "
              f"for rewards after it {row['reward_wait_s']:.3f} s; reward sums {row['reward_sums']}", flush=True)
    result = {"samples": args.samples, "n": args.n, "gen_s": args.gen_s, "cpus": os.cpu_count(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
