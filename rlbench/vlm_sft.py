"""SFT warm start of a VLM preset on the synthetic shapes task (`rlbench.data.shapes`), saved as an HF directory.

    path = shapes_warm_start(ShapesSFTConfig(kind="colour", out="runs/vlm-warm"))

A random tiny-vl model (vision tower frozen at its random init, as in RL) learns the answer format and part of the
image -> answer mapping from next-token cross-entropy on the answers (`label` + `<|im_end|>`). Every `eval_every`
steps it measures p(answer): the mean probability that sampling at temperature 1 writes exactly the label and then
`<|im_end|>` (the expected exact-match reward of one sample, a lower bound), over the first `num_probe` training
rows, and stops once it reaches `target`, so GRPO starts with headroom (the held-out split stays unseen). The
directory holds the model (HF default layout), the char tokenizer with image tokens, the image processor and
`shapes_sft.json` (config and history), so `rlbench train --hf-checkpoint` and the Trainer load it like any VLM
directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

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
    steps: int = 200
    """Most optimizer steps (it stops earlier at `target`)."""
    batch_size: int = 16
    """Prompts per step."""
    lr: float = 3e-3
    """AdamW learning rate."""
    target: float | None = 0.45
    """Stop once p(answer) on the probe rows reaches this (GRPO is to have room left); None trains all `steps`."""
    eval_every: int = 10
    """Measure p(answer) every this many steps."""
    num_probe: int = 64
    """Training rows p(answer) is measured on."""
    n_train: int = 512
    """Task rows written (the GRPO run reads the same files)."""
    seed: int = 0
    """Model init, batch order and task seed."""
    data_dir: str = "runs/data/shapes"
    """Where the task's jsonl and images go."""
    out: str = "runs/vlm-warm"
    """The HF directory written."""

    def __post_init__(self) -> None:
        if self.target is not None and not 0 < self.target <= 1:
            raise ValueError(f"target={self.target} must be in (0, 1] or None (train all steps)")
        for name in ("steps", "batch_size", "eval_every", "num_probe"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


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


def answer_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log-probs [B, L-1], mask [B, L-1])` of each next token, the mask on the answer tokens."""
    types = (batch["input_ids"] == model.config.image_token_id).int()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], mm_token_type_ids=types,
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"], use_cache=False).logits
    labels = batch["labels"][:, 1:]  # [B, L-1]
    mask = labels != -100
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return logp * mask, mask


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens."""
    logp, mask = answer_logprobs(model, batch)
    return -logp.sum() / mask.sum()


@torch.no_grad()
def p_answer(model, batch: dict[str, torch.Tensor]) -> float:
    """Mean over the batch of p(the whole answer), the expected exact-match reward of one sample at temperature 1."""
    logp, _ = answer_logprobs(model, batch)
    return logp.sum(-1).exp().mean().item()


def shapes_warm_start(cfg: ShapesSFTConfig) -> str:
    """Train the warm start into `cfg.out` once (a directory built from the same config is reused; one built from
    another config is refused); returns the directory. `shapes_sft.json` there holds the config and the p(answer)
    history `[{"step", "loss", "p_answer"}]`."""
    record = os.path.join(cfg.out, "shapes_sft.json")
    if os.path.isfile(record):
        with open(record) as f:
            saved = json.load(f)["config"]
        if saved != asdict(cfg):
            raise ValueError(f"{cfg.out} holds a warm start of another config ({saved}); remove it or pick another out")
        return cfg.out
    if os.path.exists(cfg.out) and os.listdir(cfg.out):
        raise ValueError(f"{cfg.out!r} exists but holds no finished warm start (no shapes_sft.json); remove it")
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
    probe = collate(items[: cfg.num_probe], tokenizer.pad_token_id, tokenizer.eos_token_id)
    history = []
    for step in range(1, cfg.steps + 1):
        pick = torch.randperm(len(items), generator=gen)[: cfg.batch_size].tolist()
        loss = sft_loss(model, collate([items[i] for i in pick], tokenizer.pad_token_id, tokenizer.eos_token_id))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            history.append({"step": step, "loss": loss.item(), "p_answer": p_answer(model, probe)})
            if cfg.target is not None and history[-1]["p_answer"] >= cfg.target:
                break
    for it in items:
        it.metadata.pop("answer_ids")
    model.save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    processor.image_processor.save_pretrained(cfg.out)
    with open(record, "w") as f:
        json.dump({"config": asdict(cfg), "history": history}, f, indent=1)
    return cfg.out
