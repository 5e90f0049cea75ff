"""Advantage estimators. Scalar rewards `[N]` (one per sample, groups of `group_size` consecutive samples)
and response-space token tensors `[R]` (samples concatenated, `seq_lengths` summing to R).

    GRPO / GSPO   A_i = (r_i − mean_g) / (std_g + eps)    unbiased std; Dr.GRPO drops the division
    RLOO          A_i = r_i − mean_{j≠i} r_j = n/(n−1) · (r_i − mean_g)
    REINFORCE++   token rewards r_t = −β·kl_t, + R_i at the last trained token; G_t = r_t + γ G_{t+1};
                  then whitened over the global batch (required)
    REINFORCE++-baseline   A_t = (R_i − mean_g) − β·kl_t, then whitened (required)
    GAE (PPO)     δ_t = r_t + γ V_{t+1} − V_t (V after the last token = 0, truncated or not),
                  A_t = δ_t + γλ A_{t+1}, ret = A + V

KL-in-reward (`kl_in_reward`): kl_t is `cfg.kl_loss_type` on π_old vs π_ref (k1 = logπ_old − logπ_ref, k3, ...),
0 on masked tokens, and β the coefficient of the step (`cfg.kl_coef`, or the adaptive controller's value of
`kl_control`, passed as `kl_coef=`).

The recursions over time (REINFORCE++ returns, GAE) run over the TRAINED tokens only (loss mask 1): a
loss-masked token inside a response (tool output in multi-turn) is not a time step, so "t+1" is the next
trained token and V / A / G are carried across masked spans. This is verl's `compute_gae_advantage_return`
(`nextvalues` / `lastgaelam` pass through observation tokens) and `compute_reinforce_plus_plus_outcome_advantage`
(the running return passes through them, verl PR #7300), and the outputs equal theirs at EVERY position of
identical tensors (tests/test_algorithms_verl_returns.py): at a masked position GAE's advantage is the carried
A of the next trained token and its return that A + V_t; the REINFORCE++ return there is 0. No loss reads a
masked position. Rewards on masked tokens and the KL, values and log-probs that feed a trained token's result are
read only at trained tokens, so a NaN/±Inf at a masked position reaches no trained token's advantage or return
(a masked V_t only its own position's GAE return).

The loop runs an estimator in two halves (`Estimator`, registry `ADVANTAGE_FNS`): `sample_advantages` turns the
rewards into one scalar per sample when they are scored (the group statistics above; the raw reward for
REINFORCE++ and PPO), and `token_advantages` runs on the ranks after the model passes, from those scalars and
the passes' outputs (KL-in-reward from old/ref log-probs, critic values), then whitens over the global batch
(`reduce_sum`). A new estimator is one registry entry; `compute_advantages` is both halves in one call.

Unlike slime, a batch whose size is not a multiple of the group size raises instead of silently becoming
one big group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlbench.configs.loss import LossConfig

from .aggregation import zero_masked
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
    penalty: torch.Tensor | None,
) -> torch.Tensor:
    """`[R]`: the token penalty (`kl_in_reward`: −β·kl_t) on trained tokens, plus R_i on the last trained token
    of sample i.

    A sample with no trained token gets R_i on its last token (it carries no loss anyway).
    """
    tok = torch.zeros_like(loss_mask, dtype=rewards.dtype)
    if penalty is not None:
        tok = tok + zero_masked(penalty.to(rewards.dtype), loss_mask)
    starts = torch.cumsum(torch.as_tensor([0, *seq_lengths[:-1]]), 0).tolist() if len(seq_lengths) else []
    for i, (s, n) in enumerate(zip(starts, seq_lengths)):
        if n == 0:
            continue
        nz = torch.nonzero(loss_mask[s : s + n]).flatten()
        last = s + (int(nz[-1]) if nz.numel() else n - 1)
        tok[last] = tok[last] + rewards[i]
    return tok


def discounted_returns(
    token_rewards: torch.Tensor, seq_lengths: Sequence[int], gamma: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[R]`: G_t = r_t + γ G_{t+1} within each sample over the tokens with `mask` ≠ 0 (None: every token);
    t+1 is the next such token, G after the last one = 0, and G = 0 on masked tokens (their r is not read).
    Equal to verl's `compute_reinforce_plus_plus_outcome_advantage` returns on the padded tensors."""
    r = to_padded(token_rewards, seq_lengths)  # [N, L]
    steps = to_padded(torch.ones_like(token_rewards) if mask is None else (mask != 0).to(r.dtype), seq_lengths) > 0
    r = torch.where(steps, r, torch.zeros((), dtype=r.dtype))
    g = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.numel() else r.new_zeros(0)
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(steps[:, t], r[:, t] + gamma * running, running)  # carried across masked tokens
        g[:, t] = torch.where(steps[:, t], running, torch.zeros((), dtype=r.dtype))
    return from_padded(g, seq_lengths)


def _penalty(kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor | None:
    return -kl_coef * kl if kl is not None and kl_coef != 0 else None


def reinforce_pp_advantages(rewards, seq_lengths, loss_mask, kl, kl_coef, gamma) -> torch.Tensor:
    """`[R]` REINFORCE++ returns over the trained tokens (0 on masked ones; whiten them afterwards), with the
    token rewards −kl_coef·kl_t (`kl` `[R]` or None) and R_i `[N]` at each sample's last trained token."""
    tok = shaped_token_rewards(rewards, seq_lengths, loss_mask, _penalty(kl, kl_coef))
    return discounted_returns(tok, seq_lengths, gamma, loss_mask)


def reinforce_pp_baseline_advantages(rewards, group_size, seq_lengths, kl, kl_coef) -> torch.Tensor:
    """`[R]`: (R_i − group mean) broadcast, minus kl_coef·kl_t (whiten them afterwards)."""
    a = to_tokens(dr_grpo_advantages(rewards, group_size), seq_lengths)
    return a - kl_coef * kl.to(a.dtype) if kl is not None and kl_coef != 0 else a


def gae(
    rewards_tok: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation on right-padded `[B, L]` tensors, over the trained tokens only: verl's
    `compute_gae_advantage_return` (before its whitening), equal to it at every position.

    Args:
        rewards_tok: `[B, L]` per-token rewards (e.g. from `shaped_token_rewards`, padded).
        values: `[B, L]` critic values V_t.
        mask: `[B, L]` 1 on the time steps (trained tokens), 0 on loss-masked tokens inside a response and on
            padding. Masked positions are skipped: δ_t = r_t + γ V_next − V_t and A_t = δ_t + γλ A_next with
            "next" the next trained token (V_next = A_next = 0 after the last one, also for a response cut
            at the length limit: no bootstrap); their r and V enter no trained token's result.
    Returns:
        `(advantages [B, L], returns [B, L])`, returns = A + V. At a masked position A is the carried A_next
        (verl's `lastgaelam`; 0 after the last trained token) and the return that A + V_t; no loss reads them.
    """
    steps = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(steps, values, zero)
    r = torch.where(steps, rewards_tok.to(values.dtype), zero)
    adv = torch.zeros_like(v)
    next_v = torch.zeros_like(v[:, 0])
    next_a = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        on = steps[:, t]
        next_a = torch.where(on, a, next_a)  # a masked token passes A and V of the next trained token through
        next_v = torch.where(on, v[:, t], next_v)
        adv[:, t] = next_a
    return adv, adv + values


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, *,
           reduce_sum: Callable[[list[float]], list[float]] | None = None) -> torch.Tensor:
    """`[R]`: (x − masked mean) / sqrt(masked unbiased var + eps) over the GLOBAL batch.

    `reduce_sum` adds lists of floats over the ranks that hold the rest of the batch (`RankStep.reduce.sum`);
    None: `x` is the whole batch. Each rank's partial sums are float32 sums of its own tokens, so one rank gives
    the same bits as whitening the concatenated batch here.

    With fewer than 2 trained tokens in the global batch there is no variance to scale by (x / sqrt(eps) would
    blow a value up by 1e4): the result is 0 everywhere (+ the masked mean with `shift_mean=False`: x itself at a
    single trained token, 0 with none). verl's `masked_whiten` raises there; returning the centred value keeps a
    step whose other samples are all masked (truncation, dynamic sampling) trainable, and those tokens carry no loss.
    """
    m = mask.to(x.dtype)
    total, count = _global(reduce_sum, zero_masked(x * m, m).sum(), m.sum())  # a NaN/Inf on a masked token stays out
    n = count.clamp_min(1.0)
    mean = total / n
    (sq,) = _global(reduce_sum, zero_masked((x - mean) ** 2 * m, m).sum())
    var = sq / (n - 1).clamp_min(1.0)
    out = torch.where(count >= 2, (x - mean) * torch.rsqrt(var + eps), torch.zeros((), dtype=x.dtype, device=x.device))
    return out if shift_mean else out + mean


def _global(reduce_sum, *sums: torch.Tensor) -> list[torch.Tensor]:
    """0-dim partial sums -> the global sums, in the same dtype (a float32 survives the float round trip)."""
    if reduce_sum is None:
        return list(sums)
    return [torch.tensor(v, dtype=t.dtype) for v, t in zip(reduce_sum([float(t) for t in sums]), sums)]


def last_token_values(values: torch.Tensor, seq_lengths: Sequence[int], loss_mask: torch.Tensor) -> torch.Tensor:
    """`[N]`: each sample's value at its last trained token (its last token when none is trained; 0 when empty).

    Reads the per-sample scalar back from a broadcast `[R]` (what the packs carry: `to_tokens(scalars)`)."""
    out = values.new_zeros(len(seq_lengths))
    start = 0
    for i, n in enumerate(seq_lengths):
        if n:
            nz = torch.nonzero(loss_mask[start : start + n]).flatten()
            out[i] = values[start + (int(nz[-1]) if nz.numel() else n - 1)]
        start += n
    return out


# ----------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class TokenInputs:
    """One rank's samples in response space after the model passes: what a token-level estimator reads."""

    base: torch.Tensor
    """`[R]` each sample's scalar from scoring (`Estimator.sample`) broadcast over its response tokens."""
    seq_lengths: list[int]
    """Response length of each sample (sums to R)."""
    loss_mask: torch.Tensor
    """`[R]` 1 on trained tokens."""
    kl_penalty: torch.Tensor | None = None
    """`[R]` the KL-in-reward token rewards −β·kl_t (`kl_in_reward`), 0 on masked tokens; None: β = 0."""
    values: torch.Tensor | None = None
    """`[R]` critic values V_t (None: no critic pass ran)."""


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator in its two halves, run at two points of the step.

    `sample(cfg, rewards [N], group_size) -> [N]`: per-sample scalars from the rewards alone (group statistics:
    GRPO / RLOO / Dr.GRPO baselines; the raw reward for return-based estimators), on the driver at scoring.
    `token(cfg, TokenInputs) -> (advantages [R], returns [R] | None)`: the token-level advantages, on the ranks
    after the model passes (log-probs, values), and the returns of the return-based estimators (GAE: A + V, the
    critic's regression target; REINFORCE++: G); each sample's tokens depend on that sample only (whitening over
    the global batch comes after, in `token_advantages_and_returns`, and never touches the returns).
    """

    sample: Callable[[LossConfig, torch.Tensor, int], torch.Tensor]
    token: Callable[[LossConfig, TokenInputs], tuple[torch.Tensor, torch.Tensor | None]]


def _raw_reward(cfg, rewards, group_size):
    return rewards


def _grpo_scalars(cfg, rewards, group_size):
    return grpo_advantages(rewards, group_size, std_normalize=cfg.grpo_std_normalization)


def _scalar_fn(fn: Callable) -> Callable:
    return lambda cfg, rewards, group_size: fn(rewards, group_size)


def _broadcast(cfg, x: TokenInputs):
    return x.base, None


def _rpp(cfg, x: TokenInputs):
    rewards = last_token_values(x.base, x.seq_lengths, x.loss_mask)
    tok = shaped_token_rewards(rewards, x.seq_lengths, x.loss_mask, x.kl_penalty)
    g = discounted_returns(tok, x.seq_lengths, cfg.gamma, x.loss_mask)
    return g, g


def _plus_penalty(cfg, x: TokenInputs):
    return (x.base if x.kl_penalty is None else x.base + x.kl_penalty.to(x.base.dtype)), None


def _gae(cfg, x: TokenInputs):
    if x.values is None:
        raise ValueError("advantage_estimator='gae' needs critic values [R]")
    rewards = last_token_values(x.base, x.seq_lengths, x.loss_mask)
    tok = shaped_token_rewards(rewards, x.seq_lengths, x.loss_mask, x.kl_penalty)
    steps = to_padded((x.loss_mask != 0).to(tok.dtype), x.seq_lengths)  # masked tokens are not time steps
    adv, ret = gae(to_padded(tok, x.seq_lengths), to_padded(x.values.to(tok.dtype), x.seq_lengths), steps,
                   cfg.gamma, cfg.lambd)
    return from_padded(adv, x.seq_lengths), from_padded(ret, x.seq_lengths)


ADVANTAGE_FNS: dict[str, Estimator] = {
    "grpo": Estimator(_grpo_scalars, _broadcast),
    "gspo": Estimator(_grpo_scalars, _broadcast),
    "dr_grpo": Estimator(_scalar_fn(dr_grpo_advantages), _broadcast),
    "rloo": Estimator(_scalar_fn(rloo_advantages), _broadcast),
    "reinforce_plus_plus": Estimator(_raw_reward, _rpp),
    "reinforce_plus_plus_baseline": Estimator(_scalar_fn(dr_grpo_advantages), _plus_penalty),
    "gae": Estimator(_raw_reward, _gae),
}
"""`LossConfig.advantage_estimator` -> its `Estimator`."""


def sample_advantages(cfg: LossConfig, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[N]` per-sample scalars of ALL samples of a step (group statistics span each group), at scoring."""
    return ADVANTAGE_FNS[cfg.advantage_estimator].sample(cfg, rewards, group_size)


def reward_kl(cfg: LossConfig, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
              loss_mask: torch.Tensor) -> torch.Tensor:
    """`[R]` the per-token KL the reward is shaped with: `cfg.kl_loss_type` on π_old (the actor's log-probs of
    the sampled tokens) vs π_ref, 0 on masked tokens (what `kl_control.mean_sequence_kl` measures)."""
    if old_log_probs.shape != loss_mask.shape or ref_log_probs.shape != loss_mask.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)}, ref_log_probs {tuple(ref_log_probs.shape)} "
                         f"and loss_mask {tuple(loss_mask.shape)} must be the same [R]")
    return zero_masked(approx_kl(old_log_probs, ref_log_probs, cfg.kl_loss_type), loss_mask)  # no grad flows


def kl_in_reward(cfg: LossConfig, old_log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None,
                 loss_mask: torch.Tensor, *, kl_coef: float | None = None) -> torch.Tensor | None:
    """`[R]` the KL-in-reward token rewards −β·kl_t (`reward_kl`; 0 on masked tokens), β = `kl_coef` (the
    controller's value this step) or, when None, `cfg.kl_coef`; None when β is 0."""
    beta = cfg.kl_coef if kl_coef is None else kl_coef
    if beta == 0:
        return None
    if cfg.kl_coef == 0:
        raise ValueError(f"kl_coef={kl_coef} passed but the config's kl_coef is 0 (KL-in-reward off, no ref "
                         "model); set LossConfig.kl_coef to the starting value")
    if old_log_probs is None or ref_log_probs is None:
        raise ValueError(f"kl_coef={beta} needs old_log_probs and ref_log_probs")
    return -beta * reward_kl(cfg, old_log_probs, ref_log_probs, loss_mask)


def token_advantages(cfg: LossConfig, base: torch.Tensor, seq_lengths: Sequence[int], loss_mask: torch.Tensor,
                     **passes) -> torch.Tensor:
    """`[R]` advantages: `token_advantages_and_returns` without the returns (same arguments)."""
    return token_advantages_and_returns(cfg, base, seq_lengths, loss_mask, **passes)[0]


def token_advantages_and_returns(
    cfg: LossConfig,
    base: torch.Tensor,
    seq_lengths: Sequence[int],
    loss_mask: torch.Tensor,
    *,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl_coef: float | None = None,
    reduce_sum: Callable[[list[float]], list[float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(advantages [R], returns [R] | None)` from the per-sample scalars `base` (broadcast, `[R]`) and the model
    passes' outputs. The advantages are whitened over the global batch when `cfg.normalize_advantages`; the
    returns never are (`gae`: A + V before whitening, the value loss's target, as verl; REINFORCE++: G; None for
    the estimators without returns).

    Args:
        base: `[R]` `sample_advantages` broadcast over each sample's response tokens.
        old_log_probs, ref_log_probs: `[R]`; needed when β != 0 (`kl_in_reward`).
        values: `[R]` critic values for `gae`.
        kl_coef: β of KL-in-reward this step (the KL controller's `value`); None: `cfg.kl_coef`.
        reduce_sum: sums lists of floats over the ranks holding the rest of the batch, for the whitening
            statistics (None: these samples are the whole batch).
    """
    if sum(seq_lengths) != loss_mask.numel() or base.numel() != loss_mask.numel():
        raise ValueError(f"base of {base.numel()}, lengths summing to {sum(seq_lengths)}, loss_mask of "
                         f"{loss_mask.numel()}: they must describe the same tokens")
    penalty = kl_in_reward(cfg, old_log_probs, ref_log_probs, loss_mask, kl_coef=kl_coef)
    x = TokenInputs(base, list(seq_lengths), loss_mask, penalty, values)
    adv, returns = ADVANTAGE_FNS[cfg.advantage_estimator].token(cfg, x)
    return (whiten(adv, loss_mask, reduce_sum=reduce_sum) if cfg.normalize_advantages else adv), returns


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
    kl_coef: float | None = None,
) -> torch.Tensor:
    """`[R]` advantages for ALL samples of a step in one call (`sample_advantages` then `token_advantages`; the
    loop runs the two halves at scoring and after the model passes).

    Args:
        rewards: `[N]` scalar rewards, groups of `group_size` consecutive samples.
        seq_lengths: response length of each sample; loss_mask `[R]`.
        old_log_probs, ref_log_probs: `[R]`; needed when `cfg.kl_coef != 0` (KL reward shaping uses
            `cfg.kl_loss_type` on old vs ref).
        values: `[R]` critic values for `gae`.
        kl_coef: β of KL-in-reward (the KL controller's value); None: `cfg.kl_coef`.
    """
    if rewards.numel() != len(seq_lengths) or sum(seq_lengths) != loss_mask.numel():
        raise ValueError(
            f"{rewards.numel()} rewards, {len(seq_lengths)} lengths summing to {sum(seq_lengths)}, "
            f"loss_mask of {loss_mask.numel()}: they must describe the same samples"
        )
    base = to_tokens(sample_advantages(cfg, rewards, group_size), seq_lengths)
    return token_advantages(cfg, base, seq_lengths, loss_mask, old_log_probs=old_log_probs,
                            ref_log_probs=ref_log_probs, values=values, kl_coef=kl_coef)
