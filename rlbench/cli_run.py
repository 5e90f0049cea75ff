"""What `rlbench train|demo|bench` run once the config is built: the cached SFT warm starts, the training loop
with its progress bar and console lines, and the run's summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import os

WARM_STARTS = {"cpu_demo": "cpu", "cpu_test": "cpu", "cuda_demo": "cuda"}
"""Presets that start from a demo SFT warm start when no --hf-checkpoint is given: preset -> its device key in
`presets.DEMO_SFTS` (`presets.demo_warm_start(device=...)`, built once into the cache)."""


def ensure_sft(args: argparse.Namespace) -> str:
    """The SFT warm start of `args.preset` (`WARM_STARTS`: `presets.demo_warm_start` on its device) in `--sft-dir`
    or the cache, built when missing."""
    from rlbench.presets import demo_sft_dir, demo_warm_start

    device = WARM_STARTS[args.preset]
    out = args.sft_dir or demo_sft_dir(device)
    if os.path.isfile(os.path.join(out, "config.json")):
        print(f"[rlbench] reusing SFT warm start {out}", flush=True)
    return demo_warm_start(out, max_steps=args.sft_steps, device=device)  # announces a build itself


def run_train(cfg) -> dict:
    """Build the trainer of `cfg.cluster.backend`, train `num_rollout` steps, print a summary; returns the last metrics."""
    from rlbench.curve_png import write_run_curve
    from rlbench.orchestration import build_trainer

    trainer = build_trainer(cfg)
    with rollout_progress(trainer):
        trainer.fit()
    summary = summarize_run(trainer)
    print(json.dumps(summary, indent=1), flush=True)
    curve = write_run_curve(trainer)
    if curve:
        print(f"[rlbench] curve -> {curve}", flush=True)
    trainer.close()
    return summary


@contextlib.contextmanager
def rollout_progress(trainer):
    """A progress bar of the samples the run still generates (training rounds and evals, `expected_samples`), fed
    by the rollout manager as each sample ends (`RolloutManager.progress`); the per-step lines print above it."""
    from rlbench.progress import Progress

    manager = getattr(trainer, "rollouts", None)
    total = expected_samples(trainer.cfg, len(trainer.eval_items), trainer.rollout_id)
    if manager is None or not hasattr(manager, "progress") or total < 1:
        yield
        return
    with Progress(total, "rollout", unit="sample") as bar:
        manager.progress = bar.update
        try:
            yield
        finally:
            manager.progress = None


def expected_samples(cfg, n_eval_items: int, done: int = 0) -> int:
    """Samples a run generates from rollout `done` to `num_rollout`: one round of `prompts_per_round` x n per
    rollout (dynamic sampling may draw more rounds: the bar's total then grows) and every eval due, the one before
    training included unless skipped."""
    r, e, end = cfg.rollout, cfg.eval, cfg.batch.num_rollout
    train = max(0, end - done) * r.prompts_per_round * r.n_samples_per_prompt
    evals = 0
    if e.interval and n_eval_items:
        evals = end // e.interval - done // e.interval + (done == 0 and not e.skip_before_train)
    return train + evals * n_eval_items * e.n_samples_per_prompt


def summarize_run(trainer) -> dict:
    """Start/end eval and mean per-phase times of a finished run.

    `eval/<metric>/start` is the first eval and `/end` the last one, each beside the rollout id it measured
    (`eval/rollout_id/start`, `/end`); with a single eval there is no `/end`: nothing measured it after training.
    """
    out: dict[str, float] = {}
    if trainer.eval_history:
        first, last = trainer.eval_history[0], trainer.eval_history[-1]
        keys = [k for k in first if k.startswith("eval/pass@") or k == "eval/reward"]
        out["eval/rollout_id/start"] = first["rollout/id"]
        out |= {f"{key}/start": first[key] for key in keys}
        if len(trainer.eval_history) > 1:
            out["eval/rollout_id/end"] = last["rollout/id"]
            out |= {f"{key}/end": last[key] for key in keys}
    for key in ("perf/rollout_time", "perf/log_probs_time", "perf/train_time", "perf/update_weights_time",
                "perf/step_time", "perf/peak_memory_gb", "weights/bytes"):
        vals = [h[key] for h in trainer.history if key in h]
        if vals:
            out[f"{key}/mean"] = sum(vals) / len(vals)
    return out


def device_sft_dir(args: argparse.Namespace, preset: str) -> str:
    """Where `rlbench bench`'s SFT warm start of `preset` is: `--sft-dir`, else `runs/sft-<preset>`."""
    return args.sft_dir or os.path.join("runs", f"sft-{preset}")


def ensure_device_sft(args: argparse.Namespace, preset: str) -> str:
    """A short SFT warm start of `preset` on the GPU in `device_sft_dir` (reused when there); returns the HF dir."""
    out = device_sft_dir(args, preset)
    if os.path.isfile(os.path.join(out, "config.json")):
        print(f"[rlbench] reusing SFT warm start {out}", flush=True)
        return out
    from rlbench.presets import gpu_sft
    from rlbench.sft import run_sft

    print(f"[rlbench] SFT warm start of {preset!r} on cuda -> {out}", flush=True)
    metrics = run_sft(gpu_sft(preset, out, steps=args.sft_steps or 150))
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}), flush=True)
    return out
