"""RL algorithms as pure functions (torch only, no process groups): log-probs, advantages, policy losses,
KL estimators, aggregation weights and train–inference mismatch correction. See docs/algorithms.md."""

from .advantages import (
    compute_advantages,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    gspo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)
from .aggregation import GlobalNorm, loss_token_weights
from .config import LossConfig, MISConfig
from .kl import approx_kl
from .logprobs import linear_token_logprobs, token_logprobs
from .loss import (
    LossInputs,
    PolicyLoss,
    ResponseBatch,
    build_loss,
    build_loss_inputs,
    global_norm,
    is_batch_stats,
    old_from_forward_ok,
)
from .mismatch import ISResult, compute_is_weights, mis_weights, mismatch_metrics, vanilla_tis

# Short aliases matching docs/ARCHITECTURE.md.
grpo = grpo_advantages
gspo = gspo_advantages
rloo = rloo_advantages
reinforce_pp = reinforce_pp_advantages
reinforce_pp_baseline = reinforce_pp_baseline_advantages

__all__ = [
    "GlobalNorm",
    "ISResult",
    "LossConfig",
    "LossInputs",
    "MISConfig",
    "PolicyLoss",
    "ResponseBatch",
    "approx_kl",
    "build_loss",
    "build_loss_inputs",
    "compute_advantages",
    "compute_is_weights",
    "dr_grpo_advantages",
    "gae",
    "global_norm",
    "grpo",
    "grpo_advantages",
    "gspo",
    "gspo_advantages",
    "is_batch_stats",
    "linear_token_logprobs",
    "loss_token_weights",
    "mis_weights",
    "mismatch_metrics",
    "old_from_forward_ok",
    "reinforce_pp",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline",
    "reinforce_pp_baseline_advantages",
    "rloo",
    "rloo_advantages",
    "token_logprobs",
    "vanilla_tis",
    "whiten",
]
