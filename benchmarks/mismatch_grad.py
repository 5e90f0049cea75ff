r"""Issue 25: is the policy gradient from a perturbed rollout engine biased, and do TIS / MIS remove the bias?

A cheap diagnostic (no training run). From the CPU demo's SFT warm start (`benchmarks/mismatch.py`'s model and
config: `presets.cpu_demo`, `presets.DEMO_SFT`), one trainer and one perturbed engine exactly as
`benchmarks/mismatch.py --engine-dtype fp32 --engine-weight-noise SIGMA --noise-fixed` builds them. For ONE fixed
batch of prompts (the demo's rollout size, 16 prompts x 8 samples):

  g_true     the on-policy GRPO gradient of the clean trainer policy: the mean of `--ref-draws` independent
             batches sampled by the CLEAN engine (matched precision), each with the usual group size, so it is
             the expectation of the usual estimator (not a bigger-group one), standard loss;
  matched    `--draws` further independent clean-engine batches (the noise floor of one batch);
  standard / tis / mis / ...   `--draws` batches sampled by the PERTURBED engine, each batch's gradient under
             each loss setting (the settings of `benchmarks/mismatch.py`, plus optional extras).

Every gradient goes through the library's own path: `RolloutManager._sample_groups` (the engine samples and
reports its log-probs), `Trainer.score` (rewards, GRPO advantages), `RankStep.pack / compute_log_probs /
loss_inputs` (old log-probs recomputed by the trainer, IS / MIS weights from `rlbench.algorithms.mismatch`), and
the FSDP backend's own accumulation (`forward_pack` + `PolicyLoss` + backward). Parameters are never updated.
Every optimizer step of the batch (global_batch_size 64: two) is evaluated at the same (initial) weights, and
their gradients are averaged: the gradient of the whole rollout's loss at the current policy.

Reported per setting: cosine to g_true and gradient norm, mean +- sd over the draws; the cosine of the mean of
the draws to g_true (bias with less variance: compare with `matched`'s same-size mean); the split-half cosine of
g_true (its own reliability); and token statistics of the perturbed batches: which tokens MIS masks
(w = pi_old / pi_rollout < 0.5: the engine over-samples them; > 2: under-samples), their advantages' sign.

    python benchmarks/mismatch_grad.py --threads 1                       # sigma 0.5, fixed draw, noise seed 0
    python benchmarks/mismatch_grad.py --threads 1 --quick               # smoke: 2 ref draws, 2 draws, 4 prompts

The 2026-12-07 results (docs/LOG.md; 2-5 min each, one thread):

    python benchmarks/mismatch_grad.py --threads 1 --ref-draws 32 --draws 8 --settings standard tis mis seq_tis rs_only
    python benchmarks/mismatch_grad.py --threads 1 --ref-draws 24 --draws 8 --settings standard tis mis \
        --train-setting mis --train-steps 3 --out benchmarks/results/mismatch_grad_2026-12-07_after3mis.json
    python benchmarks/mismatch_grad.py --threads 1 --ref-draws 16 --draws 4 --settings standard tis mis \
        --train-setting matched_standard --train-steps 3 --out benchmarks/results/mismatch_grad_2026-12-07_after3matched.json
    python benchmarks/mismatch_grad.py --threads 1 --noise 0.3 --ref-draws 16 --draws 6 --settings standard tis mis \
        --out benchmarks/results/mismatch_grad_2026-12-07_sigma0.3.json

`--train-setting S --train-steps K` first trains K RL steps as `benchmarks/mismatch.py --settings S` would (same
seeds; the perturbed engine, or the clean one for matched_standard), then probes at the trained policy.
`cos_expected` (in the JSON `cos_expected_to_g_true`) is the cosine of the setting's EXPECTED gradient to the
expected on-policy one, the sampling noise of both removed by dot products of independent draws only; it is itself
noisy with few draws (it can exceed 1: matched read 1.31 with 8 high-variance draws), so read it with the per-draw
and mean-of-draws cosines.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses as dc
import datetime
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mismatch as mm  # noqa: E402  (benchmarks/mismatch.py: config, perturbed engine, provenance)

from rlbench import Trainer  # noqa: E402
from rlbench.algorithms import LossConfig, MISConfig  # noqa: E402
from rlbench.algorithms.loss import build_loss  # noqa: E402
from rlbench.rollout.manager import RolloutBatch, prompt_seeds  # noqa: E402
from rlbench.types import Status  # noqa: E402

ROOT = mm.ROOT

EXTRA_SETTINGS = {
    # sequence-level truncated IS (the product of the token ratios), batch-normalised, no rejection: the
    # textbook correction of the whole trajectory's distribution, for comparison with the token-level ones
    "seq_tis": dict(use_tis=True, mis=MISConfig(tis_level="sequence", use_rs=False, tis_upper_bound=1e4,
                                                tis_lower_bound=0.0)),
    # MIS without its batch normalisation (isolates the normaliser)
    "mis_nonorm": dict(use_tis=True, mis=MISConfig(tis_batch_normalize=False)),
    # rejection only (no IS weight): what masking alone does
    "rs_only": dict(use_tis=True, mis=MISConfig(use_tis=False)),
}


class GradProbe:
    """One trainer + its (optionally perturbed) engine; samples fixed prompts and takes loss gradients."""

    def __init__(self, trainer: Trainer, noise, items) -> None:
        self.t, self.noise, self.items = trainer, noise, items
        self.gbs = trainer.cfg.batch.global_batch_size
        self.n = trainer.cfg.rollout.n_samples_per_prompt
        self._engine_clean: bool | None = None
        # mismatch.py's settings override the "standard" loss (the trainer's own may be another, --train-setting)
        self.base_loss = dc.replace(trainer.cfg.loss, use_tis=False, mis=None, use_rollout_logprobs=False,
                                    tis_clip=LossConfig.tis_clip)

    def set_engine(self, clean: bool) -> None:
        if self._engine_clean is clean:
            return
        self.noise.enabled = not clean
        self.t.sync_weights()  # the same version: the same (fixed) draw each time the noise is on
        self._engine_clean = clean

    def sample(self, clean: bool, draw_id: int) -> RolloutBatch:
        """One batch of the fixed prompts x n, from the clean or the perturbed engine; advantages set."""
        self.set_engine(clean)
        t = self.t
        t._enter("rollout")
        c = t.cfg.rollout
        # sampling seeds as the manager derives them (a pure function of seed, "rollout id", round); the draw id
        # plays the rollout id, offset so clean and perturbed draws never share seeds
        seeds = prompt_seeds(c.seed, 10_000 * (0 if clean else 1) + draw_id, 0, len(self.items), self.n)
        groups = t.rollouts._sample_groups(self.items, self.n, seeds)
        t.rollouts._renumber(groups)
        samples = [s for g in groups for s in g]
        if c.mask_truncated:
            for s in samples:
                if s.status == Status.TRUNCATED:
                    s.loss_mask = [0] * s.response_length
        batch = RolloutBatch(samples=samples, rollout_id=draw_id)
        batch.metrics = t.score(batch)  # rewards checked, GRPO advantages (group size n) on the samples
        return batch

    def rank_step(self, loss_overrides: dict):
        """The trainer's RankStep with another loss config (what mismatch.py's settings change)."""
        rs = copy.copy(self.t.rank_step)
        rs.loss_cfg = dc.replace(self.base_loss, **loss_overrides)
        rs.loss = build_loss(rs.loss_cfg)
        return rs

    def prepare(self, batch: RolloutBatch):
        """Packs (one list per optimizer step) and the trainer's recomputed old log-probs."""
        rs = self.t.rank_step
        samples = batch.samples
        packs = rs.pack([samples[i:i + self.gbs] for i in range(0, len(samples), self.gbs)])
        self.t._enter("train")
        old, _, _ = rs.compute_log_probs(packs)  # every step recomputed (no first-from-forward shortcut)
        return packs, old

    def grad(self, packs, old, loss_overrides: dict) -> tuple[torch.Tensor, dict]:
        """The flat gradient of the loss (mean over the optimizer steps, all at the current weights)."""
        rs = self.rank_step(loss_overrides)
        backend = self.t.backend
        backend.model.train()
        total, metrics = None, {}
        for s, step_packs in enumerate(packs):
            inputs = rs.loss_inputs(step_packs, old[s], None)
            backend._clear_grads()
            _, sums = backend._accumulate(step_packs, inputs, rs.loss)
            g = flat_grad(backend.model)
            total = g if total is None else total + g
            for k, v in sums.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(packs)
        backend._clear_grads()
        return total / len(packs), metrics


def flat_grad(model) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        if p.grad is None:
            parts.append(torch.zeros(p.numel(), dtype=torch.float64))
            continue
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        parts.append(g.detach().reshape(-1).double().cpu())
    return torch.cat(parts)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


def token_stats(packs, old) -> dict:
    """Which tokens a perturbed batch has: w = pi_old / pi_rollout, the MIS bands, advantage signs."""
    w, adv, mask, seq_lr = [], [], [], []
    for step_packs, step_old in zip(packs, old):
        for p, o in zip(step_packs, step_old):
            w.append((o - p.rollout_log_probs).double())
            adv.append(p.advantages.double())
            mask.append(p.loss_mask.double())
            for d, m in zip(torch.split(o - p.rollout_log_probs, p.response_lengths),
                            torch.split(p.loss_mask, p.response_lengths)):
                seq_lr.append(float((d * m).sum()))
    lr, adv, mask = torch.cat(w), torch.cat(adv), torch.cat(mask) > 0
    lr, adv = lr[mask], adv[mask]
    w = lr.exp()
    low, high, mid = w < 0.5, w > 2.0, (w >= 0.5) & (w <= 2.0)

    def frac(x):
        return float(x.double().mean()) if x.numel() else float("nan")

    seq_lr = torch.tensor(seq_lr, dtype=torch.float64)
    return {
        "tokens": int(mask.sum()),
        "k3_kl": float((w - 1 - lr).mean()),
        "k1_kl_rollout_minus_old": float((-lr).mean()),
        "abs_logprob_diff": float(lr.abs().mean()),
        "frac_w_low(<0.5, engine over-samples)": frac(low),
        "frac_w_high(>2, engine under-samples)": frac(high),
        "frac_low_with_adv_pos": frac(low & (adv > 0)),
        "frac_low_with_adv_neg": frac(low & (adv < 0)),
        "frac_high_with_adv_pos": frac(high & (adv > 0)),
        "frac_high_with_adv_neg": frac(high & (adv < 0)),
        "mean_adv_low": float(adv[low].mean()) if low.any() else float("nan"),
        "mean_adv_high": float(adv[high].mean()) if high.any() else float("nan"),
        "mean_adv_mid": float(adv[mid].mean()) if mid.any() else float("nan"),
        "mean_w": float(w.mean()),
        "mean_w_clamped_2": float(w.clamp(max=2.0).mean()),
        "seq_log_ratio_mean": float(seq_lr.mean()),
        "seq_log_ratio_sd": float(seq_lr.std()),
        "frac_seq_with_veto_token(w<1e-4)": None,  # filled from MIS metrics
    }


def pair_dot(gs: list[torch.Tensor]) -> float:
    """Unbiased estimate of |E g|^2 from independent draws: the mean of g_i . g_j over i != j."""
    k = len(gs)
    if k < 2:
        return float("nan")
    total = torch.stack(gs).sum(0)
    return float((total.dot(total) - sum(g.dot(g) for g in gs)) / (k * (k - 1)))


def expected_cos(gs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """cos(E g, E g_ref) without the sampling noise of either: E g . E r from the independent cross dots, the
    norms from `pair_dot` (NaN when a squared-norm estimate is not positive: too few draws for the noise)."""
    cross = float(torch.stack(gs).mean(0).dot(torch.stack(refs).mean(0)))
    a, b = pair_dot(gs), pair_dot(refs)
    return cross / math.sqrt(a * b) if a > 0 and b > 0 else float("nan")


def mean_sd(xs: list[float]) -> dict:
    a = np.asarray(xs, dtype=float)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": len(a),
            "values": [round(float(x), 5) for x in a]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--noise", type=float, default=0.5, help="engine weight noise sigma (mismatch.py's 0.5)")
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the fixed noise draw (mismatch.py: "
                   "--noise-seed + --seed-offset; 0 is the 12-06 seed-0 run's draw, 1 the milder seed-1 draw)")
    p.add_argument("--redraw", action="store_true", help="re-drawn noise (version 0's draw is used either way here)")
    p.add_argument("--engine-norm-scale", type=float, default=1.0, help="as mismatch.py --engine-norm-scale")
    p.add_argument("--ref-draws", type=int, default=16, help="clean-engine batches averaged into g_true (x n=8)")
    p.add_argument("--draws", type=int, default=6, help="independent batches per engine for the per-draw stats")
    p.add_argument("--prompts", type=int, default=None, help="prompts in the fixed batch (default: rollout size 16)")
    p.add_argument("--prompt-skip", type=int, default=0, help="take the fixed prompts after skipping this many")
    p.add_argument("--settings", nargs="*", default=["standard", "tis", "mis"],
                   help=f"loss settings on the perturbed batches: mismatch.py's standard tis mis bypass, or "
                        f"{list(EXTRA_SETTINGS)}")
    p.add_argument("--train-setting", default=None, help="first train --train-steps RL steps with this mismatch.py "
                   "setting (perturbed engine, as mismatch.py runs it: same seeds; matched_standard: the clean engine), then "
                   "probe at that policy")
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None, help="as mismatch.py --temperature")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 ref draws, 2 draws, 4 prompts")
    p.add_argument("--workdir", default=os.path.join("runs", "mismatch_grad"))
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/mismatch_grad_<date>.json)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.ref_draws, args.draws, args.prompts = 2, 2, 4
    torch.set_num_threads(args.threads)
    date = datetime.date.today().isoformat()
    out_path = args.out or (os.path.join(args.workdir, "quick.json") if args.quick else
                            os.path.join(ROOT, "benchmarks", "results", f"mismatch_grad_{date}.json"))
    t0 = time.perf_counter()

    model = mm.ensure_model(None)
    all_settings = mm.settings("fp32")
    losses = {}
    for name in args.settings:
        if name in EXTRA_SETTINGS:
            losses[name] = EXTRA_SETTINGS[name]
        elif name in all_settings and all_settings[name]["engine_dtype"] is not None:
            losses[name] = all_settings[name]["loss"]
        else:
            raise SystemExit(f"unknown setting {name!r}")
    # the trainer of mismatch.py's "standard" setting (fp32 engine); the loss is swapped per gradient
    train_setting = all_settings[args.train_setting or "standard"]
    cfg = mm.build_config(model, args.workdir, train_setting, steps=max(1, args.train_steps), eval_interval=None,
                          lr=args.lr, temperature=args.temperature)
    trainer = Trainer(cfg)
    noise = mm.add_engine_noise(trainer, args.noise, args.noise_seed, redraw=args.redraw,
                                norm_scale=args.engine_norm_scale)
    trained = []
    clean_training = train_setting["engine_dtype"] is None  # matched_standard: train with the clean engine
    noise.enabled = not clean_training
    trainer.sync_weights()
    for i in range(args.train_steps):  # mismatch.py's run_setting, without eval
        m = trainer.step()
        trained.append({k: float(v) for k, v in m.items() if k.startswith(mm.KEEP_PREFIXES)})
        print(f"[train {args.train_setting} {i + 1}/{args.train_steps}] reward={m['rollout/raw_reward']:.3f} "
              f"k3={m.get('train/mismatch_k3_kl', float('nan')):.3f} grad_norm={m['train/grad_norm']:.3f}", flush=True)
    noise.enabled = True
    n_prompts = args.prompts or cfg.rollout.rollout_batch_size
    if args.prompt_skip:
        trainer.dataset.next_batch(args.prompt_skip)
    items = trainer.dataset.next_batch(n_prompts)
    probe = GradProbe(trainer, noise, items)
    std = {}  # the standard loss for the reference

    # g_true: mean of ref_draws clean-engine batches, standard loss (on-policy: old == current == engine)
    ref_grads, ref_info = [], []
    for d in range(args.ref_draws):
        batch = probe.sample(clean=True, draw_id=d)
        packs, old = probe.prepare(batch)
        g, m = probe.grad(packs, old, std)
        ref_grads.append(g)
        ref_info.append({"reward": batch.metrics["rollout/raw_reward"],
                         "abs_logprob_diff": m.get("train_rollout_logprob_abs_diff", float("nan")),
                         "norm": float(g.norm())})
        print(f"[ref {d + 1}/{args.ref_draws}] reward={ref_info[-1]['reward']:.3f} "
              f"|old-rollout|={ref_info[-1]['abs_logprob_diff']:.2e} |g|={g.norm():.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    g_true = torch.stack(ref_grads).mean(0)
    half = len(ref_grads) // 2
    split_half = cos(torch.stack(ref_grads[:half]).mean(0), torch.stack(ref_grads[half:]).mean(0)) if half else None

    per = {name: {"cos": [], "norm": [], "metrics": []} for name in ["matched", *losses]}
    grads = {name: [] for name in per}
    tok = []
    for d in range(args.draws):
        batch = probe.sample(clean=True, draw_id=args.ref_draws + d)  # independent clean draw: the noise floor
        packs, old = probe.prepare(batch)
        g, m = probe.grad(packs, old, std)
        grads["matched"].append(g)
        per["matched"]["cos"].append(cos(g, g_true))
        per["matched"]["norm"].append(float(g.norm()))
        per["matched"]["metrics"].append({"reward": batch.metrics["rollout/raw_reward"]})
        batch = probe.sample(clean=False, draw_id=d)
        packs, old = probe.prepare(batch)
        ts = token_stats(packs, old)
        ts["reward"] = batch.metrics["rollout/raw_reward"]
        for name, overrides in losses.items():
            g, m = probe.grad(packs, old, overrides)
            grads[name].append(g)
            per[name]["cos"].append(cos(g, g_true))
            per[name]["norm"].append(float(g.norm()))
            keep = {k: v for k, v in m.items() if k.startswith(("mis_", "tis", "mismatch_k3", "pg_loss", "ppo_kl"))}
            per[name]["metrics"].append(keep)
            if name == "mis" and "mis_rs_catastrophic_seq_fraction" in m:
                ts["frac_seq_with_veto_token(w<1e-4)"] = m["mis_rs_catastrophic_seq_fraction"]
        tok.append(ts)
        print(f"[draw {d + 1}/{args.draws}] engine reward={ts['reward']:.3f} k3={ts['k3_kl']:.3f} "
              f"low={ts['frac_w_low(<0.5, engine over-samples)']:.3f} "
              + " ".join(f"{n}: cos={per[n]['cos'][-1]:.3f} |g|={per[n]['norm'][-1]:.3f}" for n in per)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)

    summary = {}
    for name in per:
        gm = torch.stack(grads[name]).mean(0)
        summary[name] = {
            "cos_to_g_true": mean_sd(per[name]["cos"]),
            "norm": mean_sd(per[name]["norm"]),
            "cos_of_mean_over_draws": cos(gm, g_true),
            "norm_of_mean_over_draws": float(gm.norm()),
            "cos_of_mean_to_matched_mean": cos(gm, torch.stack(grads["matched"]).mean(0)),
            # the cosine of the EXPECTED gradient of this setting to the expected on-policy gradient, with the
            # sampling noise of both removed (independent-pair dot products): the bias; matched should read ~1
            "cos_expected_to_g_true": expected_cos(grads[name], ref_grads),
            "norm_expected": math.sqrt(max(pair_dot(grads[name]), 0.0)),
        }
    # pairwise cosines of the per-setting means (how different the directions are from each other)
    names = list(per)
    means = {n: torch.stack(grads[n]).mean(0) for n in names}
    pairwise = {f"{a} vs {b}": cos(means[a], means[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    tok_mean = {k: float(np.nanmean([t[k] for t in tok if t[k] is not None])) if any(t[k] is not None for t in tok)
                else None for k in tok[0]}

    result = {
        "what": "issue 25: cosine of the loss gradient from perturbed-engine samples to the clean policy's on-policy "
                f"GRPO gradient; cpu_demo SFT, fp32 engine with weights * (1 + {args.noise} N(0,1)), fixed draw",
        "provenance": mm.provenance(argv) | {"command": " ".join(["benchmarks/mismatch_grad.py", *argv])},
        "args": vars(args),
        "config": {"rollout_batch_size": n_prompts, "n_samples_per_prompt": probe.n, "global_batch_size": probe.gbs,
                   "temperature": cfg.rollout.temperature, "loss_aggregation": cfg.loss.loss_aggregation,
                   "eps_clip": cfg.loss.eps_clip, "losses": {k: str(v) for k, v in losses.items()},
                   "num_params": int(g_true.numel())},
        "g_true": {"draws": args.ref_draws, "samples": args.ref_draws * n_prompts * probe.n,
                   "norm": float(g_true.norm()), "split_half_cos": split_half,
                   "norm_expected": math.sqrt(max(pair_dot(ref_grads), 0.0)),
                   "mean_reward": float(np.mean([r["reward"] for r in ref_info])),
                   "max_abs_logprob_diff_clean_engine": float(np.nanmax([r["abs_logprob_diff"] for r in ref_info])),
                   "per_draw": ref_info},
        "summary": summary,
        "pairwise_cos_of_means": pairwise,
        "trained_steps": trained,
        "perturbed_token_stats_mean": tok_mean,
        "perturbed_token_stats": tok,
        "per_draw": per,
        "wall_s": time.perf_counter() - t0,
    }
    trainer.close()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    print(json.dumps({"g_true": {k: v for k, v in result["g_true"].items() if k != "per_draw"},
                      "summary": {n: {"cos": f"{s['cos_to_g_true']['mean']:.3f} +- {s['cos_to_g_true']['sd']:.3f}",
                                      "norm": f"{s['norm']['mean']:.3f} +- {s['norm']['sd']:.3f}",
                                      "cos_of_mean": round(s["cos_of_mean_over_draws"], 3),
                                      "cos_expected": round(s["cos_expected_to_g_true"], 3),
                                      "norm_expected": round(s["norm_expected"], 3)}
                                  for n, s in summary.items()},
                      "pairwise": {k: round(v, 3) for k, v in pairwise.items()},
                      "tokens": tok_mean}, indent=1), flush=True)
    print(f"[mismatch_grad] wrote {out_path} ({result['wall_s']:.0f} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
