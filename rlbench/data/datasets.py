"""Prompt datasets in slime's layout (.jsonl or .parquet rows with input/label/metadata keys).

    ds = PromptDataset(DataConfig(path="data/arith.jsonl", max_prompt_length=64), tokenizer)
    batch = ds.next_batch(8)          # list[PromptItem], crosses epochs, reshuffled per epoch
    state = ds.state_dict()           # {"epoch", "position", ...}: a resumed run sees the same next batches

Semantics follow slime (`slime/utils/data.py`): a str prompt becomes `[{"role": "user", ...}]` before
the chat template; `max_prompt_length` drops longer prompts at load time (counted in `num_dropped`);
each epoch is shuffled with seed `seed + epoch`. Malformed input raises ValueError with the file and
1-based line (or row) number; nothing is silently skipped.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbench.data.config import DataConfig


@dataclass
class PromptItem:
    """One prompt ready for the rollout engine."""

    prompt: str
    """Prompt text after the chat template (or the raw string without it)."""
    label: Any
    """Ground truth for the reward (None when the dataset has no label key)."""
    metadata: dict = field(default_factory=dict)
    """The row's metadata dict (e.g. `rm_type`, `solution`)."""
    index: int = 0
    """Row number in the file (0-based, before filtering): a stable id across epochs."""
    prompt_token_ids: list[int] | None = None
    """Token ids of `prompt` (no special tokens added), when the dataset has a tokenizer."""


def read_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of a .jsonl or .parquet file as dicts; malformed lines raise ValueError naming file:line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # optional extra: rlbench[data]

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                raise ValueError(f"{path}:{lineno}: empty line; remove it (every line must be a JSON object)")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


class PromptDataset:
    """Prompts from a file, served in seeded per-epoch shuffled order with resumable position."""

    def __init__(self, cfg: DataConfig, tokenizer=None):
        if (cfg.apply_chat_template or cfg.max_prompt_length is not None) and tokenizer is None:
            raise ValueError("apply_chat_template / max_prompt_length need a tokenizer; pass tokenizer=")
        self.cfg = cfg
        self.tokenizer = tokenizer
        items = [self._make_item(row, i) for i, row in enumerate(read_rows(cfg.path))]
        limit = cfg.max_prompt_length
        self.items = [it for it in items if limit is None or len(it.prompt_token_ids) <= limit]
        self.num_dropped = len(items) - len(self.items)
        if self.num_dropped:
            warnings.warn(
                f"{cfg.path}: dropped {self.num_dropped} of {len(items)} prompts longer than "
                f"max_prompt_length={limit} tokens",
                stacklevel=2,
            )
        if not self.items:
            raise ValueError(f"{cfg.path}: no prompts left (read {len(items)}, dropped {self.num_dropped})")
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def _make_item(self, row: dict, i: int) -> PromptItem:
        """A PromptItem from row `i` (0-based), checking that the configured keys exist."""
        cfg = self.cfg
        where = f"{cfg.path}: row {i + 1}"
        prompt = _require(row, cfg.input_key, where)
        label = _require(row, cfg.label_key, where) if cfg.label_key is not None else None
        metadata = row.get(cfg.metadata_key) if cfg.metadata_key is not None else None
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"{where}: {cfg.metadata_key!r} must be a dict, got {type(metadata).__name__}")
        text = self._render(prompt, where)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if self.tokenizer else None
        return PromptItem(prompt=text, label=label, metadata=dict(metadata or {}), index=i, prompt_token_ids=ids)

    def _render(self, prompt: Any, where: str) -> str:
        """The prompt text: a str or message list through the chat template, or a raw str without it."""
        if isinstance(prompt, str) and not self.cfg.apply_chat_template:
            return prompt
        if not self.cfg.apply_chat_template:
            raise ValueError(f"{where}: a message-list prompt needs apply_chat_template=True")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"{where}: prompt must be a string or a list of chat messages, got {prompt!r}")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Item order of an epoch: a permutation seeded by `seed + epoch`, or identity without shuffle."""
        if not self.cfg.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng(self.cfg.seed + epoch).permutation(len(self.items))

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next `n` prompts in epoch order, moving into the next (reshuffled) epoch when one runs out."""
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        batch = []
        while len(batch) < n:
            if self.position == len(self.items):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(batch), len(self.items) - self.position)
            batch += [self.items[j] for j in self._order[self.position : self.position + take]]
            self.position += take
        return batch

    def state_dict(self) -> dict:
        """Where the dataset stands: epoch, position within the epoch, and what the order depends on."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.cfg.seed, "size": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s epoch and position; refuses a state from a different dataset size or seed."""
        if state["size"] != len(self.items) or state["seed"] != self.cfg.seed:
            raise ValueError(
                f"dataset state is for size={state['size']} seed={state['seed']} but this dataset has "
                f"size={len(self.items)} seed={self.cfg.seed}; load it with the same file, filter and seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def _require(row: dict, key: str, where: str) -> Any:
    """`row[key]`, or a ValueError naming the missing key and the available ones."""
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r}; available keys: {sorted(row)} (set input_key/label_key)")
    return row[key]
