"""Prompt datasets in slime's layout (.jsonl or .parquet rows with input/label/metadata keys).

    ds = PromptDataset(DataConfig(path="data/arith.jsonl", max_prompt_length=64), tokenizer)
    batch = ds.next_batch(8)          # list[PromptItem], crosses epochs, reshuffled per epoch
    state = ds.state_dict()           # {"epoch", "position", ...}: a resumed run sees the same next batches

Semantics follow slime (`slime/utils/data.py`): a str prompt becomes `[{"role": "user", ...}]` before
the chat template; `max_prompt_length` drops longer prompts at load time (counted in `num_dropped`);
each epoch is shuffled with seed `seed + epoch`. A row with images (`image_key`) needs a VLM's processor
(`rlbench.data.images.VisionProcessor`): its prompt ids carry the expanded image tokens and the item its
`ImageInputs`. The whole file is validated at load: every bad line
(invalid UTF-8 or JSON, an empty line, a non-object, a missing key, an empty prompt, a null label) is
collected and one ValueError lists the first `MAX_REPORTED` as `file:line: problem`, then a count of the
rest; nothing is silently skipped.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbench.configs.data import DataConfig
from rlbench.types import ImageInputs

MAX_REPORTED = 10
"""Bad lines listed one by one in a data error (the rest are counted)."""


class DataError(ValueError):
    """Bad rows in a prompt file; `.problems` holds every `file:line: problem` found."""

    def __init__(self, path: str, problems: list[str], total: int | None = None) -> None:
        self.path, self.problems = path, problems
        shown = problems[:MAX_REPORTED]
        more = len(problems) - len(shown)
        head = f"{path}: {len(problems)} bad line{'s' * (len(problems) != 1)}" + (f" of {total}" if total else "")
        tail = f"\n  ... and {more} more" if more else ""
        fix = "\nfix or remove these lines (every line must be a JSON object with a non-empty prompt)"
        super().__init__(problems[0] if len(problems) == 1 else head + ":\n  " + "\n  ".join(shown) + tail + fix)


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
    images: ImageInputs | None = None
    """The prompt's images as the vision tower takes them (rows with `image_key`), else None."""


def read_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of a .jsonl or .parquet file as dicts; malformed lines raise ValueError naming file:line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # optional extra: rlbench[data]

        return pq.read_table(path).to_pylist()
    rows, problems = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                rows.append(_parse_line(raw, path, lineno))
            except ValueError as exc:
                problems.append(str(exc))
    if problems:
        raise DataError(path, problems, total=lineno)
    return rows


def _parse_line(raw: bytes, path: str, lineno: int) -> dict:
    """One jsonl line as a dict, or ValueError naming `path:lineno` and the problem."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}:{lineno}: not valid UTF-8 (byte {raw[exc.start:exc.start + 1]!r} at column {exc.start + 1}); "
            "re-encode the file as UTF-8"
        ) from None
    if not line.strip():
        raise ValueError(f"{path}:{lineno}: empty line; remove it (every line must be a JSON object)")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    return row


class PromptDataset:
    """Prompts from a file, served in seeded per-epoch shuffled order with resumable position."""

    def __init__(self, cfg: DataConfig, tokenizer=None, processor=None):
        """`processor`: a VLM's `rlbench.data.images.VisionProcessor` (None: a text-only model, rows with images are
        refused)."""
        if (cfg.apply_chat_template or cfg.max_prompt_length is not None) and tokenizer is None:
            raise ValueError("apply_chat_template / max_prompt_length need a tokenizer; pass tokenizer=")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.processor = processor
        rows = read_rows(cfg.path)
        items, problems = [], []
        for i, row in enumerate(rows):
            try:
                items.append(self._make_item(row, i))
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise DataError(os.fspath(cfg.path), problems, total=len(rows))
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
        path = os.fspath(cfg.path)
        where = f"{path}: row {i + 1}" if path.endswith(".parquet") else f"{path}:{i + 1}"
        prompt = _require(row, cfg.input_key, where)
        label = _require(row, cfg.label_key, where) if cfg.label_key is not None else None
        if _is_empty_prompt(prompt):
            raise ValueError(f"{where}: empty prompt {cfg.input_key!r}={prompt!r}; give it text or remove the line")
        if cfg.label_key is not None and label is None:
            raise ValueError(
                f"{where}: null label {cfg.label_key!r}; fill it in, remove the line, or set label_key=None "
                "(--label-key) for data without labels"
            )
        metadata = row.get(cfg.metadata_key) if cfg.metadata_key is not None else None
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"{where}: {cfg.metadata_key!r} must be a dict, got {type(metadata).__name__}")
        specs = row.get(cfg.image_key) if cfg.image_key is not None else None
        if specs:
            text, ids, images = self._render_images(prompt, specs, where)
            return PromptItem(prompt=text, label=label, metadata=dict(metadata or {}), index=i, prompt_token_ids=ids,
                              images=images)
        text = self._render(prompt, where)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if self.tokenizer else None
        return PromptItem(prompt=text, label=label, metadata=dict(metadata or {}), index=i, prompt_token_ids=ids)

    def _render_images(self, prompt: Any, specs: Any, where: str):
        """`(text, ids, ImageInputs)` of a prompt with images, through the VLM's processor."""
        from rlbench.data.images import image_messages

        key = self.cfg.image_key
        if not isinstance(specs, list):
            raise ValueError(f"{where}: {key!r} must be a list of image paths or base64 strings, got "
                             f"{type(specs).__name__}")
        if self.processor is None:
            raise ValueError(f"{where}: the row has {len(specs)} images ({key!r}) but the model is text-only (no image "
                             "processor); use a vision-language model directory (with preprocessor_config.json) or "
                             "drop the images (--image-key none)")
        if not self.cfg.apply_chat_template:
            raise ValueError(f"{where}: a prompt with images needs apply_chat_template=True (the template places them)")
        base = os.path.dirname(os.path.abspath(os.fspath(self.cfg.path)))
        return self.processor.encode(image_messages(prompt, len(specs), where), specs, base, where)

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


def _is_empty_prompt(prompt: Any) -> bool:
    """None, a blank string, or a message list without any non-blank content."""
    if prompt is None or isinstance(prompt, str):
        return not (prompt or "").strip()
    if isinstance(prompt, list):
        return not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in prompt)
    return False


def _require(row: dict, key: str, where: str) -> Any:
    """`row[key]`, or a ValueError naming the missing key and the available ones."""
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r}; available keys: {sorted(row)} (set input_key/label_key)")
    return row[key]
