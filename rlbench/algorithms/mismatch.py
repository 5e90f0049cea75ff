"""Train–inference mismatch: diagnostics, vanilla TIS and masked importance sampling (MIS).

Three modes (`LossConfig.mode`):
    standard   old = recomputed log-probs; no IS weights
    bypass     old = rollout log-probs (`use_rollout_logprobs`); no recompute, no IS
    decoupled  old = recomputed log-probs, and the loss is weighted by w = π_old/π_rollout (`use_tis`),
               vanilla TIS (clamp(w, tis_clip_low, tis_clip)) or MIS (`LossConfig.mis`)
Unlike slime's FSDP actor, w is built from the DETACHED recomputed old log-probs (not the gradient-carrying
current ones), and is computed ONCE per step over every response token of the global batch, before
micro-batching; so MIS batch normalisation spans the global batch. With several DP ranks, call
`compute_is_weights` once per rank to get `batch_stats`, all-reduce(SUM) them, and call it again with the
summed stats (`LossInputs` building does the second call).

All outputs are per-token `[R]` tensors without gradient; metric tensors are averaged later with the loss
token weights. Per-sequence metrics (`SEQUENCE_METRICS`: a sequence's PPL, PPL ratio, chi2_seq, the vetoed
fraction of sequences, the batch-norm factor) are broadcast to their tokens and averaged over the sequences
that have at least one trained token (`aggregation.sequence_metric_weights`): an empty row has no PPL and does
not count; with no trained token in the whole global batch they read NaN.

Untrained tokens are never read by a reduction: every per-sequence sum/mean and the MIS batch statistics
zero them with torch.where first, so a −inf/NaN log-prob there (a padded token) changes no weight of a trained
token, no per-sequence value and no batch statistic. The per-token outputs AT untrained positions are
unspecified (NaN if the inputs are); `PolicyLoss` zeroes them before use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .aggregation import segment_masked_mean, segment_sum, zero_masked

if TYPE_CHECKING:
    from rlbench.configs.loss import LossConfig, MISConfig

SAFETY_BOUND = 20.0  # clamp on log importance ratios before exp (as slime)

SEQUENCE_METRICS = frozenset({
    "mismatch_training_log_ppl", "mismatch_rollout_log_ppl", "mismatch_training_ppl", "mismatch_rollout_ppl",
    "mismatch_log_ppl_diff", "mismatch_log_ppl_abs_diff", "mismatch_ppl_ratio", "mismatch_chi2_seq",
    "mis_rs_catastrophic_seq_fraction", "mis_batch_norm_factor",
})
"""Metrics with one value per sequence (or per batch): averaged over the sequences with a trained token."""


@dataclass
class ISResult:
    """IS weights and per-token diagnostics for the response tokens of a step."""

    weights: torch.Tensor | None
    """`[R]` detached weights to multiply the per-token policy loss by (None: no IS)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """`{name: [R]}` detached per-token values, to be averaged with the token weights."""
    batch_stats: torch.Tensor | None = None
    """`[2]` (Σ, count) behind MIS batch normalisation; all-reduce(SUM) across DP ranks."""


def mismatch_metrics(old, rollout, mask, seq_ids, n_seqs) -> dict[str, torch.Tensor]:
    """Per-token diagnostics of π_old (trainer) vs π_rollout (engine); Δ = old − rollout."""
    delta = (old - rollout).detach()
    m = mask.to(delta.dtype)
    train_lp = -segment_masked_mean(old.detach(), m, seq_ids, n_seqs)  # [n] log-ppl
    roll_lp = -segment_masked_mean(rollout.detach(), m, seq_ids, n_seqs)  # [n]
    seq_log_ratio = segment_sum(zero_masked(delta * m, m), seq_ids, n_seqs).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [n]
    rho = torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return {
        "train_rollout_logprob_abs_diff": delta.abs(),
        "mismatch_kl": -delta,  # k1 estimate of KL(π_rollout ‖ π_old) under rollout samples
        "mismatch_k3_kl": rho - 1.0 - delta,
        "mismatch_training_log_ppl": train_lp[seq_ids],
        "mismatch_rollout_log_ppl": roll_lp[seq_ids],
        "mismatch_training_ppl": train_lp.exp()[seq_ids],
        "mismatch_rollout_ppl": roll_lp.exp()[seq_ids],
        "mismatch_log_ppl_diff": (train_lp - roll_lp)[seq_ids],
        "mismatch_log_ppl_abs_diff": (train_lp - roll_lp).abs()[seq_ids],
        "mismatch_ppl_ratio": (train_lp - roll_lp).exp()[seq_ids],
        "mismatch_chi2_token": rho * rho - 1.0,
        "mismatch_chi2_seq": (2.0 * seq_log_ratio).exp()[seq_ids] - 1.0,
    }


def vanilla_tis(old, rollout, mask, seq_ids, n_seqs, low: float, high: float) -> ISResult:
    """w = exp(old − rollout), weight = clamp(w, low, high); metrics tis, tis_clipfrac, tis_abs."""
    w = torch.exp((old - rollout).detach().clamp(-SAFETY_BOUND, SAFETY_BOUND))
    wt = w.clamp(low, high)
    metrics = {"tis": w, "tis_clipfrac": (wt != w).to(w.dtype), "tis_abs": (w - 1.0).abs()}
    return ISResult(wt, metrics)


def _level_log_ratio(delta, m, seq_ids, n_seqs, level: str) -> torch.Tensor:
    """`[R]` log-ratio at token / sequence (Σ) / geometric (mean) level, clamped to ±SAFETY_BOUND."""
    if level == "token":
        lr = delta
    elif level == "sequence":
        lr = segment_sum(zero_masked(delta * m, m), seq_ids, n_seqs)[seq_ids]
    else:
        lr = segment_masked_mean(delta, m, seq_ids, n_seqs)[seq_ids]
    return lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def _mis_is(w, keep, mcfg: MISConfig, metrics: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the IS mode; returns (bounded weights, updated keep mask)."""
    lo, hi = mcfg.tis_lower_bound, mcfg.tis_upper_bound
    f = w.dtype
    metrics["mis_tis_weight_before_bound"] = w
    if mcfg.tis_mode == "truncate":
        metrics["mis_tis_truncate_fraction"] = (w > hi).to(f)
        w = w.clamp(max=hi)
    elif mcfg.tis_mode == "clip":
        metrics["mis_tis_clip_fraction_low"] = (w < lo).to(f)
        metrics["mis_tis_clip_fraction_high"] = (w > hi).to(f)
        w = w.clamp(lo, hi)
    else:  # mask
        metrics["mis_tis_mask_fraction_low"] = (w < lo).to(f)
        metrics["mis_tis_mask_fraction_high"] = (w > hi).to(f)
        keep = keep * ((w >= lo) & (w <= hi)).to(f)
    metrics["mis_tis_weight_after_bound"] = w
    return w, keep


def _mis_rs(delta, m, seq_ids, n_seqs, keep, mcfg: MISConfig, metrics: dict) -> torch.Tensor:
    """Rejection sampling by bounds at `rs_level`, then the catastrophic-token veto of whole sequences."""
    f = delta.dtype
    w = torch.exp(_level_log_ratio(delta, m, seq_ids, n_seqs, mcfg.rs_level))
    low, high = w < mcfg.rs_lower_bound, w > mcfg.rs_upper_bound
    metrics["mis_rs_mask_fraction_low"] = low.to(f)
    metrics["mis_rs_mask_fraction_high"] = high.to(f)
    keep = keep * (~(low | high)).to(f)
    if mcfg.rs_veto_threshold is not None:
        bad_tok = (delta < math.log(mcfg.rs_veto_threshold)) & (m > 0)  # [R]
        bad_seq = segment_sum(bad_tok.to(f), seq_ids, n_seqs)[seq_ids] > 0  # [R]
        metrics["mis_rs_catastrophic_token_fraction"] = bad_tok.to(f)
        metrics["mis_rs_catastrophic_seq_fraction"] = bad_seq.to(f)
        keep = keep * (~bad_seq).to(f)
    return keep


def _mis_batch_stats(w, keep_m, seq_ids, n_seqs, level: str) -> torch.Tensor:
    """`[2]` (Σ, count): token level Σ w over kept tokens; sequence level Σ of per-sequence kept means."""
    if level == "token":
        return torch.stack([zero_masked(w * keep_m, keep_m).sum(), keep_m.sum()])
    seq_mean = segment_masked_mean(w, keep_m, seq_ids, n_seqs)  # [n]
    valid = (segment_sum(keep_m, seq_ids, n_seqs) > 0).to(w.dtype)
    return torch.stack([(seq_mean * valid).sum(), valid.sum()])


def mis_weights(old, rollout, mask, seq_ids, n_seqs, mcfg: MISConfig, batch_stats=None) -> ISResult:
    """Masked importance sampling (slime mis.py) over the given tokens; see the module docstring."""
    delta = (old - rollout).detach()
    m = mask.to(delta.dtype)
    metrics: dict[str, torch.Tensor] = {}
    keep = torch.ones_like(m)
    w = torch.ones_like(m)
    if mcfg.use_tis:
        w, keep = _mis_is(torch.exp(_level_log_ratio(delta, m, seq_ids, n_seqs, mcfg.tis_level)), keep, mcfg, metrics)
    if mcfg.use_rs:
        keep = _mis_rs(delta, m, seq_ids, n_seqs, keep, mcfg, metrics)
    w = w * keep
    metrics["mis_is_ratio_mean_after_tis_rs"] = w
    stats = None
    if mcfg.use_tis and mcfg.tis_batch_normalize:
        stats = _mis_batch_stats(w, keep * m, seq_ids, n_seqs, mcfg.tis_level)
        total = stats if batch_stats is None else batch_stats.to(w.dtype)
        mean = total[0] / total[1].clamp_min(1.0)
        factor = mean if mean > 1e-8 else torch.ones_like(mean)
        w = w / factor
        metrics["mis_batch_norm_factor"] = factor.expand_as(w)
    metrics["mis_is_ratio_mean_final"] = w
    return ISResult(w, metrics, stats)


def compute_is_weights(
    cfg: LossConfig,
    old_log_probs: torch.Tensor | None,
    rollout_log_probs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    n_seqs: int,
    batch_stats: torch.Tensor | None = None,
) -> ISResult:
    """IS weights and mismatch diagnostics for ALL response tokens of a step (`[R]` each).

    Args:
        old_log_probs: `[R]` recomputed π_old (None in bypass mode).
        rollout_log_probs: `[R]` engine log-probs (None when the engine returned none).
        batch_stats: DP-summed `ISResult.batch_stats`; None uses the local ones (single process).
    """
    if cfg.use_tis and (old_log_probs is None or rollout_log_probs is None):
        raise ValueError("use_tis=True needs both recomputed old log-probs and rollout log-probs")
    if cfg.use_rollout_logprobs or old_log_probs is None or rollout_log_probs is None:
        return ISResult(None)
    diag = mismatch_metrics(old_log_probs, rollout_log_probs, loss_mask, seq_ids, n_seqs)
    if not cfg.use_tis:
        return ISResult(None, diag)
    if cfg.mis is None:
        res = vanilla_tis(old_log_probs, rollout_log_probs, loss_mask, seq_ids, n_seqs, cfg.tis_clip_low, cfg.tis_clip)
    else:
        res = mis_weights(old_log_probs, rollout_log_probs, loss_mask, seq_ids, n_seqs, cfg.mis, batch_stats)
    res.metrics.update(diag)
    return res
