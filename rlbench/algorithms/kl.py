"""Per-token KL estimators between the current policy and a base (reference) policy.

With d = logπ − logπ_ref (current first, base second), sampled from the current policy:
    k1          d
    k2          d² / 2
    k3          exp(−d) − 1 + d            (≥ 0, exactly 0 when logπ == logπ_ref)
    low_var_kl  k3 of d clamped to [−20, 20] (before the exponential), the kl clamped to [−10, 10]
                (after the optional importance ratio): verl's kl_penalty and slime/miles' compute_approx_kl
                do the same; without the first clamp exp(−d) overflows for logπ_ref − logπ ≳ 710 (fp64,
                ≳ 89 in fp32) and the clamped-away inf turns the gradient into 0 · inf = NaN. Outside
                [−20, 20] the gradient is 0 (as is every clamped value's). k3 itself is not clamped.
Optional "unbiased" KL (DeepSeek-V3.2, `use_unbiased_kl`): multiply by the importance ratio
exp(logπ − logπ_old), NOT detached (as in slime), so the estimate is of KL(π_θ‖π_ref) under samples
from π_old.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlbench.configs.loss import KL_TYPES

LOG_RATIO_CLAMP = 20.0  # low_var_kl: |logπ − logπ_ref| bound before exp (verl, miles)
KL_CLAMP = 10.0  # low_var_kl: bound on the estimate (slime, verl)


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d * d


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-d) + d


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_type: str = "k1",
    *,
    old_log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate `[R]`.

    Args:
        log_probs: `[R]` current policy log-probs (gradient flows through them).
        ref_log_probs: `[R]` base policy log-probs.
        kl_type: one of `KL_TYPES`.
        old_log_probs: `[R]` sampling-policy log-probs; when given, multiply by exp(logπ − logπ_old)
            (the unbiased KL).
    """
    if kl_type not in KL_ESTIMATORS:
        raise ValueError(f"kl_type={kl_type!r} is not one of {KL_TYPES}")
    return make_kl_fn(kl_type, old_log_probs is not None)(log_probs, ref_log_probs, old_log_probs)


def make_kl_fn(kl_type: str, unbiased: bool) -> Callable[..., torch.Tensor]:
    """Pick the estimator once: returns `fn(log_probs, ref_log_probs, old_log_probs) -> [R]`."""
    if kl_type not in KL_ESTIMATORS:
        raise ValueError(f"kl_loss_type={kl_type!r} is not one of {KL_TYPES}")
    est, clamp = KL_ESTIMATORS[kl_type], kl_type == "low_var_kl"

    def kl_fn(log_probs, ref_log_probs, old_log_probs):
        d = log_probs - ref_log_probs
        kl = est(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else d)
        if unbiased:
            kl = kl * torch.exp(log_probs - old_log_probs)
        return kl.clamp(-KL_CLAMP, KL_CLAMP) if clamp else kl

    return kl_fn
