"""Reward-model training: a value model (decoder + scalar head) fitted to preference pairs with the Bradley-Terry loss.

    metrics = run_rm(RMTrainConfig(data="prefs.jsonl", model="runs/sft", out="runs/rm", epochs=2))
    rlbench rm --data prefs.jsonl --hf-checkpoint runs/sft --out runs/rm --epochs 2

Each optimizer step takes `batch_size` pairs, packs them (a pair's chosen and rejected sequence in one micro-batch,
`rlbench.reward_model.scoring`), scores every sequence at its last token and adds, per micro-batch, the
Bradley-Terry loss of its pairs over the step's pair count (`rlbench.algorithms.preference.bradley_terry_loss`,
`n_pairs`): the step's gradient is the mean over its pairs, however they fell into micro-batches. AdamW, linear warm-up then
cosine to 10 %. Before training and after every epoch the held-out pairs are scored: `rm/eval_accuracy` (chosen
scored strictly above rejected), `rm/eval_loss`, `rm/eval_margin` (mean chosen - rejected).

The output directory is a value-model directory (`rlbench.models.value_head`: an HF token-classification model,
the critic's layout, + tokenizer + `version.json` with the version, `kind: "reward"`, the data and the last held-out
accuracy) plus `rm_metrics.json` (config and per-epoch history); `--reward-model DIR` serves it in an RL run
(`rlbench.reward_model.serve`), `--critic-load DIR` starts a PPO critic from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import numpy as np
import torch

from rlbench.algorithms.preference import bradley_terry_loss
from rlbench.configs.reward_model import RMTrainConfig
from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import build_config, load_tokenizer
from rlbench.models.value_head import build_value_model, load_value_model, save_value_model
from rlbench.reward_model.data import PreferencePair, encode_pair, load_preferences, render_prompt
from rlbench.reward_model.scoring import pack_units, sequence_scores


def split_pairs(cfg: RMTrainConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs: `eval_data` when given, else a seeded `eval_fraction` of `data` (at least one)."""
    pairs = load_preferences(cfg.data)
    if cfg.eval_data is not None:
        return pairs, load_preferences(cfg.eval_data)
    if len(pairs) < 2:
        raise ValueError(f"{cfg.data} has {len(pairs)} pair; a held-out split needs at least 2 (or give eval_data)")
    order = np.random.default_rng(cfg.seed).permutation(len(pairs))
    n_eval = min(len(pairs) - 1, max(1, round(cfg.eval_fraction * len(pairs))))
    return [pairs[i] for i in sorted(order[n_eval:])], [pairs[i] for i in sorted(order[:n_eval])]


def build_rm(cfg: RMTrainConfig) -> tuple[torch.nn.Module, object]:
    """(value model, tokenizer): the directory's (its head too when it is a value model, else a zero head), or a
    preset's random init (zero head) with the char-level tokenizer sized to the preset's vocabulary."""
    if os.path.isdir(cfg.model):
        return load_value_model(cfg.model, device=cfg.device), load_tokenizer(cfg.model)
    tokenizer = build_tokenizer(build_config(cfg.model).vocab_size)
    return build_value_model(cfg.model, device=cfg.device, seed=cfg.seed), tokenizer


def encode_pairs(pairs: list[PreferencePair], tokenizer, apply_chat_template: bool) -> list[list[int]]:
    """Token ids `[chosen_0, rejected_0, chosen_1, ...]` (`encode_pair`; a prompt rendered once per pair)."""
    out = []
    for p in pairs:
        try:
            prompt = render_prompt(tokenizer, p.prompt, apply_chat_template)
        except ValueError as exc:
            raise ValueError(f"{p.where}: {exc}") from exc
        out += [encode_pair(tokenizer, prompt, p.chosen), encode_pair(tokenizer, prompt, p.rejected)]
    return out


def pair_scores(model, seqs: list[list[int]], pairs: list[int], max_tokens: int, pad_id: int):
    """Yield `(pair indices [m], chosen [m], rejected [m])` per packed micro-batch of `pairs` (indices into the
    pair list; `seqs[2i]`, `seqs[2i+1]` are pair i's sequences)."""
    local = [s for i in pairs for s in (seqs[2 * i], seqs[2 * i + 1])]
    for pack in pack_units(local, [[2 * j, 2 * j + 1] for j in range(len(pairs))], max_tokens=max_tokens,
                           pad_token_id=pad_id):
        scores = sequence_scores(model, pack)  # [n]
        ids = torch.tensor(pack.sample_ids)
        chosen = scores[(ids % 2 == 0).nonzero().squeeze(1)]  # pairs in pack order: chosen then rejected
        rejected = scores[(ids % 2 == 1).nonzero().squeeze(1)]
        yield [pairs[i] for i in (ids[ids % 2 == 0] // 2).tolist()], chosen, rejected


def margins_of(pairs: list[PreferencePair], idx: list[int], device) -> torch.Tensor | None:
    """`[m]` margins of those pairs, or None when no pair in the data has one."""
    if all(pairs[i].margin is None for i in idx):
        return None
    return torch.tensor([pairs[i].margin or 0.0 for i in idx], dtype=torch.float32, device=device)


def train_step(model, opt, pairs: list[PreferencePair], seqs, batch: list[int], cfg: RMTrainConfig, pad_id: int) -> dict:
    """One AdamW step over `batch` (pair indices); returns its loss, pair accuracy and margin (means over the batch:
    every micro-batch's loss is normalised by the step's pair count, so the gradient does not depend on packing)."""
    opt.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    for idx, chosen, rejected in pair_scores(model, seqs, batch, cfg.max_tokens, pad_id):
        loss, metrics = bradley_terry_loss(chosen, rejected, margins_of(pairs, idx, chosen.device), n_pairs=len(batch))
        loss.backward()
        for k in ("loss", "accuracy", "margin"):
            totals[k] = totals.get(k, 0.0) + float(metrics[k])
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
    opt.step()
    return totals


@torch.no_grad()
def evaluate(model, pairs: list[PreferencePair], seqs, cfg: RMTrainConfig, pad_id: int) -> dict[str, float]:
    """`rm/eval_accuracy` (chosen scored strictly above rejected), `rm/eval_loss`, `rm/eval_margin` (mean
    chosen - rejected) over every held-out pair."""
    was = model.training
    model.eval()
    totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
    for idx, c, r in pair_scores(model, seqs, list(range(len(pairs))), cfg.max_tokens, pad_id):
        _, metrics = bradley_terry_loss(c, r, margins_of(pairs, idx, c.device), n_pairs=len(pairs))
        for k in totals:
            totals[k] += float(metrics[k])
    model.train(was)
    return {f"rm/eval_{k}": v for k, v in totals.items()}


def lr_lambda(cfg: RMTrainConfig, total_steps: int):
    """Linear warm-up over `warmup_steps`, then cosine from 1 to 0.1 at `total_steps`."""
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return fn


def run_rm(cfg: RMTrainConfig) -> dict:
    """Train, evaluate after every epoch, save; returns the last epoch's flat metrics plus `history` and `version`
    (None when `out` is None)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but CUDA is not available; use device='cpu'")
    start = time.perf_counter()
    train_pairs, eval_pairs = split_pairs(cfg)
    torch.manual_seed(cfg.seed)
    model, tokenizer = build_rm(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_seqs = encode_pairs(train_pairs, tokenizer, cfg.apply_chat_template)
    eval_seqs = encode_pairs(eval_pairs, tokenizer, cfg.apply_chat_template)
    steps_per_epoch = -(-len(train_pairs) // cfg.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, cfg.epochs * steps_per_epoch))
    rng = np.random.default_rng([cfg.seed, 2])
    history = [{"rm/epoch": 0.0} | evaluate(model, eval_pairs, eval_seqs, cfg, pad_id)]
    model.train()
    for epoch in range(1, cfg.epochs + 1):
        order = rng.permutation(len(train_pairs)).tolist()
        stats = []
        for i in range(0, len(order), cfg.batch_size):
            stats.append(train_step(model, opt, train_pairs, train_seqs, order[i : i + cfg.batch_size], cfg, pad_id))
            sched.step()
        record = {"rm/epoch": float(epoch), "rm/train_loss": float(np.mean([s["loss"] for s in stats])),
                  "rm/train_accuracy": float(np.mean([s["accuracy"] for s in stats])),
                  "rm/train_margin": float(np.mean([s["margin"] for s in stats])),
                  "rm/steps": float(epoch * steps_per_epoch)}
        history.append(record | evaluate(model, eval_pairs, eval_seqs, cfg, pad_id)
                       | {"perf/wall_s": time.perf_counter() - start})
        print(" ".join(f"{k}={v:.4g}" for k, v in history[-1].items()), flush=True)
    metrics = dict(history[-1]) | {"history": history, "rm/train_pairs": len(train_pairs),
                                   "rm/eval_pairs": len(eval_pairs), "version": None}
    if cfg.out:
        metrics["version"] = save_rm(model, tokenizer, cfg, metrics)
    return metrics


def save_rm(model, tokenizer, cfg: RMTrainConfig, metrics: dict) -> str:
    """Write the model (value-model layout, `kind: "reward"`) and `rm_metrics.json` to `cfg.out`; returns the
    version."""
    meta = {"kind": "reward", "data": os.path.abspath(cfg.data), "eval_accuracy": metrics["rm/eval_accuracy"],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    version = save_value_model(model, tokenizer, cfg.out, meta)
    with open(os.path.join(cfg.out, "rm_metrics.json"), "w", encoding="utf-8") as f:
        json.dump(metrics | {"version": version, "config": dataclasses.asdict(cfg)}, f, indent=1)
    return version
