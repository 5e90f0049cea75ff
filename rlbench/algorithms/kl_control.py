"""The coefficient of the KL-in-reward penalty (`advantages.kl_in_reward`: r_t −= β · kl_t), fixed or adapted.

    fixed      β = kl_coef for the whole run
    adaptive   Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", §2.2), as verl's
               `AdaptiveKLController` and OpenRLHF's: after a step whose KL was measured on n samples,
                   e  = clip(KL / kl_target − 1, −0.2, 0.2)
                   β ← β · (1 + e · n / kl_horizon)
               so β grows while the policy drifts further than the target from the reference and shrinks while
               it stays closer; the horizon is in samples (Ziegler et al. and verl: 10000).

The KL fed to `update` is `mean_sequence_kl`: the mean over the step's samples of each sample's mean
per-token KL (verl's `apply_kl_penalty` metric, `actor/reward_kl_penalty`), over the GLOBAL batch.

A controller is the loop's state between steps: `state_dict()` / `load_state_dict()` carry β across a resume
(β after k steps is a product of k factors, so a resume that restarted it from kl_coef would not be exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from rlbench.configs.loss import LossConfig

from .aggregation import segment_sum, seq_ids_from_lengths, zero_masked

ERROR_CLIP = 0.2  # |proportional error| bound of the adaptive update (Ziegler et al., verl, OpenRLHF)


class KLController:
    """β (`value`) and its state; the subclasses define `update(current_kl, n_steps)`, called after each step
    with the step's `mean_sequence_kl` and its number of samples."""

    kind = ""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    @classmethod
    def from_config(cls, cfg: LossConfig) -> KLController:
        return cls(cfg.kl_coef)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind or "value" not in state:
            raise ValueError(f"KL controller state {state} does not belong to a {self.kind!r} controller "
                             "(kl_ctl_type changed between the save and the resume? resume with the saved type)")
        self.value = float(state["value"])


class FixedKLController(KLController):
    """β = `kl_coef` for the whole run."""

    kind = "fixed"

    def update(self, current_kl: float, n_steps: int) -> None:
        """Changes nothing (the measured KL is still checked: a NaN is reported the same way for both kinds)."""
        _check_kl(current_kl, n_steps)


class AdaptiveKLController(KLController):
    """β adapted towards a target KL (see the module docstring)."""

    kind = "adaptive"

    def __init__(self, kl_coef: float, target: float, horizon: float):
        if not (kl_coef > 0 and target > 0 and horizon > 0):
            raise ValueError(f"adaptive KL control needs kl_coef={kl_coef}, kl_target={target}, "
                             f"kl_horizon={horizon} all > 0 (β is multiplied each step: from 0 it stays 0)")
        super().__init__(kl_coef)
        self.target, self.horizon = float(target), float(horizon)

    @classmethod
    def from_config(cls, cfg: LossConfig) -> AdaptiveKLController:
        return cls(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """β ← β · (1 + clip(current_kl / target − 1, ±0.2) · n_steps / horizon).

        Args:
            current_kl: the step's `mean_sequence_kl` (global batch).
            n_steps: the samples it was measured on (the step's global batch size).
        """
        _check_kl(current_kl, n_steps)
        if n_steps * ERROR_CLIP >= self.horizon:
            raise ValueError(f"n_steps={n_steps} samples against kl_horizon={self.horizon:g}: a factor "
                             f"1 − 0.2·{n_steps}/{self.horizon:g} <= 0 would flip β's sign; raise kl_horizon "
                             f"above {n_steps * ERROR_CLIP:g} (it is in samples, e.g. 10000)")
        error = min(max(current_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS: dict[str, type[KLController]] = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}
"""`LossConfig.kl_ctl_type` -> its controller class (`build_kl_controller` builds one from the config)."""


def build_kl_controller(cfg: LossConfig) -> KLController:
    """The controller of `cfg.kl_ctl_type`, starting from `cfg.kl_coef`."""
    return KL_CONTROLLERS[cfg.kl_ctl_type].from_config(cfg)


def mean_sequence_kl(
    kl: torch.Tensor,
    seq_lengths: Sequence[int],
    loss_mask: torch.Tensor,
    *,
    reduce_sum: Callable[[list[float]], list[float]] | None = None,
) -> float:
    """The KL the controller reads: mean over the samples with a trained token of each sample's mean
    per-token KL over its trained tokens.

    Args:
        kl: `[R]` per-token KL (`advantages.reward_kl`); values at masked tokens are not read.
        seq_lengths: response length of each sample (sums to R); loss_mask `[R]`.
        reduce_sum: adds lists of floats over the ranks holding the rest of the batch (None: this is the batch).
    Returns:
        The global mean, in float64. A sample whose tokens are all masked has no KL and does not count (verl
        counts it as 0); NaN when no sample of the global batch has a trained token.
    """
    if sum(seq_lengths) != kl.numel() or kl.numel() != loss_mask.numel():
        raise ValueError(f"kl of {kl.numel()}, lengths summing to {sum(seq_lengths)}, loss_mask of "
                         f"{loss_mask.numel()}: they must describe the same tokens")
    m = (loss_mask != 0).to(torch.float64)
    ids = seq_ids_from_lengths(list(seq_lengths), device=kl.device)
    n_tok = segment_sum(m, ids, len(seq_lengths))  # [N]
    per_seq = segment_sum(zero_masked(kl.to(torch.float64), m), ids, len(seq_lengths)) / n_tok.clamp_min(1.0)
    total, count = float(per_seq.sum()), float((n_tok > 0).sum())
    if reduce_sum is not None:
        total, count = reduce_sum([total, count])
    return total / count if count > 0 else math.nan


def _check_kl(current_kl: float, n_steps: int) -> None:
    if not math.isfinite(current_kl) or n_steps < 1:
        raise ValueError(f"KL controller update with current_kl={current_kl}, n_steps={n_steps}: needs a finite "
                         "KL measured on >= 1 sample (a step without trained tokens has no KL: skip the update)")

