"""The RL side of generation: the `RolloutEngine` protocol and its records (base.py), the rollout manager
(manager.py: rewards, dynamic sampling, pass@k) and the SGLang adapter. The embedded engine is `rlbench.engine`.

Light on import: the SGLang adapter (and sglang) loads on first attribute access.
"""

from rlbench.rollout.base import Generation, RolloutEngine, SamplingParams

__all__ = ["Generation", "RolloutEngine", "SamplingParams", "SGLangEngine", "SGLangEngineConfig"]

_LAZY = {
    "SGLangEngine": "rlbench.rollout.sglang_engine",
    "SGLangEngineConfig": "rlbench.rollout.sglang_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlbench.rollout' has no attribute {name!r}")
