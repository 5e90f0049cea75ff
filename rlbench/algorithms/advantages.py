"""Advantage estimators. Scalar rewards `[N]` (one per sample, groups of `group_size` consecutive samples)
and response-space token tensors `[R]` (samples concatenated, `seq_lengths` summing to R).

    GRPO / GSPO   A_i = (r_i − mean_g) / (std_g + eps)    unbiased std; Dr.GRPO drops the division
    RLOO          A_i = r_i − mean_{j≠i} r_j = n/(n−1) · (r_i − mean_g)
    REINFORCE++   token rewards r_t = −kl_coef·kl_t, + R_i at the last trained token; G_t = r_t + γ G_{t+1};
                  then whitened over the global batch (required)
    REINFORCE++-baseline   A_t = (R_i − mean_g) − kl_coef·kl_t, then whitened (required)
    PPO (GAE)     δ_t = r_t + γ V_{t+1} − V_t (V after the last token = 0), A_t = δ_t + γλ A_{t+1}, ret = A + V

Unlike slime, a batch whose size is not a multiple of the group size raises instead of silently becoming
one big group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .config import LossConfig
from .kl import approx_kl


def group_view(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[N] -> [G, group_size]`; raises when N is not a multiple of `group_size`."""
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of group_size={group_size}; "
            "every prompt must have exactly n_samples_per_prompt samples (drop or pad incomplete groups)"
        )
    return rewards.reshape(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """`[N]`: group-mean-centred rewards, divided by (unbiased group std + eps) when `std_normalize`.

    With group_size == 1 the std is undefined and is skipped (slime forces it off then).
    """
    g = group_view(rewards, group_size)  # [G, n]
    a = g - g.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        a = a / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    return a.reshape(-1)


gspo_advantages = grpo_advantages


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[N]`: Dr.GRPO, group-mean-centred rewards without std division."""
    return grpo_advantages(rewards, group_size, std_normalize=False)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[N]`: reward minus the mean of the other samples of its group (needs group_size >= 2)."""
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (leave-one-out), got {group_size}")
    g = group_view(rewards, group_size)  # [G, n]
    loo_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - loo_mean).reshape(-1)


def to_tokens(values: torch.Tensor, seq_lengths: Sequence[int]) -> torch.Tensor:
    """Broadcast per-sample `[N]` to response space `[R]`."""
    return torch.repeat_interleave(values, torch.as_tensor(seq_lengths, device=values.device))


def to_padded(flat: torch.Tensor, seq_lengths: Sequence[int]) -> torch.Tensor:
    """`[R] -> [N, max_len]`, zero-padded on the right."""
    parts = torch.split(flat, list(seq_lengths))
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True) if parts else flat.new_zeros(0, 0)


def from_padded(padded: torch.Tensor, seq_lengths: Sequence[int]) -> torch.Tensor:
    """`[N, max_len] -> [R]`, the inverse of `to_padded`."""
    return torch.cat([padded[i, :n] for i, n in enumerate(seq_lengths)]) if len(seq_lengths) else padded.new_zeros(0)


def shaped_token_rewards(
    rewards: torch.Tensor,
    seq_lengths: Sequence[int],
    loss_mask: torch.Tensor,
    kl: torch.Tensor | None,
    kl_coef: float,
) -> torch.Tensor:
    """`[R]`: −kl_coef·kl_t on trained tokens, plus R_i on the last trained token of sample i.

    A sample with no trained token gets R_i on its last token (it carries no loss anyway).
    """
    tok = torch.zeros_like(loss_mask, dtype=rewards.dtype)
    if kl is not None and kl_coef != 0:
        tok = tok - kl_coef * kl.to(rewards.dtype) * loss_mask
    starts = torch.cumsum(torch.as_tensor([0, *seq_lengths[:-1]]), 0).tolist() if len(seq_lengths) else []
    for i, (s, n) in enumerate(zip(starts, seq_lengths)):
        if n == 0:
            continue
        nz = torch.nonzero(loss_mask[s : s + n]).flatten()
        last = s + (int(nz[-1]) if nz.numel() else n - 1)
        tok[last] = tok[last] + rewards[i]
    return tok


def discounted_returns(token_rewards: torch.Tensor, seq_lengths: Sequence[int], gamma: float) -> torch.Tensor:
    """`[R]`: G_t = r_t + γ G_{t+1} within each sample (G after the last token = 0)."""
    r = to_padded(token_rewards, seq_lengths)  # [N, L]; padding is zero so it adds nothing
    g = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.numel() else r.new_zeros(0)
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        g[:, t] = running
    return from_padded(g, seq_lengths)


def reinforce_pp_advantages(rewards, seq_lengths, loss_mask, kl, kl_coef, gamma) -> torch.Tensor:
    """`[R]` REINFORCE++ returns (whiten them afterwards)."""
    return discounted_returns(shaped_token_rewards(rewards, seq_lengths, loss_mask, kl, kl_coef), seq_lengths, gamma)


def reinforce_pp_baseline_advantages(rewards, group_size, seq_lengths, kl, kl_coef) -> torch.Tensor:
    """`[R]`: (R_i − group mean) broadcast, minus kl_coef·kl_t (whiten them afterwards)."""
    a = to_tokens(dr_grpo_advantages(rewards, group_size), seq_lengths)
    return a - kl_coef * kl.to(a.dtype) if kl is not None and kl_coef != 0 else a


def gae(
    rewards_tok: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation on right-padded `[B, L]` tensors.

    Args:
        rewards_tok: `[B, L]` per-token rewards (e.g. from `shaped_token_rewards`, padded).
        values: `[B, L]` critic values V_t.
        mask: `[B, L]` 1 inside each response, 0 on padding (V beyond the response is taken as 0).
    Returns:
        `(advantages [B, L], returns [B, L])`, zero on padding.
    """
    mask = mask.to(values.dtype)
    v = values * mask
    adv = torch.zeros_like(v)
    next_v = torch.zeros_like(v[:, 0])
    next_a = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        delta = rewards_tok[:, t] + gamma * next_v - v[:, t]
        next_a = (delta + gamma * lam * next_a) * mask[:, t]
        adv[:, t] = next_a
        next_v = v[:, t]
    return adv, (adv + v) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """`[R]`: (x − masked mean) / sqrt(masked unbiased var + eps); pass ALL tokens of the global batch."""
    m = mask.to(x.dtype)
    n = m.sum().clamp_min(1.0)
    mean = (x * m).sum() / n
    var = ((x - mean) ** 2 * m).sum() / (n - 1).clamp_min(1.0)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


# Registry: each entry maps the common arguments to `[R]` advantages.
def _sample_level(fn: Callable) -> Callable:
    def adv(cfg, rewards, seq_lengths, loss_mask, group_size, kl, values):
        return to_tokens(fn(rewards, group_size), seq_lengths)

    return adv


def _grpo(cfg, rewards, seq_lengths, loss_mask, group_size, kl, values):
    return to_tokens(grpo_advantages(rewards, group_size, std_normalize=cfg.grpo_std_normalization), seq_lengths)


def _rpp(cfg, rewards, seq_lengths, loss_mask, group_size, kl, values):
    return reinforce_pp_advantages(rewards, seq_lengths, loss_mask, kl, cfg.kl_coef, cfg.gamma)


def _rpp_baseline(cfg, rewards, seq_lengths, loss_mask, group_size, kl, values):
    return reinforce_pp_baseline_advantages(rewards, group_size, seq_lengths, kl, cfg.kl_coef)


def _ppo(cfg, rewards, seq_lengths, loss_mask, group_size, kl, values):
    if values is None:
        raise ValueError("advantage_estimator='ppo' needs critic values [R]")
    tok = shaped_token_rewards(rewards, seq_lengths, loss_mask, kl, cfg.kl_coef)
    valid = to_padded(torch.ones_like(tok), seq_lengths)
    adv, _ = gae(to_padded(tok, seq_lengths), to_padded(values.to(tok.dtype), seq_lengths), valid, cfg.gamma, cfg.lambd)
    return from_padded(adv, seq_lengths)


ADVANTAGE_FNS: dict[str, Callable] = {
    "grpo": _grpo,
    "gspo": _grpo,
    "dr_grpo": _sample_level(dr_grpo_advantages),
    "rloo": _sample_level(rloo_advantages),
    "reinforce_plus_plus": _rpp,
    "reinforce_plus_plus_baseline": _rpp_baseline,
    "ppo": _ppo,
}


def compute_advantages(
    cfg: LossConfig,
    rewards: torch.Tensor,
    seq_lengths: Sequence[int],
    loss_mask: torch.Tensor,
    *,
    group_size: int,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[R]` advantages for ALL samples of a step (whitening and group statistics span what is passed).

    Args:
        rewards: `[N]` scalar rewards, groups of `group_size` consecutive samples.
        seq_lengths: response length of each sample; loss_mask `[R]`.
        old_log_probs, ref_log_probs: `[R]`; needed when `cfg.kl_coef != 0` (KL reward shaping uses
            `cfg.kl_loss_type` on old vs ref).
        values: `[R]` critic values for `ppo`.
    """
    if rewards.numel() != len(seq_lengths) or sum(seq_lengths) != loss_mask.numel():
        raise ValueError(
            f"{rewards.numel()} rewards, {len(seq_lengths)} lengths summing to {sum(seq_lengths)}, "
            f"loss_mask of {loss_mask.numel()}: they must describe the same samples"
        )
    kl = None
    if cfg.kl_coef != 0:
        if old_log_probs is None or ref_log_probs is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs old_log_probs and ref_log_probs")
        kl = approx_kl(old_log_probs, ref_log_probs, cfg.kl_loss_type)
    adv = ADVANTAGE_FNS[cfg.advantage_estimator](cfg, rewards, list(seq_lengths), loss_mask, group_size, kl, values)
    return whiten(adv, loss_mask) if cfg.normalize_advantages else adv
