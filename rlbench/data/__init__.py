"""Prompt data: the char-level Qwen-style tokenizer, slime-layout prompt datasets and synthetic tasks.

Light on import: each name loads its module on first access, so the tokenizer (transformers) is imported only
when it is used (`DataConfig` lives in `rlbench.configs.data`).
"""

from __future__ import annotations

import importlib

_MODULES = {
    "DataConfig": "rlbench.configs.data",
    "PromptDataset": "rlbench.data.datasets",
    "PromptItem": "rlbench.data.datasets",
    "read_rows": "rlbench.data.datasets",
    "ArithmeticConfig": "rlbench.data.tasks",
    "CountdownConfig": "rlbench.data.tasks",
    "arithmetic_level": "rlbench.data.tasks",
    "make_arithmetic": "rlbench.data.tasks",
    "make_countdown": "rlbench.data.tasks",
    "make_task": "rlbench.data.tasks",
    "verify_arithmetic": "rlbench.data.tasks",
    "verify_countdown": "rlbench.data.tasks",
    "write_jsonl": "rlbench.data.tasks",
    "build_tokenizer": "rlbench.data.tokenizer",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'rlbench.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
