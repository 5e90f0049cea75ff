"""Preference pairs for reward-model training: read a jsonl, check every row, encode (prompt, response) pairs.

    pairs = load_preferences("prefs.jsonl")          # [PreferencePair], every bad row named by file:line
    ids = encode_pair(tokenizer, render_prompt(tokenizer, "1+2=?"), "\\\\boxed{3}")

A row is a JSON object with `prompt` (a string, or a list of chat messages), `chosen` and `rejected` (strings,
not equal) and an optional `margin` (a number: the Bradley-Terry loss asks chosen - rejected > margin). Other keys
(`metadata`, ...) are carried along untouched.

One encoding serves training and scoring (`rlbench.reward_model.serve`), so the model scores in serving exactly
the token layout it was trained on: the rendered prompt's tokens, the response's tokens, then the tokenizer's eos;
the score is the head's value at that final eos.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

REQUIRED = ("prompt", "chosen", "rejected")


@dataclass
class PreferencePair:
    """One preference row."""

    prompt: Any
    """The prompt: a string, or a list of chat messages."""
    chosen: str
    """The preferred response."""
    rejected: str
    """The other response."""
    margin: float | None = None
    """The row's Bradley-Terry margin (None: 0)."""
    where: str = ""
    """`file:line`, for messages."""
    extra: dict = field(default_factory=dict)
    """The row's other keys."""


def load_preferences(path: str | os.PathLike) -> list[PreferencePair]:
    """Every row of a preference jsonl, checked.

    Raises:
        ValueError: naming `file:line` and the fix, for every bad row found (up to 10 in one message): not JSON,
            not an object, a missing or null key, a non-string response, chosen == rejected, a non-numeric margin;
            or a file with no rows.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"preference data {path!r}: no such file (from {os.getcwd()}); give a .jsonl file with "
                         "'prompt', 'chosen' and 'rejected' per line")
    pairs, errors = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                pairs.append(parse_row(line, f"{path}:{n}"))
            except ValueError as exc:
                errors.append(str(exc))
    if errors:
        more = f"\n... and {len(errors) - 10} more bad rows" if len(errors) > 10 else ""
        raise ValueError("bad preference rows:\n" + "\n".join(errors[:10]) + more)
    if not pairs:
        raise ValueError(f"preference data {path!r} has no rows; give at least one 'prompt'/'chosen'/'rejected' line")
    return pairs


def parse_row(line: str, where: str) -> PreferencePair:
    """One jsonl line as a `PreferencePair`; ValueError starting with `where` names what is wrong and the fix."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); write one JSON object per line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object with {list(REQUIRED)}, got {type(row).__name__}")
    missing = [k for k in REQUIRED if row.get(k) is None]
    if missing:
        raise ValueError(f"{where}: missing {missing} (the row has {sorted(row)}); every row needs {list(REQUIRED)}")
    prompt = row["prompt"]
    if not (isinstance(prompt, str) and prompt.strip()) and not _is_messages(prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages "
                         f"({{'role', 'content'}}), got {_excerpt(prompt)}")
    for key in ("chosen", "rejected"):
        if not isinstance(row[key], str):
            raise ValueError(f"{where}: {key!r} must be a string (the response text), got "
                             f"{type(row[key]).__name__} {_excerpt(row[key])}")
    if row["chosen"] == row["rejected"]:
        raise ValueError(f"{where}: 'chosen' equals 'rejected' ({_excerpt(row['chosen'])}): the pair states no "
                         "preference; remove the line")
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin)):
        raise ValueError(f"{where}: 'margin' must be a finite number or absent, got {_excerpt(margin)}")
    extra = {k: v for k, v in row.items() if k not in (*REQUIRED, "margin")}
    return PreferencePair(prompt, row["chosen"], row["rejected"], None if margin is None else float(margin), where, extra)


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def _excerpt(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def render_prompt(tokenizer, prompt: Any, apply_chat_template: bool = True) -> str:
    """The prompt text the policy sees: through the tokenizer's chat template with the generation prompt (as
    `rlbench.data.PromptDataset` renders it), or the raw string."""
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("a message-list prompt needs apply_chat_template=True")
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_pair(tokenizer, prompt_text: str, response: str) -> list[int]:
    """Token ids of one scored sequence: rendered prompt, response, eos (the score is read at the eos)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the reward model's tokenizer has no eos token; set tokenizer.eos_token before training")
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return prompt_ids + response_ids + [tokenizer.eos_token_id]
