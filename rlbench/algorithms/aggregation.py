"""Loss aggregation as per-token weights, with a normaliser fixed once per global batch.

Every loss and metric is `Σ_t w_t · x_t` over response tokens. The weights `w` [R] encode the aggregation
mode and a `GlobalNorm` computed once from ALL samples of the optimizer step (every micro-batch of every
DP rank), so summing micro-batch losses (and DP-rank gradients) gives the same number however the
samples were split. Modes, for sample i with mask m_i and masked length n_i = Σ_t m_it:

    sample_mean       w_it = m_it / (max(1, n_i) · N)          N = samples in the global batch
    token_mean        w_it = m_it / max(1, Σ_i n_i)             tokens of the whole global batch
    seq_sum_constant  w_it = m_it / (N · C)                     Dr.GRPO; C e.g. the max response length

Per-sequence metrics (a sequence's PPL, ...) are a mean over the sequences of the global batch that have at
least one trained token: `sequence_metric_weights`, w_it = m_it / (n_i · N_nonempty); an empty sample (all
tokens loss-masked, e.g. by `mask_truncated`) has no such value and does not count. With N_nonempty = 0 the
weights are NaN, so the metric reads NaN (undefined) instead of a silent 0.

Also the segment helpers (per-sequence sums/means over a flat response-space tensor) used by the losses, and
`zero_masked`: values at masked positions are replaced by 0 (torch.where) BEFORE any arithmetic, so a NaN/±Inf
there (−inf log-prob of a padded token, a NaN advantage) can reach neither a sum nor a gradient (0 · NaN = NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

AGGREGATIONS = ("sample_mean", "token_mean", "seq_sum_constant")


@dataclass(frozen=True)
class GlobalNorm:
    """The counts a global batch is normalised by; plain numbers so a trainer can all-reduce them."""

    n_samples: int
    """Samples in the global batch (all micro-batches, all DP ranks)."""
    n_tokens: float
    """Loss-masked (trained) response tokens in the global batch."""
    constant: float = 1.0
    """Per-sample divisor of `seq_sum_constant` (Dr.GRPO), e.g. the max response length."""
    n_nonempty: int | None = None
    """Samples with at least one trained token (the denominator of per-sequence metrics); a caller that
    all-reduces the counts by hand must all-reduce this one too. None: not counted (loss weights only: asking
    for per-sequence metric weights is then an error, never a mean that counts the empty rows)."""

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"GlobalNorm.n_samples={self.n_samples} must be >= 1 (an empty global batch?)")
        if self.constant <= 0:
            raise ValueError(f"GlobalNorm.constant={self.constant} must be > 0 (e.g. the max response length)")
        if self.n_nonempty is not None and not 0 <= self.n_nonempty <= self.n_samples:
            raise ValueError(f"GlobalNorm.n_nonempty={self.n_nonempty} must be in [0, n_samples={self.n_samples}]")

    @property
    def sequences(self) -> int:
        """The denominator of per-sequence metrics: the samples with a trained token (`n_nonempty`)."""
        if self.n_nonempty is None:
            raise ValueError(
                f"GlobalNorm(n_samples={self.n_samples}, ...) has no n_nonempty, the denominator of per-sequence "
                "metrics (samples with a trained token; n_samples would count the empty rows and deflate them): "
                "build it with GlobalNorm.from_masks / global_norm, or pass n_nonempty (all-reduced like the others)"
            )
        return self.n_nonempty

    @classmethod
    def from_masks(
        cls, loss_masks: Sequence[torch.Tensor], seq_lengths: Sequence[Sequence[int]], constant: float = 1.0
    ) -> GlobalNorm:
        """From every micro-batch of the step: its `[R]` loss mask and its per-sequence response lengths."""
        n_samples = sum(len(lengths) for lengths in seq_lengths)
        n_nonempty = sum(
            int((segment_sum((m != 0).to(torch.float64), seq_ids_from_lengths(ls, m.device), len(ls)) > 0).sum())
            for m, ls in zip(loss_masks, seq_lengths)
        )
        return cls(n_samples, float(sum(float(m.sum()) for m in loss_masks)), constant, n_nonempty)

    @classmethod
    def combine(cls, norms: Sequence[GlobalNorm]) -> GlobalNorm:
        """Sum the counts of several partial norms (e.g. one per DP rank or micro-batch)."""
        constants = {n.constant for n in norms}
        if len(constants) != 1:
            raise ValueError(f"GlobalNorm.combine: constants differ {sorted(constants)}; use one constant per step")
        counted = all(n.n_nonempty is not None for n in norms)
        n_nonempty = sum(n.n_nonempty for n in norms) if counted else None
        return cls(sum(n.n_samples for n in norms), sum(n.n_tokens for n in norms), constants.pop(), n_nonempty)


def seq_ids_from_lengths(lengths: Sequence[int] | torch.Tensor, device=None) -> torch.Tensor:
    """`[R]` long: the index (0..n-1) of the sequence each response token belongs to.

    Lengths held by the host are expanded there and copied once: built on a GPU, the lengths' copy and
    `repeat_interleave`'s output size would each wait for the stream (once per micro-batch in the loss)."""
    if isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu":
        lengths = lengths.to(device=device or lengths.device, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    device = torch.device(device) if device is not None else ids.device
    if device.type == "cuda":
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


def segment_sum(values: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """`[n_seqs]`: Σ of `values [R]` per sequence (differentiable)."""
    out = torch.zeros(n_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_ids, values)


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` with 0 wherever `mask` is 0 (torch.where: a NaN/±Inf there reaches no sum and no gradient)."""
    return torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def segment_masked_mean(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int):
    """`[n_seqs]`: per-sequence Σ m·x / max(1, Σ m); values at m = 0 are not read (NaN-safe)."""
    num = segment_sum(zero_masked(values * mask, mask), seq_ids, n_seqs)
    den = segment_sum(mask.to(values.dtype), seq_ids, n_seqs).clamp_min(1.0)
    return num / den


def _sample_mean(mask, seq_ids, n_seqs, norm):
    n_i = segment_sum(mask, seq_ids, n_seqs).clamp_min(1.0)  # [n]
    return mask / (n_i[seq_ids] * norm.n_samples)


def _token_mean(mask, seq_ids, n_seqs, norm):
    return mask / max(1.0, norm.n_tokens)


def _seq_sum_constant(mask, seq_ids, n_seqs, norm):
    return mask / (norm.n_samples * norm.constant)


AGGREGATION_FNS: dict[str, Callable] = {
    "sample_mean": _sample_mean,
    "token_mean": _token_mean,
    "seq_sum_constant": _seq_sum_constant,
}


def loss_token_weights(
    loss_mask: torch.Tensor,
    seq_lengths: Sequence[int] | torch.Tensor,
    mode: str,
    norm: GlobalNorm,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token weights `[R]` so that the global-batch loss is `Σ_microbatches Σ_t w_t · ℓ_t`.

    Args:
        loss_mask: `[R]` 0/1 mask of one micro-batch (concatenated over its sequences).
        seq_lengths: response length of each sequence of the micro-batch (sums to R).
        mode: one of `AGGREGATIONS`.
        norm: counts of the WHOLE global batch (see `GlobalNorm`).
        dtype: of the weights; None = float64 for a float64 mask, else float32.
    Returns:
        `[R]` weights; zero where the mask is zero.
    """
    dtype = dtype or (torch.float64 if loss_mask.dtype == torch.float64 else torch.float32)
    if mode not in AGGREGATION_FNS:
        raise ValueError(f"loss_aggregation={mode!r} is not one of {AGGREGATIONS}")
    seq_ids = seq_ids_from_lengths(seq_lengths, device=loss_mask.device)
    if seq_ids.numel() != loss_mask.numel():
        raise ValueError(f"seq_lengths sum to {seq_ids.numel()} but loss_mask has {loss_mask.numel()} entries")
    return AGGREGATION_FNS[mode](loss_mask.to(dtype), seq_ids, len(seq_lengths), norm)


def sequence_metric_weights(
    loss_mask: torch.Tensor, seq_lengths: Sequence[int] | torch.Tensor, norm: GlobalNorm, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`[R]` weights of per-sequence metrics: `m_it / (n_i · norm.sequences)`, a mean over the samples of the
    global batch with at least one trained token (whatever the loss aggregation). All NaN when there is none
    (the metric is undefined and reads NaN)."""
    dtype = dtype or (torch.float64 if loss_mask.dtype == torch.float64 else torch.float32)
    seq_ids = seq_ids_from_lengths(seq_lengths, device=loss_mask.device)
    if seq_ids.numel() != loss_mask.numel():
        raise ValueError(f"seq_lengths sum to {seq_ids.numel()} but loss_mask has {loss_mask.numel()} entries")
    m = (loss_mask != 0).to(dtype)
    if norm.sequences == 0:
        return torch.full_like(m, float("nan"))
    n_i = segment_sum(m, seq_ids, len(seq_lengths)).clamp_min(1.0)  # [n]
    return m / (n_i[seq_ids] * norm.sequences)
