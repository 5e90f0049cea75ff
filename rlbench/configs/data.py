"""`DataConfig`: where the prompts come from and how they become model inputs (no tokenizer import here)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class DataConfig:
    """Where the prompts come from and how they are turned into model inputs."""

    path: str
    """A .jsonl or .parquet file of rows."""
    input_key: str = "prompt"
    """Row key of the prompt: a string or a chat-message list (slime's --input-key)."""
    label_key: str | None = "label"
    """Row key of the ground truth passed to the reward; None (`--label-key none`) for rows without a label (slime's
    --label-key)."""
    metadata_key: str | None = "metadata"
    """Row key of a per-row dict copied into the item (optional in each row; slime's --metadata-key)."""
    image_key: str | None = "images"
    """Row key of the prompt's images (a list of file paths, relative to the file's folder, or base64 strings), for
    a vision-language model; rows without it are text-only. None ignores images."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template and add the generation prompt."""
    max_prompt_length: int | None = None
    """Drop prompts longer than this many tokens at load time (needs a tokenizer); None keeps all."""
    shuffle: bool = True
    """Reshuffle the order every epoch with seed `seed + epoch` (slime's --rollout-shuffle)."""
    seed: int = 42
    """Base seed of the per-epoch shuffle (slime's --rollout-seed)."""

    def __post_init__(self) -> None:
        if not str(self.path).endswith((".jsonl", ".parquet")):
            raise ValueError(f"path={self.path!r} must end in .jsonl or .parquet")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={self.max_prompt_length} must be >= 1 or None")


TASK_NAMES = ("arithmetic", "countdown")
"""The synthetic tasks (`rlbench.data.tasks.TASKS`; tests/test_registries.py ties the two)."""


@dataclass
class TaskConfig:
    """A synthetic task whose train/eval jsonl files are generated before the run (if missing)."""

    name: str = "arithmetic"
    """Task name in `rlbench.data.tasks.TASKS` ("arithmetic" or "countdown")."""
    level: int | None = 1
    """Arithmetic difficulty level 1..4 (ignored by countdown)."""
    n_train: int = 20000
    """Rows drawn for training (held-out prompts are removed from them; = SFTConfig.num_train)."""
    n_eval: int = 128
    """Held-out prompts (= SFTConfig.num_eval: the same split as the SFT warm start)."""
    seed: int = 0
    """Generation seed (= SFTConfig.seed)."""
    out_dir: str = "runs/data"
    """Where the jsonl files are written."""

    def __post_init__(self) -> None:
        if self.name not in TASK_NAMES:
            raise ValueError(f"task name={self.name!r}; use one of {TASK_NAMES}")
        if self.n_train < 1 or self.n_eval < 1:
            raise ValueError(f"n_train={self.n_train}, n_eval={self.n_eval} must both be >= 1")

    def _stem(self) -> str:
        level = f"-l{self.level}" if self.name == "arithmetic" else ""
        return os.path.join(self.out_dir, f"{self.name}{level}-s{self.seed}")

    @property
    def train_path(self) -> str:
        return f"{self._stem()}-train{self.n_train}.jsonl"

    @property
    def eval_path(self) -> str:
        return f"{self._stem()}-eval{self.n_eval}.jsonl"
