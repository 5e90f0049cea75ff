"""Optimizer steps per rollout and micro-batching (slime's batch flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchConfig:
    """Optimizer steps per rollout and micro-batching (slime's batch flags)."""

    global_batch_size: int = 32
    """Samples per optimizer step; rollout_batch_size x n_samples_per_prompt must be a multiple of it."""
    micro_batch_size: int = 1
    """Samples per micro-batch per DP rank (static mode; ignored with use_dynamic_batch_size)."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token budget (first-fit count, Karmarkar-Karp) instead of a fixed count."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one packed micro-batch (needed by use_dynamic_batch_size)."""
    balance_data: bool = False
    """Split samples over DP ranks by balanced token counts (Karmarkar-Karp) instead of round-robin."""
    num_rollout: int = 10
    """Rollouts (= RL steps) in the run."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "num_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch.{name}={getattr(self, name)} must be >= 1")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError("use_dynamic_batch_size=True needs max_tokens_per_gpu (e.g. --max-tokens-per-gpu 4096)")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu={self.max_tokens_per_gpu} must be >= 1")
        if not self.use_dynamic_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} must be divisible by micro_batch_size="
                f"{self.micro_batch_size}; change global_batch_size or micro_batch_size"
            )
