"""Tool-use warm start: SFT on arithmetic transcripts that call the calculator, so that RL starts from a model that
knows the call syntax (a random char-level model never writes a JSON tool call).

    model_dir = tool_warm_start(ToolSFTConfig(preset="small", level=4, tool_fraction=0.5, out="runs/sft-tools"))
    model_dir = cached_tool_warm_start(ToolSFTConfig(preset="tiny", level=3, steps=400))  # built once, in the cache

A tool transcript is the sample the multi-turn rollout would produce: `format_call("calculator", {"expression": q})`,
the observation `observation_text(answer)` (not trained on: loss mask 0, as in RL), then `\\boxed{answer}<|im_end|>`;
`calls` > 1 calls the calculator that many times before answering. The other rows (`1 - tool_fraction`) answer
directly. With a `tool_fraction` below 1 the warm start uses the tool only part of the time, which RL can change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from rlbench.cache import build_once, cache_dir, recipe_key
from rlbench.data.tasks import make_task
from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import build_model, save_pretrained
from rlbench.rollout.multiturn.syntax import format_call, observation_text
from rlbench.sft import train_step


@dataclass
class ToolSFTConfig:
    """One tool-use warm start on the arithmetic task."""

    preset: str = "small"
    """Model preset (random init, the char tokenizer's 128 ids)."""
    level: int = 4
    """Arithmetic level (`rlbench.data.tasks.ARITHMETIC_LEVELS`)."""
    tool_fraction: float = 0.5
    """Fraction of training rows answered through the calculator; the rest answer directly."""
    calls: int = 1
    """Calculator calls per tool transcript before the answer."""
    num_train: int = 4000
    """Training rows drawn."""
    batch_size: int = 32
    """Transcripts per optimizer step."""
    steps: int = 300
    """Optimizer steps."""
    lr: float = 1e-3
    """AdamW learning rate (20 warm-up steps, then constant)."""
    seed: int = 0
    """Seed of the rows, the init and the batch order."""
    out: str | None = None
    """HF directory to save model + tokenizer to (None: nothing saved)."""

    def __post_init__(self) -> None:
        if not 0 <= self.tool_fraction <= 1:
            raise ValueError(f"tool_fraction={self.tool_fraction} must be in [0, 1]")
        for name in ("calls", "num_train", "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def transcript(row: dict, use_tool: bool, calls: int = 1) -> list[tuple[str, int]]:
    """A row's response as `(text, trained)` segments: calls and observations, then the boxed answer."""
    question = row["prompt"].removesuffix("=?")
    answer = f"\\boxed{{{row['label']}}}<|im_end|>"
    if not use_tool:
        return [(answer, 1)]
    turns = [(format_call("calculator", {"expression": question}), 1), (observation_text(str(row["label"])), 0)]
    return turns * calls + [(answer, 1)]


def encode(prompt: str, segments: list[tuple[str, int]], tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, labels) of the chat-templated prompt + segments; labels -100 off the trained segments. Each
    segment is tokenized alone, as the rollout tokenizes observations."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    for text, trained in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        labels += seg if trained else [-100] * len(seg)
    return ids, labels


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids` / `attention_mask` / `labels` `[B, L]`."""
    width = max(len(ids) for ids, _ in examples)
    batch = {"input_ids": torch.full((len(examples), width), pad_id), "labels": torch.full((len(examples), width), -100),
             "attention_mask": torch.zeros((len(examples), width), dtype=torch.long)}
    for b, (ids, labels) in enumerate(examples):
        batch["input_ids"][b, : len(ids)] = torch.tensor(ids)
        batch["labels"][b, : len(ids)] = torch.tensor(labels)
        batch["attention_mask"][b, : len(ids)] = 1
    return batch


def tool_warm_start(cfg: ToolSFTConfig, tokenizer=None):
    """Train the warm start; returns `cfg.out` when set (saved as an HF directory), else the model. `tokenizer`: the
    char tokenizer (`rlbench.data.build_tokenizer()`) unless given (one with the same 128 ids)."""
    tokenizer = tokenizer or build_tokenizer()
    model = build_model(cfg.preset, seed=cfg.seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    rows = make_task("arithmetic", cfg.num_train, seed=cfg.seed, level=cfg.level)
    use_tool = np.random.default_rng(cfg.seed).random(len(rows)) < cfg.tool_fraction  # [N]
    examples = [encode(r["prompt"], transcript(r, bool(u), cfg.calls), tokenizer) for r, u in zip(rows, use_tool)]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 20))
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    for _ in range(cfg.steps):
        picks = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        train_step(model, opt, collate([examples[i] for i in picks], tokenizer.pad_token_id))
        sched.step()
    model.eval()
    if cfg.out is None:
        return model
    os.makedirs(cfg.out, exist_ok=True)
    save_pretrained(model, tokenizer, cfg.out)
    return cfg.out


def tool_sft_recipe(cfg: ToolSFTConfig, tokenizer=None) -> dict:
    """What a warm start is built from: every field of `cfg` but `out`, and the token ids of one tool transcript and
    one direct one (so a change of the call syntax, the observation format or the chat template changes it too)."""
    tokenizer = tokenizer or build_tokenizer()
    row = {"prompt": "47+38=?", "label": 85}
    return {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out"},
            "transcripts": [encode(row["prompt"], transcript(row, use_tool, cfg.calls), tokenizer)[0]
                            for use_tool in (True, False)]}


def cached_tool_warm_start(cfg: ToolSFTConfig, root: str | None = None) -> str:
    """The warm start of `cfg`, trained once into `root` (default `cache_dir()`) and reused: the HF directory
    `tool-sft-<preset>-level<level>-<key>`, the key a hash of `tool_sft_recipe(cfg)`, so a changed recipe is built
    anew. An unfinished directory is built again, never loaded (`rlbench.cache.build_once`). `cfg.out` must be None:
    the cache picks the directory."""
    if cfg.out is not None:
        raise ValueError(f"cached_tool_warm_start picks its own directory; got out={cfg.out!r}: leave it None, "
                         f"or call tool_warm_start to train into {cfg.out!r}")
    recipe = tool_sft_recipe(cfg)
    out = os.path.join(root or cache_dir(), f"tool-sft-{cfg.preset}-level{cfg.level}-{recipe_key(recipe)}")
    return build_once(out, recipe, lambda tmp: tool_warm_start(dataclasses.replace(cfg, out=tmp)),
                      what=f"tool-use SFT warm start ({cfg.steps} steps)")
