"""The TrainBackend protocol: what the Trainer may call on any training backend (FSDP, Megatron).

The Trainer never branches on the backend type; everything it needs goes through these methods.
Loss math lives in `rlbench.algorithms`: `train` receives a loss callable and per-micro-batch inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

# loss_fn(logp [R], entropy [R] | None, inputs) -> (scalar loss, metrics of weighted sums)
LossFn = Callable[[torch.Tensor, "torch.Tensor | None", Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass
class PackOutputs:
    """Per-token model outputs of one pack, in response space (`[R]`, concatenated over its sequences)."""

    log_probs: torch.Tensor  # [R] fp32, log p(token) under softmax(logits / temperature)
    entropy: torch.Tensor | None  # [R] fp32 entropy of the same tempered distribution, or None
    response_lengths: list[int]  # per sequence; sums to R

    def per_sample(self) -> list[torch.Tensor]:
        """`log_probs` split into one tensor per sequence."""
        return list(torch.split(self.log_probs, self.response_lengths))


@runtime_checkable
class TrainBackend(Protocol):
    """A data-parallel training backend. All methods are collective over the backend's ranks."""

    def init(self) -> int:
        """Build process groups, model(s), optimizer; return the step to resume from."""
        ...

    def compute_log_prob(
        self, packs: Sequence[Any], *, model: str = "actor", with_entropy: bool = False
    ) -> list[PackOutputs]:
        """No-grad log-probs (and entropy) of each pack's response tokens under "actor" or "ref"."""
        ...

    def train(self, packs: Sequence[Any], loss_inputs: Sequence[Any], loss_fn: LossFn | None = None) -> dict:
        """One optimizer step over this rank's micro-batches; returns flat `train/*` metrics."""
        ...

    def save(self, step: int | None = None, extra: dict[str, Any] | None = None) -> str:
        """Checkpoint everything needed to resume exactly, atomically; returns the committed directory.

        `extra` (file name -> picklable object) is written inside the checkpoint before it is committed (the
        Trainer's loop state), so a checkpoint is all there or not at all. Layout and tracker (the only source
        of "latest"): `rlbench.backends.checkpoint` (docs/ARCHITECTURE.md, TrainBackend).
        """
        ...

    def load(self, step: int | None = None) -> int:
        """Restore a checkpoint (default: the latest finished one); returns its step."""
        ...

    def latest_step(self) -> int | None:
        """The step of the latest committed checkpoint under `cfg.checkpoint_dir`, None when there is none."""
        ...

    def committed_steps(self) -> list[int]:
        """Steps of every committed checkpoint under `cfg.checkpoint_dir`, ascending."""
        ...

    def committed_file(self, step: int, name: str) -> str | None:
        """The path of the file `save(extra={name: ...})` committed with checkpoint `step` (None when that
        checkpoint has none; a ValueError when there is no committed checkpoint `step`). The Trainer finds its
        loop state with these three, never with the layout itself."""
        ...

    def state_tensors(self) -> list[torch.Tensor]:
        """The device tensors of the training state (what `sleep` parks; the memory plan measures them)."""
        ...

    def sleep(self) -> dict:
        """Release device memory held by training state; returns `memory/*` and `perf/*` metrics."""
        ...

    def wake_up(self) -> dict:
        """Bring the training state back to the device, bit-exactly."""
        ...

    def named_weights_for_sync(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights under HF names, cast to `dtype`, in buckets of about `bucket_bytes`."""
        ...
