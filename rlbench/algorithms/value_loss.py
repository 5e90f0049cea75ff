"""The critic's loss: PPO's clipped value loss (TRL's PPOTrainer, verl's `compute_value_loss`, slime's
`--value-clip`), per token, in response space `[R]`:

    ℓ_t = ½ · max((V_t − G_t)², (clip(V_t, V_old,t − ε, V_old,t + ε) − G_t)²)        ε = value_clip
    ℓ_t = ½ · (V_t − G_t)²                                                           value_clip None

with V the critic's current values, V_old the values of the critic pass that made the returns G (GAE's
`A + V_old`). The loss is `Σ_t w_t · ℓ_t` with the per-token weights of `aggregation.loss_token_weights`
(the same `GlobalNorm` machinery as the policy loss), so micro-batches and DP ranks add up to the loss of the
global batch; with `token_mean` weights it is verl's `0.5 · masked_mean(max(...))`.

Inputs at untrained tokens (loss mask 0) are replaced by 0 before any arithmetic: a NaN/±Inf there reaches
neither the loss nor its gradient.
"""

from __future__ import annotations

import torch

from .aggregation import zero_masked


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    clip: float | None,
    *,
    metric_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's (clipped) value loss of one micro-batch.

    Args:
        values: `[R]` current critic values V (the gradient flows through them only).
        old_values: `[R]` the values the returns were computed with (V_old; detached here).
        returns: `[R]` the regression targets G (detached here).
        loss_mask: `[R]` 1 on trained tokens.
        weights: `[R]` `loss_token_weights(loss_mask, lengths, mode, norm)` under the global batch's norm.
        clip: ε of the clip around V_old (`LossConfig.value_clip`); None: the unclipped loss.
        metric_weights: `[R]` weights of the metrics (None: `weights`; `seq_sum_constant` passes sample-mean
            weights, as the policy loss does).
    Returns:
        `(loss, metrics)`: loss 0-dim, `Σ w·ℓ`; metrics 0-dim sums under `metric_weights` (so they add up over
        micro-batches and ranks like the loss), bare names (the critic logs them under `critic/`):
        `vf_loss` (Σ mw·ℓ), `vf_clipfrac` (tokens where the clipped term is the larger, verl's definition),
        `vpred_mean` (V), `return_mean` (G).
    """
    if not values.shape == old_values.shape == returns.shape == loss_mask.shape == weights.shape:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)}, "
            f"loss_mask {tuple(loss_mask.shape)}, weights {tuple(weights.shape)} must all be the same [R]"
        )
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip={clip} must be > 0, or None for the unclipped value loss")
    dt = values.dtype

    def z(t):  # untrained tokens -> 0 before any arithmetic
        return zero_masked(t.to(dt), loss_mask)

    v, v_old, g = z(values), z(old_values).detach(), z(returns).detach()
    unclipped = (v - g) ** 2
    if clip is None:
        per_token, clipped_frac = unclipped, torch.zeros_like(unclipped)
    else:
        clipped = (torch.clamp(v, v_old - clip, v_old + clip) - g) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_frac = (clipped > unclipped).to(dt)
    per_token = 0.5 * per_token  # [R]
    w = weights.to(dt)
    loss = (w * per_token).sum()
    mw = (w if metric_weights is None else metric_weights.to(dt)).detach()
    with torch.no_grad():
        metrics = {
            "vf_loss": (mw * per_token).sum(),
            "vf_clipfrac": (mw * z(clipped_frac)).sum(),
            "vpred_mean": (mw * v).sum(),
            "return_mean": (mw * g).sum(),
        }
    return loss, metrics
