"""SFT warm start of a VLM preset on the synthetic shapes task (`rlbench.data.shapes`), saved as an HF directory.

    path = shapes_warm_start(ShapesSFTConfig(kind="colour", steps=30, out="runs/vlm-warm"))

A random tiny-vl model (vision tower frozen, as in RL) learns the answer format and part of the mapping from a few
steps of next-token cross-entropy on the answers (`label` + `<|im_end|>`); the directory holds the model (HF default
layout), the char tokenizer with image tokens and the image processor, so `rlbench train --hf-checkpoint` and the
Trainer load it like any VLM directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlbench.configs.data import DataConfig
from rlbench.data.datasets import PromptDataset
from rlbench.data.shapes import write_shapes_task
from rlbench.data.tokenizer import build_tokenizer
from rlbench.models.vlm import auto_model_class, build_vlm_config, preset_processor


@dataclass
class ShapesSFTConfig:
    """The warm start: task, steps, optimizer, output."""

    kind: str = "colour"
    """The shapes task kind ("colour" or "count")."""
    steps: int = 30
    """Optimizer steps (few: GRPO is to have room left)."""
    batch_size: int = 16
    """Prompts per step."""
    lr: float = 3e-3
    """AdamW learning rate."""
    n_train: int = 512
    """Task rows written (the GRPO run reads the same files)."""
    seed: int = 0
    """Model init, batch order and task seed."""
    data_dir: str = "runs/data/shapes"
    """Where the task's jsonl and images go."""
    out: str = "runs/vlm-warm"
    """The HF directory written."""


def collate(items, pad_id: int, eos_id: int) -> dict[str, torch.Tensor]:
    """A right-padded batch of prompt items with their answers: input ids, mask, labels (-100 off the answer), the
    images in order and their token types."""
    seqs = [(it.prompt_token_ids, it.metadata["answer_ids"] + [eos_id]) for it in items]
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, (p, a) in enumerate(seqs):
        ids[b, : len(p) + len(a)] = torch.tensor(p + a)
        labels[b, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask[b, : len(p) + len(a)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "pixel_values": torch.cat([it.images.pixel_values for it in items]),
            "image_grid_thw": torch.cat([it.images.image_grid_thw for it in items])}


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens."""
    types = (batch["input_ids"] == model.config.image_token_id).int()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], mm_token_type_ids=types,
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=-100)


def shapes_warm_start(cfg: ShapesSFTConfig) -> str:
    """Train the warm start into `cfg.out` (once: an existing directory is reused); returns the directory."""
    if os.path.isfile(os.path.join(cfg.out, "config.json")):
        return cfg.out
    train, _ = write_shapes_task(cfg.data_dir, kind=cfg.kind, n_train=cfg.n_train, seed=cfg.seed)
    tokenizer = build_tokenizer(128, vision=True)
    processor = preset_processor("tiny-vl", tokenizer)
    items = PromptDataset(DataConfig(path=train, seed=cfg.seed), tokenizer, processor).items
    for it in items:
        it.metadata["answer_ids"] = tokenizer(str(it.label), add_special_tokens=False)["input_ids"]
    config = build_vlm_config("tiny-vl")
    torch.manual_seed(cfg.seed)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    model.model.visual.requires_grad_(False)  # as the RL run trains it (--freeze-vision)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.steps):
        pick = torch.randperm(len(items), generator=gen)[: cfg.batch_size].tolist()
        loss = sft_loss(model, collate([items[i] for i in pick], tokenizer.pad_token_id, tokenizer.eos_token_id))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for it in items:
        it.metadata.pop("answer_ids")
    model.save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    processor.image_processor.save_pretrained(cfg.out)
    return cfg.out
