"""Rollout engines and their contract.

`protocol.py` is the contract every engine implements (`RolloutEngine`: token ids in; token ids, log-probs,
finish reasons and weight versions out), its records (`SamplingParams`, `Generation`, `WeightBucket`) and the
optional sessions capability (`SessionEngine`, `Session`, `supports_sessions`: multi-turn without re-prefill).
The embedded torch engine: `TorchEngine` (torch_engine.py) drives `ModelRunner` (runner.py: prefill, compiled /
graph-captured decode) over `KVCache` slots (kv_cache.py), fused layers (fused.py), the engine's attention
(attention.py), the seeded sampler (sampling.py) and its kept samples (sessions.py); `megakernel/` holds the
batch-1 decode kernels behind one factory. `SGLangEngine` (sglang_engine.py) adapts an SGLang server to the same contract.
Light on import: the engines (and sglang) load on first attribute access.
"""

from rlbench.configs.engine import MegakernelConfig, TorchEngineConfig
from rlbench.engine.protocol import (
    Generation,
    RolloutEngine,
    SamplingParams,
    Session,
    SessionEngine,
    WeightBucket,
    supports_sessions,
)

__all__ = [
    "Generation", "MegakernelConfig", "RolloutEngine", "SGLangEngine", "SamplingParams", "Session", "SessionEngine",
    "TorchEngine", "TorchEngineConfig", "WeightBucket", "supports_sessions",
]

_LAZY = {"TorchEngine": "rlbench.engine.torch_engine", "SGLangEngine": "rlbench.engine.sglang_engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlbench.engine' has no attribute {name!r}")
