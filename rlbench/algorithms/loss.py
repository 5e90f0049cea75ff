"""The total policy loss of one micro-batch, built once from a `LossConfig`.

    loss = Σ_t w_t · (is_t · pg_t)  +  kl_loss_coef · Σ_t w_t · kl_t  −  entropy_coef · Σ_t w_t · H_t

`w` are the per-token weights of `loss_token_weights` (normalised over the global batch), `is` the detached
IS weights of the step (1 without TIS/MIS), `pg` the chosen policy loss (OPSM-masked when enabled).
Metrics are weighted sums too, so summing them over micro-batches and DP ranks gives the global value. Their
keys are bare names (`pg_loss`, `ppo_kl`, ...): the training backend sums them and owns the `train/` prefix.
Per-sequence metrics (`mismatch.SEQUENCE_METRICS`) use `LossInputs.seq_metric_weights`: a mean over the
sequences with at least one trained token (NaN when the global batch has none).

Untrained tokens (loss mask 0) are zeroed (torch.where) in every input before any arithmetic — current, old,
ref and rollout log-probs, advantages, entropy, IS weights, precomputed metrics — so a −inf log-prob of a
padded token or a NaN advantage there leaves the loss, its gradient (0 on those tokens) and the metrics finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from rlbench.configs.loss import LossConfig

from .aggregation import (
    GlobalNorm,
    loss_token_weights,
    seq_ids_from_lengths,
    sequence_metric_weights,
    zero_masked,
)
from .kl import make_kl_fn
from .mismatch import SEQUENCE_METRICS, compute_is_weights
from .policy_loss import POLICY_LOSS_FNS, opsm_keep_mask


@dataclass
class LossInputs:
    """Everything but the current log-probs that one micro-batch's loss needs, in response space `[R]`."""

    old_log_probs: torch.Tensor | None
    """`[R]` π_old: recomputed (standard/decoupled) or rollout (bypass) log-probs; None with `old_from_forward`."""
    advantages: torch.Tensor
    """`[R]` per-token advantages."""
    loss_mask: torch.Tensor
    """`[R]` 0/1 trained-token mask."""
    token_weights: torch.Tensor
    """`[R]` loss weights from `loss_token_weights` (global-batch normaliser)."""
    response_lengths: list[int]
    """Response length of each sequence of the micro-batch (sums to R)."""
    ref_log_probs: torch.Tensor | None = None
    """`[R]` reference-model log-probs (needed by the KL loss)."""
    rollout_log_probs: torch.Tensor | None = None
    """`[R]` rollout-engine log-probs (informational here; IS weights are precomputed)."""
    is_weights: torch.Tensor | None = None
    """`[R]` detached TIS/MIS weights (None: no importance weighting)."""
    token_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """`{name: [R]}` precomputed per-token diagnostics (mismatch, TIS/MIS), averaged with metric_weights."""
    metric_weights: torch.Tensor | None = None
    """`[R]` weights for metrics when they differ from token_weights (seq_sum_constant); None: same."""
    seq_metric_weights: torch.Tensor | None = None
    """`[R]` weights of the per-sequence metrics (`SEQUENCE_METRICS`) of token_metrics: `sequence_metric_weights`
    (mean over the sequences with a trained token; NaN if none). Required when there are such metrics (the
    loss weights would count the empty rows); `build_loss_inputs` sets it."""
    old_from_forward: bool = False
    """π_old is this micro-batch's own training forward (`log_probs.detach()`): the policy has not changed since
    the rollout (the first optimizer step of a rollout), so no separate old-log-prob pass ran; IS weights and
    mismatch metrics are computed from it in the loss call (`with_old`)."""
    seq_ids: torch.Tensor = field(init=False)
    """`[R]` long, sequence index of each token (derived)."""

    def __post_init__(self) -> None:
        self.seq_ids = seq_ids_from_lengths(self.response_lengths, device=self.loss_mask.device)
        R = self.seq_ids.numel()
        names = ("old_log_probs", "advantages", "loss_mask", "token_weights", "ref_log_probs", "rollout_log_probs",
                 "is_weights", "metric_weights", "seq_metric_weights")
        for name in names:
            t = getattr(self, name)
            if t is not None and t.shape != (R,):
                raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}, expected [{R}] (sum of lengths)")
        if (self.old_log_probs is None) != self.old_from_forward:
            raise ValueError("LossInputs: give old_log_probs, or set old_from_forward=True (old = the training "
                             "forward's own log-probs), not both or neither")

    def with_old(self, old: torch.Tensor, cfg: LossConfig) -> LossInputs:
        """A copy with π_old = `old` (detached) and the IS weights / mismatch metrics it implies (per sequence:
        the same values a whole-step computation gives, `old_from_forward_ok`)."""
        old = old.detach()
        res = compute_is_weights(cfg, old, self.rollout_log_probs, self.loss_mask, self.seq_ids, self.n_seqs)
        return replace(self, old_log_probs=old, is_weights=res.weights, token_metrics=res.metrics,
                       old_from_forward=False)

    @property
    def n_seqs(self) -> int:
        return len(self.response_lengths)

    def to(self, device) -> LossInputs:
        """A copy with every tensor on `device` (non-blocking)."""
        def mv(t):
            return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

        return LossInputs(
            mv(self.old_log_probs), mv(self.advantages), mv(self.loss_mask), mv(self.token_weights),
            list(self.response_lengths), mv(self.ref_log_probs), mv(self.rollout_log_probs), mv(self.is_weights),
            {k: mv(v) for k, v in self.token_metrics.items()}, mv(self.metric_weights), mv(self.seq_metric_weights),
            self.old_from_forward,
        )


class PolicyLoss:
    """`loss, metrics = PolicyLoss(cfg)(log_probs [R], entropy [R] | None, inputs)`; variants picked once."""

    def __init__(self, cfg: LossConfig):
        self.cfg = cfg
        self._pg = POLICY_LOSS_FNS[cfg.policy_loss]
        self._kl = make_kl_fn(cfg.kl_loss_type, cfg.use_unbiased_kl) if cfg.use_kl_loss else None
        self._opsm_delta = cfg.opsm_delta if cfg.use_opsm else None

    def __call__(
        self, log_probs: torch.Tensor, entropy: torch.Tensor | None, inputs: LossInputs
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = inputs.with_old(log_probs, self.cfg) if inputs.old_from_forward else inputs
        dt = log_probs.dtype
        w = x.token_weights.to(dt)
        mw = w.detach() if x.metric_weights is None else x.metric_weights.to(dt)
        sw = None if x.seq_metric_weights is None else x.seq_metric_weights.to(dt)
        mask = x.loss_mask.to(dt)

        def z(t):  # untrained tokens -> 0 before any arithmetic (where: no NaN into values or gradients)
            return zero_masked(t.to(dt), mask)

        log_probs, old, adv = z(log_probs), z(x.old_log_probs), z(x.advantages)
        pg, tok = self._pg(log_probs, old, adv, mask, x.seq_ids, x.n_seqs, self.cfg)
        if self._opsm_delta is not None:
            keep = opsm_keep_mask(log_probs, old, adv, mask, x.seq_ids, x.n_seqs, self._opsm_delta)
            pg, tok["opsm_clipfrac"] = pg * keep, 1.0 - keep
        if x.is_weights is not None:
            pg = pg * z(x.is_weights)
        loss = (w * pg).sum()
        tok["pg_loss"] = pg.detach()
        if self._kl is not None:
            if x.ref_log_probs is None:
                raise ValueError("use_kl_loss=True but LossInputs.ref_log_probs is None; compute ref log-probs")
            kl = self._kl(log_probs, z(x.ref_log_probs), old)
            loss = loss + self.cfg.kl_loss_coef * (w * kl).sum()
            tok["kl_loss"] = kl.detach()
        if entropy is not None:
            entropy = z(entropy)
            if self.cfg.entropy_coef != 0:
                loss = loss - self.cfg.entropy_coef * (w * entropy).sum()
            tok["entropy"] = entropy.detach()
        elif self.cfg.entropy_coef != 0:
            raise ValueError(f"entropy_coef={self.cfg.entropy_coef} but no entropy was passed")
        return loss, self._metrics(loss, log_probs, old, mask, mw, sw, tok, x.token_metrics)

    @staticmethod
    @torch.no_grad()
    def _metrics(loss, log_probs, old, mask, mw, sw, tok, precomputed) -> dict[str, torch.Tensor]:
        tok["ois"] = torch.exp(log_probs.detach() - old)
        out = {"loss": loss.detach()}
        for name, v in (*tok.items(), *precomputed.items()):
            weights = sw if name in SEQUENCE_METRICS else mw
            if weights is None:
                raise ValueError(f"per-sequence metric {name!r} but LossInputs.seq_metric_weights is None: pass "
                                 "sequence_metric_weights(loss_mask, lengths, norm) (build_loss_inputs does)")
            out[name] = (weights * zero_masked(v.to(mw.dtype), mask)).sum()
        out["ppo_kl_abs"] = (mw * tok["ppo_kl"].abs()).sum()
        return out


def build_loss(cfg: LossConfig) -> PolicyLoss:
    """The policy loss for `cfg`, with every variant resolved now (the hot path compares no strings)."""
    return PolicyLoss(cfg)


@dataclass
class ResponseBatch:
    """One micro-batch in response space, as the trainer has it after log-prob recompute."""

    loss_mask: torch.Tensor
    """`[R]` 0/1."""
    advantages: torch.Tensor
    """`[R]`."""
    response_lengths: list[int]
    """Per sequence; sums to R."""
    old_log_probs: torch.Tensor | None = None
    """`[R]` recomputed log-probs (None in bypass mode)."""
    rollout_log_probs: torch.Tensor | None = None
    """`[R]` engine log-probs."""
    ref_log_probs: torch.Tensor | None = None
    """`[R]` reference log-probs."""


def global_norm(cfg: LossConfig, micro_batches: Sequence[ResponseBatch]) -> GlobalNorm:
    """The counts of these micro-batches (combine/all-reduce across DP ranks before use)."""
    constant = cfg.loss_aggregation_constant or 1.0
    return GlobalNorm.from_masks(
        [mb.loss_mask for mb in micro_batches], [mb.response_lengths for mb in micro_batches], constant
    )


def old_from_forward_ok(cfg: LossConfig) -> bool:
    """Whether π_old may be each micro-batch's own training forward while the policy is unchanged.

    Everything computed from π_old (PPO ratio, TIS / MIS weights, mismatch diagnostics) is per token or per
    sequence, and sequences never straddle micro-batches, except MIS's batch normalisation, which needs the
    whole global batch's weights before the first micro-batch; bypass mode has no recomputed π_old at all;
    KL-in-reward (`kl_coef`) needs π_old of every token before the advantages, hence before any training forward.
    """
    if cfg.use_rollout_logprobs or cfg.kl_coef != 0:
        return False
    mis = cfg.mis
    return not (cfg.use_tis and mis is not None and mis.use_tis and mis.tis_batch_normalize)


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(t is None for t in tensors) else torch.cat(tensors)


def _step_is(cfg: LossConfig, mbs: Sequence[ResponseBatch], batch_stats):
    lengths = [n for mb in mbs for n in mb.response_lengths]
    mask = torch.cat([mb.loss_mask for mb in mbs])
    seq_ids = seq_ids_from_lengths(lengths, device=mask.device)
    old = _cat([mb.old_log_probs for mb in mbs])
    rollout = _cat([mb.rollout_log_probs for mb in mbs])
    return compute_is_weights(cfg, old, rollout, mask, seq_ids, len(lengths), batch_stats)


def is_batch_stats(cfg: LossConfig, micro_batches: Sequence[ResponseBatch]) -> torch.Tensor | None:
    """This rank's MIS batch-normalisation stats `[2]`; all-reduce(SUM) over DP, pass to build_loss_inputs."""
    return _step_is(cfg, micro_batches, None).batch_stats


def build_loss_inputs(
    cfg: LossConfig,
    micro_batches: Sequence[ResponseBatch],
    *,
    norm: GlobalNorm | None = None,
    batch_stats: torch.Tensor | None = None,
    old_from_forward: bool = False,
) -> list[LossInputs]:
    """`LossInputs` for each micro-batch of one optimizer step on this rank.

    IS weights and mismatch metrics are computed once over all of `micro_batches` (before splitting), or in each
    micro-batch's loss call when `old_from_forward`.
    Args:
        norm: the GLOBAL batch counts; None = these micro-batches are the whole global batch.
        batch_stats: DP-summed `is_batch_stats`; None = these micro-batches are the whole global batch.
        old_from_forward: π_old = each micro-batch's training forward (the policy is unchanged since the
            rollout); needs `old_from_forward_ok(cfg)`; the micro-batches carry no old log-probs.
    """
    norm = norm or global_norm(cfg, micro_batches)
    if cfg.use_rollout_logprobs and any(mb.rollout_log_probs is None for mb in micro_batches):
        raise ValueError("use_rollout_logprobs=True but a micro-batch has no rollout_log_probs")
    if old_from_forward:
        if not old_from_forward_ok(cfg):
            raise ValueError("old_from_forward=True with bypass mode or batch-normalised MIS weights: these need "
                             "the whole batch's old log-probs first; recompute them (compute_log_probs)")
        # the per-sequence mismatch metrics come in the loss call, when the rollout has log-probs
        return [_micro_batch_inputs(cfg, mb, norm, None, None, {}, seq_weights=mb.rollout_log_probs is not None,
                                    old_from_forward=True) for mb in micro_batches]
    if not cfg.use_rollout_logprobs and any(mb.old_log_probs is None for mb in micro_batches):
        raise ValueError("old_log_probs missing: recompute them, or set use_rollout_logprobs=True (bypass)")
    res = _step_is(cfg, micro_batches, batch_stats)
    sizes = [mb.loss_mask.numel() for mb in micro_batches]
    split = (lambda t: list(torch.split(t, sizes))) if sizes else (lambda t: [])
    is_w = split(res.weights) if res.weights is not None else [None] * len(sizes)
    per_mb_metrics = [dict(zip(res.metrics, vals)) for vals in zip(*(split(v) for v in res.metrics.values()))]
    per_mb_metrics = per_mb_metrics or [{} for _ in sizes]
    return [
        _micro_batch_inputs(cfg, mb, norm, mb.rollout_log_probs if cfg.use_rollout_logprobs else mb.old_log_probs,
                            w_is, tm, seq_weights=any(name in SEQUENCE_METRICS for name in tm))
        for mb, w_is, tm in zip(micro_batches, is_w, per_mb_metrics)
    ]


def _micro_batch_inputs(cfg: LossConfig, mb: ResponseBatch, norm: GlobalNorm, old, is_weights, token_metrics, *,
                        seq_weights: bool, old_from_forward: bool = False) -> LossInputs:
    """One micro-batch's `LossInputs`: its loss weights under `norm` (and the sample-mean metric weights of
    seq_sum_constant), plus the per-sequence metric weights when `seq_weights`."""
    tw = loss_token_weights(mb.loss_mask, mb.response_lengths, cfg.loss_aggregation, norm)
    mw = None
    if cfg.loss_aggregation == "seq_sum_constant":
        mw = loss_token_weights(mb.loss_mask, mb.response_lengths, "sample_mean", norm)
    sw = sequence_metric_weights(mb.loss_mask, mb.response_lengths, norm, dtype=tw.dtype) if seq_weights else None
    return LossInputs(old, mb.advantages, mb.loss_mask, tw, list(mb.response_lengths), mb.ref_log_probs,
                      mb.rollout_log_probs, is_weights, token_metrics, mw, sw, old_from_forward=old_from_forward)
