"""The embedded torch engine: continuous batching over a slot KV cache on the HF model itself.

`TorchEngine` (torch_engine.py) drives `ModelRunner` (runner.py: prefill, compiled / graph-captured decode)
over `KVCache` slots (kv_cache.py), fused layers (fused.py), the engine's attention (attention.py) and the
seeded sampler (sampling.py); `megakernel/` holds the batch-1 decode kernels behind one factory.
Configs live in config.py (no torch import). Light on import: the engine loads on first attribute access.
"""

from rlbench.engine.config import MegakernelConfig, TorchEngineConfig

__all__ = ["MegakernelConfig", "TorchEngine", "TorchEngineConfig"]


def __getattr__(name: str):
    if name == "TorchEngine":
        from rlbench.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module 'rlbench.engine' has no attribute {name!r}")
