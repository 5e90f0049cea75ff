"""SFT warm start on any device (the GPU bench path), built from `rlbench.sft`'s pieces.

`rlbench.sft.run_sft` trains on the CPU; this runs the same recipe (same split, encoding, response-only
loss, AdamW + clipping) on `device` with bf16 autocast, for a fixed number of steps, and saves an HF dir
that `Trainer` loads. It is used by `rlbench bench` for the Qwen3-0.6B shape.

    warm_start("qwen3-0.6b-shape", "runs/sft-0.6b", device="cuda", steps=150)
"""

from __future__ import annotations

import json
import os
import time

import torch

from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import build_model, save_pretrained
from rlbench.sft import SFTConfig, collate, encode_sft, sft_loss, split_rows


def warm_start(
    preset: str, out: str, *, device: str = "cuda", steps: int = 150, batch_size: int = 64, lr: float = 3e-4,
    level: int = 3, seed: int = 0,
) -> dict:
    """Train `preset` on arithmetic `level` solutions for `steps` AdamW steps on `device`; save to `out`.

    Returns `{"sft/loss", "sft/steps", "perf/sft_time"}` (also written to `out/sft_metrics.json`).
    """
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    model = build_model(preset, device=device, seed=seed, **special)  # keeps the preset's vocab size
    train_rows, _ = split_rows(SFTConfig(task="arithmetic", task_kwargs={"level": level}, seed=seed))
    examples = encode_sft(train_rows, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    start, loss = time.perf_counter(), float("nan")
    model.train()
    for step in range(steps):
        idx = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], tokenizer.pad_token_id).items()}
        for group in opt.param_groups:  # linear warm-up over the first 10% of steps
            group["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=device != "cpu"):
            loss_t = sft_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss_t.item()
    metrics = {"sft/loss": loss, "sft/steps": steps, "perf/sft_time": time.perf_counter() - start}
    save_pretrained(model, tokenizer, out)
    with open(os.path.join(out, "sft_metrics.json"), "w") as f:
        json.dump(metrics, f)
    return metrics
