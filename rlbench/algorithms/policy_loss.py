"""Token-level policy-gradient losses. Each returns a per-token loss `[R]` and per-token metric tensors.

With log-ratio ρ_t = logπ_t − logπ_old,t, r_t = exp(ρ_t), advantage A_t:
    ppo    L1 = −r·A, L2 = −clip(r, 1−ε_low, 1+ε_high)·A, L = max(L1, L2);
           dual clip (c > 1): L = min(L, −c·A) where A < 0.   clipfrac = 1[L2 > L1]
    gspo   the same with ρ_t replaced by its per-sequence masked mean (geometric-mean sequence ratio),
           gradient flowing through the mean
    cispo  L = −sg(clip(r, 1−ε_low, 1+ε_high))·A·logπ      clipfrac = 1[r outside the interval]
           ε_low >= 1 (e.g. eps_clip=1.0) is upper-only CISPO (MiniMax-M1; slime's convention): 1−ε_low <= 0 < r
OPSM (off-policy sequence masking): tokens of sequences with A < 0 and masked-mean(old − new) > δ get 0.
Metrics `ppo_kl` are signed: old − new (GSPO: the sequence value).
`PolicyLoss` passes inputs already zeroed on untrained tokens; the sequence means here are NaN-safe too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .aggregation import segment_masked_mean


def clipped_surrogate(
    log_ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, eps_c: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(loss [R], clipfrac [R], dual_clipfrac [R])` of the PPO clipped objective (optionally dual-clipped)."""
    ratio = torch.exp(log_ratio)
    l1 = -ratio * adv
    l2 = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(l1, l2)
    clipfrac = (l2 > l1).to(adv.dtype)
    if eps_c is None:
        return loss, clipfrac, torch.zeros_like(clipfrac)
    l3 = -eps_c * adv
    dual = (adv < 0) & (loss > l3)
    return torch.where(dual, l3, loss), clipfrac, dual.to(adv.dtype)


def ppo_loss(log_probs, old_log_probs, adv, mask, seq_ids, n_seqs, cfg):
    """Token-level PPO clip. Returns `(loss [R], metrics {name: [R]})`."""
    log_ratio = log_probs - old_log_probs
    loss, clipfrac, dual = clipped_surrogate(log_ratio, adv, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)
    return loss, {"pg_clipfrac": clipfrac, "dual_clipfrac": dual, "ppo_kl": -log_ratio.detach()}


def gspo_loss(log_probs, old_log_probs, adv, mask, seq_ids, n_seqs, cfg):
    """GSPO: PPO clip on the per-sequence geometric-mean ratio, broadcast to the sequence's tokens."""
    seq_log_ratio = segment_masked_mean(log_probs - old_log_probs, mask, seq_ids, n_seqs)[seq_ids]  # [R]
    loss, clipfrac, dual = clipped_surrogate(seq_log_ratio, adv, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)
    return loss, {"pg_clipfrac": clipfrac, "dual_clipfrac": dual, "ppo_kl": -seq_log_ratio.detach()}


def cispo_loss(log_probs, old_log_probs, adv, mask, seq_ids, n_seqs, cfg):
    """CISPO: REINFORCE weighted by the detached clipped ratio; every token keeps a gradient.

    `cfg.eps_clip >= 1` drops the lower bound (1 − eps_clip <= 0 never binds): upper-only CISPO."""
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio.detach())
    clipped = ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    loss = -clipped * adv * log_probs
    clipfrac = (clipped != ratio).to(adv.dtype)
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": -log_ratio.detach()}


POLICY_LOSS_FNS: dict[str, Callable] = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def opsm_keep_mask(log_probs, old_log_probs, adv, mask, seq_ids, n_seqs, delta: float) -> torch.Tensor:
    """`[R]` 0/1: 0 on tokens with A < 0 whose sequence has masked-mean(old − new) > delta (no gradient)."""
    with torch.no_grad():
        seq_kl = segment_masked_mean(old_log_probs - log_probs, mask, seq_ids, n_seqs)[seq_ids]  # [R]
        return (~((adv < 0) & (seq_kl > delta))).to(adv.dtype)
