"""The records that flow through the RL loop: one `Sample` per generated response.

A `Sample` is what the rollout engine produces, the reward function scores, packing consumes and the
trainer annotates. Every list in response space has exactly `response_length` entries.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Why generation of a sample ended."""

    COMPLETED = "completed"  # hit a stop token / stop string
    TRUNCATED = "truncated"  # hit max_new_tokens (finish reason "length")
    ABORTED = "aborted"  # stopped by the caller (e.g. dynamic sampling had enough groups)
    FAILED = "failed"  # generation or reward raised


@dataclass
class ImageInputs:
    """A prompt's images as the model's vision tower takes them (Qwen2-VL/2.5-VL layout), and where they came from.

    Attributes:
        pixel_values: `[P, C * temporal_patch * patch * patch]` float tensor, the patches of every image in order.
        image_grid_thw: `[N, 3]` long tensor, per image its (temporal, height, width) patch grid; image i has
            `prod(grid[i]) // merge**2` placeholder tokens in the prompt.
        sources: per image, what the data row gave (a file path, or "base64" for inline data), for display.
    """

    pixel_values: Any
    image_grid_thw: Any
    sources: list[str] = field(default_factory=list)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


@dataclass
class Sample:
    """One prompt + response, in token space.

    Attributes:
        tokens: prompt + response token ids, `len == prompt_length + response_length`.
        response_length: number of generated tokens at the end of `tokens`.
        loss_mask: per response token, 1 = trained on, 0 = ignored (e.g. tool output). Length `response_length`.
        rollout_log_probs: per response token, the engine's log-prob of the sampled token under the sampling
            temperature. Length `response_length`, or None when the engine did not return them.
        reward: scalar reward after scoring (None before `score`).
        advantage: scalar advantage (GRPO-style estimators); token-level estimators fill `token_advantages`.
        token_advantages: per response token advantages, or None.
        group_index: id of the prompt group (the n samples of one prompt share it).
        index: global sample id within the run.
        weight_version: policy version (optimizer-step count of the weights) that generated the sample.
        status: how generation ended.
        prompt: the prompt text (after the chat template) or message list, for display.
        label: ground truth passed to the reward function.
        response: decoded response text (for rewards and display).
        metadata: free-form per-sample data from the dataset.
        images: the prompt's images (a VLM prompt), or None; the trainer's forward feeds them to the vision tower.
    """

    tokens: list[int]
    response_length: int
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    reward: float | None = None
    advantage: float | None = None
    token_advantages: list[float] | None = None
    group_index: int = 0
    index: int = 0
    weight_version: int = 0
    status: Status = Status.COMPLETED
    prompt: Any = None
    label: Any = None
    response: str = ""
    metadata: dict = field(default_factory=dict)
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(
                f"response_length={self.response_length} must be in [0, len(tokens)={len(self.tokens)}]"
            )
        if len(self.loss_mask) != self.response_length:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries but response_length={self.response_length}"
            )
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs has {len(self.rollout_log_probs)} entries but "
                f"response_length={self.response_length}"
            )

    @property
    def total_length(self) -> int:
        return len(self.tokens)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]
