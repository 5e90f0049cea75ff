"""Trainer-to-engine weight sync."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes weights may be cast to before sending (torch attribute names)."""


@dataclass
class WeightSyncConfig:
    """How trainer weights reach the rollout engine."""

    bucket_bytes: int = 512 << 20
    """Maximum bytes per bucket (slime's --update-weight-buffer-size, default 512 MiB)."""
    dtype: str | None = None
    """Cast weights to this dtype before sending ("bfloat16", "float16", "float32"; None: the engine's dtype)."""
    verify: bool = False
    """After each sync, compare per-tensor checksums of what was sent with the engine's weights."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1 << 10:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is below 1 KiB; pass e.g. 512 << 20")
        if self.dtype is not None and self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight-sync dtype={self.dtype!r} must be None or one of {sorted(WEIGHT_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The `torch.dtype` of `dtype` (None: keep the storage dtype)."""
        if self.dtype is None:
            return None
        import torch

        return getattr(torch, self.dtype)
