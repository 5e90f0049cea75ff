"""Saving and resuming the run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """Where and when to save; where to resume from."""

    save_dir: str | None = None
    """Directory for checkpoints (slime's --save); None: no periodic saves."""
    save_interval: int | None = None
    """Save every this many rollouts and at the last one (needs save_dir)."""
    load_dir: str | None = None
    """Resume from this trainer checkpoint directory (slime's --load)."""

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"save_interval={self.save_interval} must be >= 1 or None")
        if self.save_interval is not None and self.save_dir is None:
            raise ValueError(f"save_interval={self.save_interval} needs save_dir (--save DIR)")
