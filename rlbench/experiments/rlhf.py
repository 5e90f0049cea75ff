"""RLHF on the synthetic preference task, CPU-sized: a verbose SFT warm start, a reward model trained on the hidden
rule's preferences, then RL against the RM (GRPO, or PPO with a critic and an adaptive KL-in-reward controller),
with the hidden-rule score measured beside the RM's on held-out prompts.

    model = warm_start("runs/rlhf/sft")                   # tiny, 1-digit addition, half the solutions written long
    rm, rm_metrics = train_reward_model("runs/rlhf/rm")   # 800 pairs, 1 epoch: held-out pair accuracy ~0.95
    trainer = Trainer(run_config(model, rm, "runs/rlhf/grpo", estimator="grpo", reward="rm"))
    trainer.fit()
    hidden_parts(trainer.eval_history[-1])                # {"hidden": ..., "short": ..., "correct": ...}

    rlbench experiment rlhf --seeds 0 1 2 --out benchmarks/results/rlhf_<date>.json

Why a verbose warm start: the short-form warm start of the other CPU tests (tests/conftest.py `sft_dir`) answers in
the short form ~82 % of the time already, so the part of the hidden rule an RM learns from these preferences (the
form) has little room, and the part it learns poorly (the arithmetic) is where RL against it drifts
(docs/log/2026-12.md, seventh session). Written long half the time, the warm start leaves the form for the RM to
teach, as in RLHF for a style preference.

The run's rule reward (`rollout.rm_type`) is the hidden rule itself, so it is logged (`rollout/rule_reward`) and
evaluated (`eval/reward`) but trains nothing unless `reward` weighs it; the training reward is the RM's score
(`reward="rm"`) or the RM plus the verifiable math reward (`reward="rm+math"`, as RLHF runs mix a rule reward in).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping

import torch

from rlbench import presets
from rlbench.configs import CriticConfig, LossConfig
from rlbench.configs.backend import OptimConfig
from rlbench.configs.reward_model import RMTrainConfig
from rlbench.configs.run import RunConfig

HIDDEN_RULE = "rlbench.data.preferences:hidden_rule_score"
"""The hidden rule as a `module:function` reward (the run's `rm_type`)."""
REWARDS = {"rm": {"rm": 1.0}, "rm+math": {"rm": 1.0, "math": 1.0}}
"""`reward` name -> `rollout.reward_weights`."""
ESTIMATORS = ("grpo", "ppo")
MAX_RESPONSE_LEN = 28
"""Tokens per response: the longest long form (`"The answer is \\\\boxed{18}"`, 24 characters + eos) fits."""
LONG_FORM_SHARE = 0.5
"""Share of the warm start's SFT solutions written long."""


def warm_start(out: str, *, long_form_share: float = LONG_FORM_SHARE, seed: int = 0) -> str:
    """The verbose SFT warm start in `out` (reused when a finished one is there): the `tiny` preset on 1-digit
    addition, `long_form_share` of the solutions written long, stopped at sampled pass@1 >= 0.3 (~240 steps,
    ~12 s of one core). Returns the HF directory."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from rlbench.sft import SFTConfig, run_sft

    run_sft(SFTConfig(preset="tiny", task="arithmetic", task_kwargs={"level": 1}, out=out, batch_size=32,
                      eval_every=20, num_eval=32, max_steps=600, target_pass_at_1=0.3, num_threads=1,
                      max_new_tokens=MAX_RESPONSE_LEN, long_form_share=long_form_share, seed=seed))
    return out


def train_reward_model(out: str, *, n_pairs: int = 800, seed: int = 0) -> tuple[str, dict]:
    """`rlbench rm` on `n_pairs` synthetic preferences (level 1, 10 % of the pairs differing only in the answer):
    the `tiny` preset from random init, 1 epoch, lr 1e-3, one thread (~10 s). Writes `out/../prefs.jsonl` and the
    RM directory `out`. Returns `(out, metrics)` (`rm/eval_accuracy` on a held-out tenth)."""
    from rlbench.data.preferences import make_arithmetic_preferences
    from rlbench.data.tasks import write_jsonl
    from rlbench.reward_model.train import run_rm

    data = os.path.join(os.path.dirname(os.path.abspath(out)), "prefs.jsonl")
    write_jsonl(make_arithmetic_preferences(n_pairs, level=1, seed=seed), data)
    metrics = run_rm(RMTrainConfig(data=data, model="tiny", out=out, lr=1e-3, num_threads=1, seed=seed))
    return out, metrics


def run_config(model: str, reward_model: str, workdir: str, *, estimator: str = "grpo", reward: str = "rm",
               seed: int = 0, steps: int = 20, eval_interval: int | None = None, lr: float = 2e-4,
               kl_target: float = 0.1, kl_horizon: float = 10000.0) -> RunConfig:
    """The RL run: `presets.cpu_test` on level-1 addition, 16 prompts x 8 samples per rollout, 64 samples per
    optimizer step, lr `lr`; eval on 32 held-out prompts x 8 samples every `eval_interval` rollouts (default
    `steps`: at the start and the end).

    Args:
        estimator: "grpo" (group baseline, no KL) or "ppo" (a critic: GAE with λ 0.95, whitened advantages,
            KL-in-reward against the warm start with the adaptive controller from β 0.05 towards `kl_target`;
            β moves by at most a factor 1 ± 0.2 x 128 / `kl_horizon` per rollout, verl's 10000: ~0.3 %).
        reward: "rm" (the RM's score alone) or "rm+math" (plus the math reward, weight 1 each).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} must be one of {ESTIMATORS}")
    if reward not in REWARDS:
        raise ValueError(f"reward={reward!r} must be one of {sorted(REWARDS)}")
    cfg = presets.cpu_test(model=model, workdir=workdir, level=1, seed=seed, n_eval=32)
    backend = dataclasses.replace(cfg.backend, optim=OptimConfig(lr=lr, betas=(0.9, 0.98)))
    if estimator == "ppo":
        loss = LossConfig(advantage_estimator="gae", normalize_advantages=True, lambd=0.95, kl_coef=0.05,
                          kl_ctl_type="adaptive", kl_target=kl_target, kl_horizon=kl_horizon)
        backend = dataclasses.replace(backend, critic=CriticConfig(lr=1e-3), ref_model=model)
    else:
        loss = LossConfig(advantage_estimator="grpo")
    return cfg.replace(
        engine=dataclasses.replace(cfg.engine, max_seq_len=24 + MAX_RESPONSE_LEN),  # level-1 prompts: 24 tokens
        data=dataclasses.replace(cfg.data, metadata_key=None),  # the rows' rm_type "math" would replace the rule
        rollout=dataclasses.replace(cfg.rollout, rollout_batch_size=16, rm_type=HIDDEN_RULE,
                                    max_response_len=MAX_RESPONSE_LEN, reward_model=reward_model,
                                    reward_weights=REWARDS[reward]),
        batch=dataclasses.replace(cfg.batch, global_batch_size=64, num_rollout=steps),
        loss=loss, backend=backend,
        eval=dataclasses.replace(cfg.eval, interval=eval_interval or steps, n_samples_per_prompt=8, pass_k=(1,),
                                 max_response_len=MAX_RESPONSE_LEN),
    )


def hidden_parts(eval_metrics: Mapping[str, float]) -> dict[str, float]:
    """The held-out hidden-rule score and its two parts, from one `eval/*` record of a `run_config` run.

    `eval/reward` is the mean hidden score (short form + 0.5 x correct); `eval/pass@1` counts samples with
    reward >= 1, which under this rule are exactly the short-form ones; so the correct share (the arithmetic,
    any form) is 2 x (reward - short)."""
    hidden, short = float(eval_metrics["eval/reward"]), float(eval_metrics["eval/pass@1"])
    return {"hidden": hidden, "short": short, "correct": round(2 * (hidden - short), 12)}


STEP_KEYS = ("rollout/rule_reward", "rollout/rm_score", "rollout/raw_reward", "rollout/kl_coef", "rollout/reward_kl",
             "critic/vf_loss", "train/ppo_kl", "train/grad_norm")
"""The per-step metrics a stored run keeps."""


def run(model: str, reward_model: str, workdir: str, **kwargs) -> dict:
    """One `run_config` run: `{"steps": [per-step STEP_KEYS], "evals": [rollout id + hidden_parts], "time_s"}`."""
    from rlbench import Trainer

    start = time.perf_counter()
    trainer = Trainer(run_config(model, reward_model, workdir, **kwargs))
    try:
        history = trainer.fit()
        evals = [{"rollout/id": e["rollout/id"]} | hidden_parts(e) for e in trainer.eval_history]
    finally:
        trainer.close()
    steps = [{k: h[k] for k in STEP_KEYS if k in h} for h in history]
    return {"steps": steps, "evals": evals, "time_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    """`rlbench experiment rlhf`: the warm start, the RM, then each (estimator, reward) for each seed; the JSON
    notebook 05 reads."""
    p = argparse.ArgumentParser(prog="rlbench experiment rlhf", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--runs", nargs="+", default=["grpo:rm", "ppo:rm", "grpo:rm+math", "ppo:rm+math"],
                   help="estimator:reward pairs")
    p.add_argument("--workdir", default=None, help="where the warm start and the RM go (reused when there)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="the JSON to write (default: print only)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = a.workdir or tempfile.mkdtemp(prefix="rlbench-rlhf-")
    model = warm_start(os.path.join(work, "sft"))
    rm_dir = os.path.join(work, "rm")
    if os.path.isfile(os.path.join(rm_dir, "rm_metrics.json")):
        with open(os.path.join(rm_dir, "rm_metrics.json")) as f:
            rm_metrics = json.load(f)
    else:
        rm_dir, rm_metrics = train_reward_model(rm_dir)
    result = {"what": "RL against a reward model trained on the hidden rule's preferences; held-out hidden-rule "
                      "score (short form + 0.5 x correct) before and after",
              "provenance": {"command": "rlbench experiment rlhf " + " ".join(argv or sys.argv[1:]),
                             "date": datetime.date.today().isoformat(), "machine": platform.node(),
                             "torch": torch.__version__, "threads": a.threads},
              "rm": {k: v for k, v in rm_metrics.items() if k.startswith("rm/")}, "runs": {}}
    for spec in a.runs:
        estimator, reward = spec.split(":")
        for seed in a.seeds:
            out = run(model, rm_dir, os.path.join(work, f"{estimator}-{reward}-{seed}"), estimator=estimator,
                      reward=reward, seed=seed, steps=a.steps, eval_interval=a.eval_interval)
            result["runs"].setdefault(spec, {})[str(seed)] = out
            first, last = out["evals"][0], out["evals"][-1]
            print(f"{spec} seed {seed}: hidden {first['hidden']:.3f} -> {last['hidden']:.3f}, short "
                  f"{first['short']:.3f} -> {last['short']:.3f}, correct {first['correct']:.3f} -> "
                  f"{last['correct']:.3f}, rm {out['steps'][0]['rollout/rm_score']:.3f} -> "
                  f"{out['steps'][-1]['rollout/rm_score']:.3f} ({out['time_s']:.0f} s)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
