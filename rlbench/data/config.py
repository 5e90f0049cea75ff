"""`DataConfig`: where the prompts come from and how they become model inputs (no tokenizer import here)."""

from __future__ import annotations

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
