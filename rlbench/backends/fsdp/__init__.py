"""FSDP2 training backend: sharded HF model, packed training step, checkpoints, sleep/wake, weight export.

Light on import: `TrainConfig` / `OptimConfig` come from config.py (no torch import); `FSDPBackend` loads the
actor (transformers, torch.distributed) on first access.
"""

from rlbench.configs.backend import OptimConfig, TrainConfig

__all__ = ["FSDPBackend", "TrainConfig", "OptimConfig"]


def __getattr__(name: str):
    if name == "FSDPBackend":
        from rlbench.backends.fsdp.actor import FSDPBackend

        return FSDPBackend
    raise AttributeError(f"module 'rlbench.backends.fsdp' has no attribute {name!r}")
