"""RL algorithms as pure functions (torch only, no process groups): log-probs, advantages, policy losses,
KL estimators, aggregation weights, train–inference mismatch correction, the critic's value loss, the KL
controller and the reward model's preference loss. See docs/algorithms.md.

Light on import: each name loads its module, and torch with it, on first access (the configs, `LossConfig`
and `MISConfig`, live in `rlbench.configs.loss`).
"""

from __future__ import annotations

import importlib

_MODULES = {
    "compute_advantages": "advantages",
    "dr_grpo_advantages": "advantages",
    "gae": "advantages",
    "grpo_advantages": "advantages",
    "gspo_advantages": "advantages",
    "reinforce_pp_advantages": "advantages",
    "reinforce_pp_baseline_advantages": "advantages",
    "rloo_advantages": "advantages",
    "whiten": "advantages",
    "sample_advantages": "advantages",
    "token_advantages": "advantages",
    "token_advantages_and_returns": "advantages",
    "kl_in_reward": "advantages",
    "reward_kl": "advantages",
    "GlobalNorm": "aggregation",
    "loss_token_weights": "aggregation",
    "LossConfig": "rlbench.configs.loss",
    "MISConfig": "rlbench.configs.loss",
    "approx_kl": "kl",
    "build_kl_controller": "kl_control",
    "mean_sequence_kl": "kl_control",
    "linear_token_logprobs": "logprobs",
    "token_logprobs": "logprobs",
    "LossInputs": "loss",
    "PolicyLoss": "loss",
    "ResponseBatch": "loss",
    "build_loss": "loss",
    "build_loss_inputs": "loss",
    "global_norm": "loss",
    "is_batch_stats": "loss",
    "old_from_forward_ok": "loss",
    "ISResult": "mismatch",
    "compute_is_weights": "mismatch",
    "mis_weights": "mismatch",
    "mismatch_metrics": "mismatch",
    "bradley_terry_loss": "preference",
    "value_loss": "value_loss",
    "vanilla_tis": "mismatch",
}
# Short aliases matching docs/ARCHITECTURE.md.
_ALIASES = {
    "grpo": "grpo_advantages",
    "gspo": "gspo_advantages",
    "rloo": "rloo_advantages",
    "reinforce_pp": "reinforce_pp_advantages",
    "reinforce_pp_baseline": "reinforce_pp_baseline_advantages",
}

__all__ = sorted([*_MODULES, *_ALIASES])


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _MODULES:
        raise AttributeError(f"module 'rlbench.algorithms' has no attribute {name!r}")
    module = _MODULES[target]
    return getattr(importlib.import_module(module if "." in module else f"rlbench.algorithms.{module}"), target)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
