"""Rollout engines: the `RolloutEngine` protocol, the embedded torch engine (default) and SGLang.

Light on import: the engines (and transformers/sglang) load on first attribute access.
"""

from rlbench.rollout.base import Generation, RolloutEngine, SamplingParams

__all__ = ["Generation", "RolloutEngine", "SamplingParams", "SGLangEngine", "TorchEngine", "TorchEngineConfig"]

_LAZY = {
    "TorchEngine": "rlbench.rollout.torch_engine",
    "TorchEngineConfig": "rlbench.rollout.torch_engine",
    "SGLangEngine": "rlbench.rollout.sglang_engine",
    "SGLangEngineConfig": "rlbench.rollout.sglang_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlbench.rollout' has no attribute {name!r}")
