"""Where metrics go (console, jsonl, TensorBoard, wandb)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoggingConfig:
    """Where metrics go."""

    console: bool = True
    """Print one line per step with the main metrics."""
    jsonl_path: str | None = None
    """Append one JSON object per step to this file (None: off)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (needs the `tensorboard` package; None: off)."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs `wandb`; None: off)."""
    wandb_run_name: str | None = None
    """Run name for wandb (None: wandb picks one)."""
    console_keys: tuple[str, ...] = field(default_factory=tuple)
    """Extra metric keys the console line prints besides the defaults."""
    warn_skipped_steps: int = 3
    """Warn once this many optimizer steps in a row were skipped (non-finite loss or grad norm: the weights
    did not move); 0: never warn. `train/skipped` is on the console line whenever it is non-zero."""

    def __post_init__(self) -> None:
        if self.wandb_run_name is not None and self.wandb_project is None:
            raise ValueError("wandb_run_name is set but wandb_project is None; set wandb_project to log to wandb")
        if self.warn_skipped_steps < 0:
            raise ValueError(f"warn_skipped_steps={self.warn_skipped_steps} must be >= 0 (0 = never warn)")
