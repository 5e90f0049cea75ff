"""megatron-core training backend (optional extra `rlbench[megatron]`): TP / PP / SP / DP behind `TrainBackend`.

Light on import: `MegatronConfig` has no torch import; `MegatronBackend` (megatron-core) loads on first access.
"""

from rlbench.configs.megatron import MegatronConfig

__all__ = ["MegatronBackend", "MegatronConfig"]


def __getattr__(name: str):
    if name == "MegatronBackend":
        from rlbench.backends.megatron.backend import MegatronBackend

        return MegatronBackend
    raise AttributeError(f"module 'rlbench.backends.megatron' has no attribute {name!r}")
