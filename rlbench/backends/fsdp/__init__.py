"""FSDP2 training backend: sharded HF model, packed training step, checkpoints, sleep/wake, weight export."""

from rlbench.backends.fsdp.actor import FSDPBackend
from rlbench.backends.fsdp.config import FSDPConfig, OptimConfig

__all__ = ["FSDPBackend", "FSDPConfig", "OptimConfig"]
