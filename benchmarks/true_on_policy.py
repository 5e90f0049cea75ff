"""The whole GRPO step, default numerics vs the true on-policy mode, side by side in one process.

Per preset and mode it builds a `Trainer` (colocated engine + FSDP2 trainer), runs one warm-up step (compile,
CUDA-graph capture) and `--steps` measured ones, and records the trainer's own timings (`perf/rollout_time`,
`perf/log_probs_time`, `perf/train_time`, `perf/step_time`, `perf/rollout_tokens_per_sec`) and the mismatch
it logs (`train/train_rollout_logprob_abs_diff`, `train/first_mb_kl_vs_rollout`). Modes:

- default: the run's defaults (on CUDA: the compiled engine with the shared-prompt layout, flex_attention and
  compiled layers in the trainer; the memory plan decides offload);
- true_on_policy: `true_on_policy_mode=True`, old log-probs recomputed (the diff is measured every step);
- true_on_policy_rollout_logprobs: the mode with `use_rollout_logprobs=True`: the rollout's log-probs ARE the
  recompute's bits, so the recompute forward is skipped (same training, one forward less).

Prompts are random text of `--prompt-len` characters (the presets' char tokenizer: one token each), responses
run to `--response-len` tokens; the reward is a deterministic function of the response text, so groups have
non-zero advantages and the weights change every step.

    python benchmarks/true_on_policy.py --preset qwen3-0.6b-shape qwen3-4b-shape --out benchmarks/results/x.json
    python benchmarks/true_on_policy.py --device cpu --preset tiny --prompts 2 --n 2 --prompt-len 20 \\
        --response-len 8 --steps 1                                                   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import sys
import tempfile
import time

import torch

from rlbench import Trainer, presets
from rlbench.configs import EvalConfig, LoggingConfig
from rlbench.data import write_jsonl
from rlbench.rewards import REWARDS

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # the sibling modules; appended: never shadows a package
from stored_results import COST_KEYS as KEYS  # noqa: E402  (the cost-table columns notebook 03 reads back)
from stored_results import MODES  # noqa: E402


def text_reward(response: str, label) -> float:
    """Differs between samples of a group (random models): non-zero advantages, real updates."""
    return (sum(map(ord, response)) % 7) / 6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen3-0.6b-shape"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=510)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default prompts x n: one optimizer step per rollout)")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    p.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="token budget of a packed micro-batch")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (the 4B shape needs it at 8k+)")
    p.add_argument("--matmul-configs", default=None,
                   help="JSON {small: [...], large: [...]} from `numerics.py --sweep`: the GEMM tiles to run (all "
                        "bit-identical on the H200, tests/test_numerics_gpu.py)")
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p.parse_args()


def build_config(args, preset: str, mode: str, workdir: str):
    data_path = os.path.join(workdir, "prompts.jsonl")
    rng = random.Random(0)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/="
    write_jsonl([{"prompt": "".join(rng.choice(chars) for _ in range(args.prompt_len)), "label": "0"}
                 for _ in range(4 * args.prompts)], data_path)
    base = presets.qwen3_0p6b_gpu(model=preset, workdir=workdir)
    device = args.device
    backend = dataclasses.replace(base.backend, device=device, param_dtype="bf16" if device == "cuda" else "fp32",
                                  fsdp=dataclasses.replace(base.backend.fsdp, gradient_checkpointing=args.ac))
    cfg = base.replace(
        task=None, eval=EvalConfig(), logging=LoggingConfig(console=False), backend=backend,
        data=dataclasses.replace(base.data, path=data_path, metadata_key=None, apply_chat_template=False),
        rollout=dataclasses.replace(base.rollout, rollout_batch_size=args.prompts, n_samples_per_prompt=args.n,
                                    max_response_len=args.response_len, rm_type="bench_text"),
        batch=dataclasses.replace(base.batch, global_batch_size=args.global_batch or args.prompts * args.n,
                                  num_rollout=args.steps + 1,
                                  max_tokens_per_gpu=args.max_tokens_per_gpu),
        engine=dataclasses.replace(base.engine, max_seq_len=args.prompt_len + args.response_len + 16,
                                   compile=device == "cuda"),
        true_on_policy_mode=mode != "default",
    )
    if mode == "true_on_policy_rollout_logprobs":
        cfg = cfg.replace(loss=dataclasses.replace(cfg.loss, use_rollout_logprobs=True, use_tis=False))
    return cfg


def run(args, preset: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlbench-top-") as workdir:
        t0 = time.perf_counter()
        trainer = Trainer(build_config(args, preset, mode, workdir))
        build_s = time.perf_counter() - t0
        warm = trainer.step()
        steps = [trainer.step() for _ in range(args.steps)]
    row = {"preset": preset, "mode": mode, "steps": len(steps), "build_s": build_s,
           "warmup_step_s": warm["perf/step_time"]}
    for name, key in KEYS.items():
        values = [m[key] for m in steps if key in m]
        row[name] = sum(values) / len(values) if values else None
    row["max_train_rollout_logprob_abs_diff"] = max((m.get(KEYS["train_rollout_logprob_abs_diff"], 0.0)
                                                     for m in steps), default=None)
    row["peak_memory_gb"] = max((m.get("perf/peak_memory_gb", 0.0) for m in steps), default=None)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def use_matmul_configs(path: str) -> None:
    from rlbench.numerics import triton_ops

    best = json.load(open(path))
    small, large = triton_ops.MatmulConfig(*best["small"]), triton_ops.MatmulConfig(*best["large"])
    triton_ops.MATMUL_CONFIGS = ((0, small), (1024, large))
    print("MATMUL_CONFIGS", triton_ops.MATMUL_CONFIGS, flush=True)


def main() -> None:
    args = parse_args()
    if args.matmul_configs:
        use_matmul_configs(args.matmul_configs)
    REWARDS["bench_text"] = text_reward
    rows = []
    for preset in args.preset:
        for mode in args.modes:
            row = run(args, preset, mode)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["preset"]: r for r in rows if r["mode"] == "default"}
    print(f"\n{'preset':18} {'mode':34} {'rollout tok/s':>13} {'logprob s':>9} {'train s':>8} {'step s':>8} "
          f"{'x default':>9} {'|diff|':>9}")
    for r in rows:
        ref = base.get(r["preset"])
        ratio = r["step_time_s"] / ref["step_time_s"] if ref else float("nan")
        print(f"{r['preset']:18} {r['mode']:34} {r['rollout_tokens_per_s']:13.0f} {r['logprob_time_s'] or 0:9.3f} "
              f"{r['train_time_s']:8.3f} {r['step_time_s']:8.3f} {ratio:9.3f} "
              f"{r['train_rollout_logprob_abs_diff'] if r['train_rollout_logprob_abs_diff'] is not None else '-'!s:>9}")
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device == "cuda" else "cpu"
        out = {"date": datetime.date.today().isoformat(), "machine": device, "torch": torch.__version__,
               "command": "python benchmarks/true_on_policy.py " + " ".join(sys.argv[1:]), "rows": rows}
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
