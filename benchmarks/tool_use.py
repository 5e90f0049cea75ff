"""Learning to use a calculator (CPU): held-out success with the tool over GRPO steps, beside the same model without it.

    python benchmarks/tool_use.py --seeds 0 1 2 --steps 20 --out runs/tool-use

One warm start (`rlbench.rollout.multiturn.warm_start`: the `tiny` preset on 2-digit +/- arithmetic, level 3, half of
the transcripts calling the calculator, half answering directly), then per seed two GRPO runs from it with the multi-turn
generate function: with the calculator, and without it (`multiturn.tools=()`: every call is answered with an
unknown-tool error). Held-out success is `eval/pass@1` on the task's eval split every `--eval-every` steps. Prints
one table per seed and writes `results.json` under `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from rlbench import Trainer, presets
from rlbench.configs import EvalConfig
from rlbench.configs.multiturn import MultiTurnConfig
from rlbench.rollout.multiturn.warm_start import ToolSFTConfig, tool_warm_start

MULTITURN = "rlbench.rollout.multiturn:generate"


LEVEL = 3
WARM_START = dict(preset="tiny", level=LEVEL, tool_fraction=0.5, batch_size=32, lr=3e-3)
"""The warm start: tiny learns the call format in a few hundred steps; direct answers stay almost always wrong."""


def warm_start(out: str, steps: int) -> str:
    """The warm start's HF directory (trained once into `out`)."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    return tool_warm_start(ToolSFTConfig(**WARM_START, steps=steps, out=out))


def run_config(model: str, workdir: str, seed: int, *, tools: bool, steps: int, eval_every: int, n_eval: int):
    """GRPO on the warm start's arithmetic level with the multi-turn generate function (calculator on or off)."""
    cfg = presets.cpu_test(model=model, workdir=workdir, level=LEVEL, seed=seed, n_eval=n_eval)
    return cfg.replace(
        backend=dataclasses.replace(cfg.backend, optim=dataclasses.replace(cfg.backend.optim, lr=5e-4)),
        rollout=dataclasses.replace(cfg.rollout, max_response_len=160, custom_generate_function_path=MULTITURN,
                                    multiturn=MultiTurnConfig(tools=("calculator",) if tools else (), max_turns=3)),
        engine=dataclasses.replace(cfg.engine, max_seq_len=224),
        batch=dataclasses.replace(cfg.batch, num_rollout=steps, max_tokens_per_gpu=4096),
        eval=EvalConfig(interval=eval_every, max_prompts=n_eval, n_samples_per_prompt=2, pass_k=(1,), temperature=1.0),
    )


def curve(cfg) -> dict:
    """Train; returns held-out pass@1 per eval step and the tool-call rate of the last rollout."""
    trainer = Trainer(cfg)
    start = time.perf_counter()
    trainer.fit()
    calls = [len(s.metadata["tool_calls"]) > 0 for s in trainer.last_rollout.samples]
    out = {"steps": [int(e["rollout/id"]) for e in trainer.eval_history],
           "pass@1": [e["eval/pass@1"] for e in trainer.eval_history],
           "last_rollout_call_rate": sum(calls) / len(calls), "seconds": time.perf_counter() - start}
    trainer.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=None, help="torch threads (None: the default)")
    p.add_argument("--out", default="runs/tool-use")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = warm_start(os.path.join(a.out, "warm-start"), a.sft_steps)
    results = {}
    for seed in a.seeds:
        for tools in (True, False):
            name = f"seed{seed}-{'tool' if tools else 'no-tool'}"
            cfg = run_config(model, os.path.join(a.out, name), seed, tools=tools, steps=a.steps,
                             eval_every=a.eval_every, n_eval=a.n_eval)
            results[name] = curve(cfg)
            r = results[name]
            print(f"{name:16s} pass@1 " + " ".join(f"{s}:{v:.3f}" for s, v in zip(r["steps"], r["pass@1"]))
                  + f"  call rate {r['last_rollout_call_rate']:.2f}  {r['seconds']:.0f} s", flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
