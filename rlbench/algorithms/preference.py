"""Preference losses for reward-model training.

Bradley–Terry (Ouyang et al. 2022, InstructGPT; Llama 2 adds the margin): a pair's probability of the chosen
response being preferred is σ(s_c − s_r), so the loss of a pair is

    ℓ_i = −log σ(s_c,i − s_r,i − m_i)         m_i = 0 without a margin

(TRL's RewardTrainer and OpenRLHF's PairWiseLoss compute the same). The batch loss is Σ_i ℓ_i / n_pairs with
`n_pairs` the pairs of the WHOLE global batch, so the losses of micro-batches and DP ranks add up to the mean
over every pair of the step (the same explicit global normalisation as the policy loss); the metrics are sums
under the same normaliser.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    *,
    n_pairs: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry pairwise loss `Σ_i −log σ(s_c,i − s_r,i − m_i) / n_pairs`.

    Args:
        chosen_scores: `[B]` scalar scores of the preferred responses (gradient flows through them).
        rejected_scores: `[B]` scores of the rejected responses of the same pairs.
        margin: `[B]` or a float: how much the chosen score must exceed the rejected one (Llama 2's margin
            from the preference strength); None: 0.
        n_pairs: the pairs of the global batch (all micro-batches, all DP ranks); None: B (this call is the
            whole batch).
    Returns:
        `(loss, metrics)`: loss a 0-dim tensor in at least float32 (bf16 scores are promoted); metrics (0-dim,
        detached, sums under the same 1/n_pairs so they add up like the loss): `loss`, `accuracy` (pairs with
        s_c > s_r strictly; a tie counts as wrong), `margin` (mean s_c − s_r), `chosen_score`, `rejected_score`.
    """
    if chosen_scores.dim() != 1 or chosen_scores.shape != rejected_scores.shape:
        raise ValueError(f"chosen_scores {tuple(chosen_scores.shape)} and rejected_scores "
                         f"{tuple(rejected_scores.shape)} must be the same [B] vector (one score per pair)")
    n = chosen_scores.numel() if n_pairs is None else n_pairs
    if n < 1 or n < chosen_scores.numel():
        raise ValueError(f"n_pairs={n_pairs} must be >= 1 and count at least this batch's "
                         f"{chosen_scores.numel()} pairs (it is the number of pairs of the whole global batch)")
    dt = torch.promote_types(chosen_scores.dtype, torch.float32)
    c, r = chosen_scores.to(dt), rejected_scores.to(dt)
    diff = c - r  # [B]
    logits = diff if margin is None else diff - torch.as_tensor(margin, dtype=dt, device=diff.device)
    per_pair = -F.logsigmoid(logits)  # [B]; softplus(−x): no overflow at large |x|
    loss = per_pair.sum() / n
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "accuracy": (diff > 0).to(dt).sum() / n,
            "margin": diff.sum() / n,
            "chosen_score": c.sum() / n,
            "rejected_score": r.sum() / n,
        }
    return loss, metrics
