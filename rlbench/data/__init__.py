"""Prompt data: the char-level Qwen-style tokenizer, slime-layout prompt datasets and synthetic tasks."""

from rlbench.data.datasets import DataConfig, PromptDataset, PromptItem, read_rows
from rlbench.data.tasks import (
    ArithmeticConfig,
    CountdownConfig,
    arithmetic_level,
    make_arithmetic,
    make_countdown,
    make_task,
    verify_arithmetic,
    verify_countdown,
    write_jsonl,
)
from rlbench.data.tokenizer import build_tokenizer

__all__ = [
    "ArithmeticConfig",
    "CountdownConfig",
    "DataConfig",
    "PromptDataset",
    "PromptItem",
    "arithmetic_level",
    "build_tokenizer",
    "make_arithmetic",
    "make_countdown",
    "make_task",
    "read_rows",
    "verify_arithmetic",
    "verify_countdown",
    "write_jsonl",
]
