"""Run the same CLI configurations from two source trees and show that their metrics are identical.

    git worktree add /tmp/before <commit>          # or any checkout of the code before a change
    python tools/same_metrics.py --old /tmp/before --new . --out runs/same_metrics
    python tools/same_metrics.py --old /tmp/before --new . --configs grpo megatron

Each configuration is one `python -m rlbench.cli train ...` (the flags a user types, stable across refactors)
run with PYTHONPATH pointing at one tree, on the same seeds; the metric rows of its `--metrics-jsonl` are compared
key by key, exactly (a restructuring must not change one bit). Timings (`perf/*`) and wall-clock keys are left out;
so is the run directory. Prints one line per configuration and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

COMMON = ["--preset", "cpu_test", "--num-rollout", "3", "--no-console"]
CONFIGS: dict[str, list[str]] = {
    "grpo": COMMON,
    "reinforce_pp": [*COMMON, "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"],
    "megatron": [*COMMON, "--train-backend", "megatron"],
    "true_on_policy": [*COMMON, "--true-on-policy-mode"],
    "ray_dp2": [*COMMON, "--backend", "ray", "--actor-num-gpus-per-node", "2"],
    "cp2": [*COMMON, "--backend", "ray", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"],
    "demo": ["--preset", "cpu_demo", "--no-console"],  # `make run`'s configuration
}
SKIPPED_PREFIXES = ("perf/", "time/")


def run(tree: str, name: str, out_dir: str) -> list[dict]:
    """The metric rows of configuration `name` run from source tree `tree`."""
    path = os.path.join(out_dir, f"{name}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, "-m", "rlbench.cli", "train", *CONFIGS[name], "--metrics-jsonl", path]
    done = subprocess.run(cmd, cwd=os.path.abspath(tree), env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} from {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def differences(old: list[dict], new: list[dict]) -> list[str]:
    """Every (row, key) whose value differs, timings excluded."""
    if len(old) != len(new):
        return [f"{len(old)} rows vs {len(new)}"]
    out = []
    for i, (a, b) in enumerate(zip(old, new)):
        keys = {k for k in (*a, *b) if not k.startswith(SKIPPED_PREFIXES)}
        out += [f"row {i} {k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(keys) if a.get(k) != b.get(k)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="source tree before the change")
    ap.add_argument("--new", default=".", help="source tree after the change")
    ap.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c != "demo"], choices=sorted(CONFIGS))
    ap.add_argument("--out", default="runs/same_metrics")
    args = ap.parse_args(argv)
    failed = 0
    for name in args.configs:
        rows = {}
        for side, tree in (("old", args.old), ("new", args.new)):
            out_dir = os.path.abspath(os.path.join(args.out, side))
            os.makedirs(out_dir, exist_ok=True)
            rows[side] = run(tree, name, out_dir)
        diff = differences(rows["old"], rows["new"])
        keys = len({k for r in rows["new"] for k in r if not k.startswith(SKIPPED_PREFIXES)})
        print(f"{name:15s} {'IDENTICAL' if not diff else 'DIFFERENT'}: {len(rows['new'])} steps x {keys} metrics"
              + ("" if not diff else "\n  " + "\n  ".join(diff[:10])), flush=True)
        failed += bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
