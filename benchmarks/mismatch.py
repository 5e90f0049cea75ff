"""Train-inference mismatch on the CPU demo: the same seed and config under several loss settings, with a rollout
engine less precise than the trainer (`TorchEngineConfig.dtype`, e.g. a bf16 engine for an fp32 trainer), plus
matched-precision references.

    python benchmarks/mismatch.py                       # 60 steps per setting, bf16 engine, eval every 20
    python benchmarks/mismatch.py --quick               # smoke run: 2 steps per setting, no eval (runs/mismatch/quick.json)
    python benchmarks/mismatch.py --engine-dtype fp16 --steps 30 --out /tmp/m.json
    python benchmarks/mismatch.py --device cuda --engine-weight-format nvfp4 --steps 30 --eval-interval 10 \
        --settings standard tis mis matched_standard     # one GPU: the 0.6B shape (SFT warm start), NVFP4 rollouts
    python benchmarks/mismatch.py --engine-weight-format fp8_e4m3   # FP8 rollout weights (mismatch_fp8_<date>.json)
    python benchmarks/mismatch.py --engine-weight-format nvfp4      # 4-bit rollout weights (mismatch_nvfp4_<date>.json)
    python benchmarks/mismatch.py --engine-weight-format fp8_e4m3 --temperature 1.5 --steps 3 --eval-interval 0 \
        --settings mis --out /tmp/p.json   # a probe: higher-entropy rollouts; MIS logs the out-of-band fractions

Settings (all GRPO from `rlbench.presets.cpu_demo`, only `loss`, `engine.dtype` and `engine.weight_format` differ;
`--engine-weight-format fp8_e4m3 | mxfp4 | nvfp4` gives the less precise settings FP8 or 4-bit rollout weights,
`rlbench.engine.quantize`):

| name | engine | loss |
|---|---|---|
| standard | --engine-dtype | plain PPO: old = recomputed by the trainer, no IS |
| tis | --engine-dtype | `use_tis=True`: token-level TIS, weight min(pi_old/pi_rollout, tis_clip=2) |
| mis | --engine-dtype | `use_tis=True, mis=MISConfig()`: slime's mis.yaml (token truncate [0.5, 2], token rejection, veto 1e-4, batch-normalised) |
| mis_no_rs | --engine-dtype | MIS without rejection or veto (truncate [0.5, 2], batch-normalised) |
| mis_veto_only | --engine-dtype | MIS with the veto but no band rejection |
| bypass | --engine-dtype | `use_rollout_logprobs=True`: old = the engine's log-probs |
| matched_standard | trainer's dtype | plain PPO, engine == trainer precision (the reference) |
| matched_standard_seed1 | trainer's dtype | the same with another rollout/data seed: the seed-to-seed noise floor |

`--settings standard mis --seed-offset 1` repeats a subset with other rollout/data seeds (a second sample of a
difference between settings: one seed per setting cannot tell an effect from trajectory noise).

Writes one JSON: per setting and step the raw reward, eval metrics (when due), the mismatch diagnostics
(`train/train_rollout_logprob_abs_diff`, `train/mismatch_*`), TIS/MIS weights, `ppo_kl`, clip fraction, grad
norm (and entropy when the loss computes it), plus a per-setting summary and the run's provenance.
Missing warm start: the demo's SFT (`presets.DEMO_SFT`, ~40 s) is trained first, as `make run` does.
"""

from __future__ import annotations

import argparse
import dataclasses as dc
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import zlib

import torch

from rlbench import Trainer, presets
from rlbench.algorithms import MISConfig
from rlbench.configs import LoggingConfig
from rlbench.configs.engine import WEIGHT_FORMATS
from rlbench.sft import SFTConfig, run_sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KEEP_PREFIXES = (
    "rollout/raw_reward", "rollout/response_len", "rollout/truncated", "eval/",
    "train/train_rollout_logprob_abs_diff", "train/mismatch_", "train/tis", "train/mis_",
    "train/ppo_kl", "train/pg_clipfrac", "train/grad_norm", "train/entropy", "train/loss", "train/pg_loss",
    "train/skipped", "perf/step_time",
)
"""Metric keys kept per step (prefix match)."""


def settings(engine_dtype: str, names: list[str] | None = None, weight_format: str | None = None) -> dict[str, dict]:
    """name -> {"engine_dtype": str | None, "loss": dict of LossConfig overrides, "seed_offset": int,
    "weight_format": str | None (the less precise settings only)}."""
    all_settings = {
        "standard": dict(engine_dtype=engine_dtype, loss={}),
        "tis": dict(engine_dtype=engine_dtype, loss=dict(use_tis=True, tis_clip=2.0)),
        "mis": dict(engine_dtype=engine_dtype, loss=dict(use_tis=True, mis=MISConfig())),
        "mis_no_rs": dict(engine_dtype=engine_dtype, loss=dict(use_tis=True, mis=MISConfig(use_rs=False))),
        "mis_veto_only": dict(engine_dtype=engine_dtype, loss=dict(use_tis=True, mis=MISConfig(
            rs_lower_bound=0.0, rs_upper_bound=math.inf))),
        "bypass": dict(engine_dtype=engine_dtype, loss=dict(use_rollout_logprobs=True)),
        "matched_standard": dict(engine_dtype=None, loss={}),
        "matched_standard_seed1": dict(engine_dtype=None, loss={}, seed_offset=1),
    }
    if names:
        unknown = sorted(set(names) - set(all_settings))
        if unknown:
            raise SystemExit(f"unknown settings {unknown}; choose from {list(all_settings)}")
        all_settings = {n: all_settings[n] for n in names}
    for setting in all_settings.values():
        setting["weight_format"] = weight_format if setting["engine_dtype"] is not None else None
    return all_settings


GPU_PRESET = "qwen3-0.6b-shape"
GPU_SFT_DIR = os.path.join("runs", f"sft-{GPU_PRESET}")
"""`--device cuda`: the 0.6B shape, SFT-warmed on 3-digit arithmetic (`presets.gpu_sft`), in `qwen3_0p6b_gpu`."""


def base_config(model: str, workdir: str, device: str):
    """The run every setting starts from: `cpu_demo` (fp32 trainer) or, on CUDA, `qwen3_0p6b_gpu` (bf16 compute,
    fp32 master weights; the less precise engine then differs by its weight format)."""
    if device == "cuda":
        return presets.qwen3_0p6b_gpu(model=model, workdir=workdir)
    return presets.cpu_demo(model=model, workdir=workdir)


def build_config(model: str, workdir: str, setting: dict, *, steps: int, eval_interval: int | None,
                 lr: float | None, seed_offset: int = 0, temperature: float | None = None,
                 task: str | None = None, device: str = "cpu"):
    """The base run (`base_config`) with the setting's engine dtype / weight format and loss."""
    cfg = base_config(model, workdir, device)
    loss = dc.replace(cfg.loss, **setting["loss"])
    optim = cfg.backend.optim if lr is None else dc.replace(cfg.backend.optim, lr=lr)
    sections = dict(
        loss=loss,
        engine=dc.replace(cfg.engine, dtype=setting["engine_dtype"], weight_format=setting.get("weight_format")),
        backend=dc.replace(cfg.backend, optim=optim),
        batch=dc.replace(cfg.batch, num_rollout=steps),
        eval=dc.replace(cfg.eval, interval=eval_interval),
        logging=LoggingConfig(console=False, jsonl_path=os.path.join(workdir, "metrics.jsonl")),
    )
    rollout = cfg.rollout if temperature is None else dc.replace(cfg.rollout, temperature=temperature)
    data = cfg.data
    if task and task != cfg.task.name:  # another synthetic task on the same arithmetic-SFT model: longer answers
        task_cfg = dc.replace(cfg.task, name=task)
        data = dc.replace(data, path=task_cfg.train_path)
        rollout = dc.replace(rollout, max_response_len=24)
        sections |= dict(task=task_cfg, engine=dc.replace(sections["engine"], max_seq_len=80))
    offset = setting.get("seed_offset", 0) + seed_offset
    if offset:
        seed = cfg.rollout.seed + offset
        rollout = dc.replace(rollout, seed=seed)
        data = dc.replace(data, seed=seed)
    sections |= dict(rollout=rollout, data=data)
    return cfg.replace(**sections)


class EngineWeightNoise:
    """A deliberately perturbed rollout engine: wraps `engine.update_weights` so that every matrix the engine
    receives (2-D and up: projections, MLP, the tied embedding / lm_head; 1-D norms stay as sent) is stored as
    `w * (1 + sigma * N(0, 1))`, elementwise. The noise is re-drawn at every weight sync, from a generator seeded
    by `(seed, policy version, tensor name)`: one draw per policy version, reproducible, and the same draw again
    when the same version is re-sent. The engine samples from the perturbed weights and reports their log-probs
    (the rollout log-probs); the trainer keeps the clean weights, so pi_old / pi_rollout is a real mismatch.

    `enabled = False` passes the weights through unchanged (the clean engine, e.g. for a clean eval)."""

    def __init__(self, engine, sigma: float, seed: int = 0, *, redraw: bool = True, norm_scale: float = 1.0) -> None:
        if sigma < 0:
            raise ValueError(f"engine weight noise sigma={sigma} must be >= 0")
        self.engine, self.sigma, self.seed = engine, float(sigma), int(seed)
        self.redraw, self.norm_scale = redraw, float(norm_scale)
        self.enabled = True
        self.inner = engine.update_weights
        self.syncs: list[tuple[int, bool]] = []  # (version, perturbed) per sync, for tests and the record
        engine.update_weights = self

    def generator(self, version: int, name: str) -> torch.Generator:
        seed = (self.seed * 1_000_003 + version) * 4_294_967_311 + zlib.crc32(name.encode())
        return torch.Generator().manual_seed(seed % (2 ** 63))

    def perturb(self, name: str, tensor: torch.Tensor, version: int) -> torch.Tensor:
        if name == "model.norm.weight" and self.norm_scale != 1.0:
            return tensor * self.norm_scale
        if tensor.dim() < 2 or self.sigma == 0:
            return tensor
        version = version if self.redraw else 0
        noise = torch.randn(tensor.shape, generator=self.generator(version, name), dtype=torch.float32)
        return (tensor.float() * (1 + self.sigma * noise.to(tensor.device))).to(tensor.dtype)

    def __call__(self, buckets, version: int) -> None:
        on = self.enabled and (self.sigma > 0 or self.norm_scale != 1.0)
        self.syncs.append((int(version), on))
        if on:
            buckets = ([(name, self.perturb(name, t, version)) for name, t in bucket] for bucket in buckets)
        return self.inner(buckets, version)


def add_engine_noise(trainer: Trainer, sigma: float, seed: int, **kw) -> EngineWeightNoise:
    """Perturb `trainer`'s engine (`EngineWeightNoise`), re-send the current weights through it, and make each
    `trainer.evaluate()` score the clean weights as `eval/*` (the policy being trained) and the perturbed engine
    as `eval_engine/*` (the behaviour policy that samples the rollouts)."""
    noise = EngineWeightNoise(trainer.engine, sigma, seed, **kw)
    trainer.sync_weights()  # the engine now holds the perturbed version-0 weights
    engine_evaluate = trainer.evaluate

    def evaluate() -> dict[str, float]:
        noisy = engine_evaluate()  # appends the perturbed engine's eval to eval_history
        noise.enabled = False
        try:
            trainer.sync_weights()
            trainer._enter("rollout")  # sync_weights leaves the trainer side awake (colocated offload)
            clean = trainer.rollouts.evaluate(trainer.eval_items, trainer.cfg.eval)
        finally:
            noise.enabled = True
            trainer.sync_weights()  # the same version: the same draw as before
        entry = trainer.eval_history[-1]
        entry.update({f"eval_engine/{k[5:]}": v for k, v in noisy.items() if k.startswith("eval/")})
        entry.update(clean)
        return clean

    trainer.evaluate = evaluate
    return noise


def _keep(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if k.startswith(KEEP_PREFIXES)}


def _mean(rows: list[dict], key: str, sl: slice = slice(None)) -> float | None:
    vals = [r[key] for r in rows[sl] if key in r]
    return sum(vals) / len(vals) if vals else None


def summarize(steps: list[dict], evals: list[dict], window: int) -> dict:
    """Reward at start/end (mean of the first/last `window` steps), eval start/end, mean mismatch diagnostics."""
    out = {
        "reward_start": _mean(steps, "rollout/raw_reward", slice(0, window)),
        "reward_end": _mean(steps, "rollout/raw_reward", slice(-window, None)),
        "reward_mean": _mean(steps, "rollout/raw_reward"),
    }
    for key in ("train/train_rollout_logprob_abs_diff", "train/mismatch_kl", "train/mismatch_k3_kl",
                "train/mismatch_ppl_ratio", "train/mismatch_log_ppl_abs_diff", "train/tis_abs", "train/tis_clipfrac",
                "train/mis_rs_mask_fraction_low", "train/mis_rs_mask_fraction_high",
                "train/mis_rs_catastrophic_seq_fraction", "train/ppo_kl", "train/pg_clipfrac", "train/grad_norm"):
        value = _mean(steps, key)
        if value is not None:
            out[f"mean {key}"] = value
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in steps if "train/train_rollout_logprob_abs_diff" in r]
    if diffs:
        out["max_step train/train_rollout_logprob_abs_diff"] = max(diffs)
    if evals:
        for key in [k for k in evals[0] if k.startswith(("eval/pass@", "eval_engine/pass@"))
                    or k in ("eval/reward", "eval/truncated_ratio")]:
            out[f"{key} start"], out[f"{key} end"] = evals[0][key], evals[-1][key]
    return out


def run_setting(name: str, cfg, steps: int, noise_sigma: float = 0.0, noise_seed: int = 0, **noise_kw) -> dict:
    start = time.perf_counter()
    trainer = Trainer(cfg)
    perturbed = noise_sigma or noise_kw.get("norm_scale", 1.0) != 1.0
    noise = add_engine_noise(trainer, noise_sigma, noise_seed, **noise_kw) if perturbed else None
    rows = []
    for i in range(steps):
        m = trainer.step()
        rows.append({"step": i + 1, **_keep(m)})
        line = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in rows[-1].items()
                        if k in ("rollout/raw_reward", "eval/pass@1", "train/train_rollout_logprob_abs_diff",
                                 "train/mismatch_kl", "train/ppo_kl", "train/grad_norm"))
        print(f"[{name}] step {i + 1}/{steps} {line}", flush=True)
    evals = [{"rollout/id": float(e.get("rollout/id", -1)),
              **{k: float(v) for k, v in e.items() if k.startswith(("eval/", "eval_engine/"))}}
             for e in trainer.eval_history]
    trainer.close()
    out = {"steps": rows, "eval": evals, "wall_s": time.perf_counter() - start}
    if noise is not None:
        out["engine_weight_noise"] = {"sigma": noise.sigma, "seed": noise.seed, "redraw": noise.redraw,
                                      "norm_scale": noise.norm_scale, "syncs": len(noise.syncs)}
    return out


def provenance(argv: list[str]) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT) if sys.argv else "benchmarks/mismatch.py", *argv]),
        "git_head": git("rev-parse", "HEAD"),
        "git_dirty_files": git("status", "--porcelain", "--untracked-files=no").splitlines(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
    }


def ensure_model(model: str | None, device: str = "cpu") -> str:
    """The model every setting loads; the default SFT warm start (CPU demo's, or the GPU one) is trained if missing."""
    if device == "cuda":
        model = model or GPU_SFT_DIR
        if model == GPU_SFT_DIR and not os.path.isfile(os.path.join(model, "config.json")):
            print(f"[mismatch] SFT warm start of {GPU_PRESET} on cuda -> {model} (presets.gpu_sft)", flush=True)
            run_sft(presets.gpu_sft(GPU_PRESET, model))
        return model
    model = model or presets.demo_sft_dir()
    if model == presets.demo_sft_dir() and not os.path.isfile(os.path.join(model, "config.json")):
        print(f"[mismatch] SFT warm start -> {model} (presets.DEMO_SFT)", flush=True)
        run_sft(SFTConfig(**presets.DEMO_SFT, out=model))
    return model


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="RL steps per setting (default 60, the demo's)")
    p.add_argument("--engine-dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="the less precise engine's dtype (the trainer computes in fp32)")
    p.add_argument("--engine-weight-format", default=None, choices=WEIGHT_FORMATS,
                   help="the less precise engine's weight format (default: as sent; fp8_e4m3: FP8, mxfp4 / nvfp4: "
                        "4-bit rollout weights)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mismatch_<date>.json, "
                   "mismatch_<fp8|mxfp4|nvfp4>_<date>.json with --engine-weight-format)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps per setting, no eval, no seed-noise run")
    p.add_argument("--settings", nargs="*", default=None, help="subset of the settings (default: all)")
    p.add_argument("--eval-interval", type=int, default=20, help="eval every N steps and before training (0: off)")
    p.add_argument("--seed-offset", type=int, default=0,
                   help="add N to every setting's rollout/data seed (another sample of the same comparison)")
    p.add_argument("--temperature", type=float, default=None,
                   help="override rollout.temperature (the preset's 1.0; training log-probs use the same; eval keeps 1.0)")
    p.add_argument("--task", default=None, choices=("arithmetic", "countdown"),
                   help="override the preset's task (arithmetic level 1); countdown: max_response_len 24; the "
                        "arithmetic-SFT model scores ~0 on it, so use it for the mismatch numbers, with --eval-interval 0")
    p.add_argument("--engine-weight-noise", type=float, default=0.0, metavar="SIGMA",
                   help="a perturbed engine for the less precise settings: every matrix it receives is stored as "
                        "w * (1 + SIGMA * N(0,1)), re-drawn at each weight sync (seeded; EngineWeightNoise); eval/* "
                        "then scores the clean weights and eval_engine/* the perturbed engine")
    p.add_argument("--noise-fixed", action="store_true", help="one noise draw for the whole run (not re-drawn per sync)")
    p.add_argument("--engine-norm-scale", type=float, default=1.0,
                   help="scale the perturbed engine's final norm weight (its logits) by this: < 1 a hotter engine")
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the engine weight noise (+ --seed-offset)")
    p.add_argument("--lr", type=float, default=None, help="override the preset's learning rate (2e-4)")
    p.add_argument("--model", default=None, help="HF dir or model preset (default: the demo's SFT; on cuda the "
                   f"0.6B shape's, {GPU_SFT_DIR})")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: qwen3_0p6b_gpu (bf16 compute) from a 0.6B-shape SFT warm start; give the less precise "
                        "engine a weight format (e.g. --engine-weight-format nvfp4), its dtype is the trainer's")
    p.add_argument("--workdir", default=os.path.join("runs", "mismatch"))
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    if args.quick:  # the five settings (not the seed-noise run), 2 steps each, no eval
        args.steps, args.eval_interval = 2, 0
        args.settings = args.settings or [n for n in settings("bf16") if not n.endswith("_seed1")]
    torch.set_num_threads(args.threads)
    date = datetime.date.today().isoformat()
    fmt = args.engine_weight_format
    fmt_tag = f"{fmt.split('_')[0]}_" if fmt else ""  # fp8_e4m3 -> fp8_, mxfp4 -> mxfp4_
    fmt_tag += "noise_" if args.engine_weight_noise else ""
    fmt_tag += "gpu_" if args.device == "cuda" else ""
    default_out = (os.path.join(args.workdir, "quick.json") if args.quick  # never overwrite a committed result
                   else os.path.join(ROOT, "benchmarks", "results", f"mismatch_{fmt_tag}{date}.json"))
    out_path = args.out or default_out
    model = ensure_model(args.model, args.device)
    eval_interval = args.eval_interval or None
    result = {
        "what": ("train-inference mismatch: qwen3_0p6b_gpu GRPO, bf16 trainer" if args.device == "cuda" else
                 "train-inference mismatch: cpu_demo GRPO, fp32 trainer") + ", engine in --engine-dtype"
                + (f" with {args.engine_weight_format} weights" if args.engine_weight_format else "")
                + (f", weights * (1 + {args.engine_weight_noise} N(0,1)) re-drawn per sync" if args.engine_weight_noise
                   else "") + " vs matched",
        "provenance": provenance(argv),
        "args": vars(args),
        "trainer_param_dtype": base_config(model, args.workdir, args.device).backend.param_dtype,
        "settings": {},
    }
    window = max(1, min(10, args.steps // 4))
    for name, setting in settings(args.engine_dtype, args.settings, args.engine_weight_format).items():
        cfg = build_config(model, os.path.join(args.workdir, name), setting, steps=args.steps,
                           eval_interval=eval_interval, lr=args.lr, seed_offset=args.seed_offset,
                           temperature=args.temperature, task=args.task, device=args.device)
        noisy = setting["engine_dtype"] is not None and (args.engine_weight_noise > 0 or args.engine_norm_scale != 1)
        run = run_setting(name, cfg, args.steps, args.engine_weight_noise if noisy else 0.0,
                          args.noise_seed + args.seed_offset + setting.get("seed_offset", 0),
                          redraw=not args.noise_fixed, norm_scale=args.engine_norm_scale if noisy else 1.0)
        run["config"] = {"engine_dtype": cfg.engine.dtype or f"{cfg.backend.param_dtype} (matched)",
                         "engine_weight_format": cfg.engine.weight_format,
                         "loss_mode": cfg.loss.mode, "loss_overrides": {k: str(v) for k, v in setting["loss"].items()},
                         "rollout_seed": cfg.rollout.seed, "rollout_temperature": cfg.rollout.temperature,
                         "task": cfg.task.name, "engine_weight_noise": args.engine_weight_noise if noisy else 0.0,
                         "lr": cfg.backend.optim.lr}
        run["summary"] = summarize(run["steps"], run["eval"], window)
        run["summary"]["window_steps"] = window
        result["settings"][name] = run
        print(f"[mismatch] {name}: {json.dumps(run['summary'])} ({run['wall_s']:.0f} s)", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:  # rewritten after every setting: a stopped run keeps what it finished
            json.dump(result, f, indent=1)
    print(f"[mismatch] wrote {out_path}", flush=True)
    return result


if __name__ == "__main__":
    main()
