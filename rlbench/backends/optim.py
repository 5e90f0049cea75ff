"""AdamW over (possibly DTensor) parameters and Megatron-style LR schedules (warmup, then decay to min_lr)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from rlbench.configs.backend import OptimConfig


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then constant/linear/cosine decay.

    Warmup: `warmup_init_lr -> lr` over `warmup_steps`; then over `decay_steps` the lr goes
    `lr -> min_lr` (linear or half-cosine) and stays at `min_lr` afterwards.
    """
    if step < cfg.warmup_steps:
        return cfg.warmup_init_lr + (cfg.lr - cfg.warmup_init_lr) * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    if cfg.lr_schedule == "linear":
        frac = 1.0 - progress
    else:
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * frac


def build_optimizer(params, cfg: OptimConfig, *, fused: bool) -> torch.optim.AdamW:
    """AdamW; `fused=True` (CUDA params) runs one kernel for all tensors, otherwise the foreach path."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """A LambdaLR whose multiplier is `lr_at(step) / lr` (stepped once per optimizer step)."""
    if cfg.lr == 0:
        return LambdaLR(optimizer, lambda step: 0.0)
    return LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW state now, equal to a fresh optimizer's (step 0, zero moments).

    torch.distributed.checkpoint's `get_state_dict` initialises missing state with a zero-grad, lr=0
    `step()`, which leaves `step = 1` and silently changes the bias correction of the first real step
    (saving a checkpoint before training would change training). Doing it here, then resetting the
    step counters, makes save/load before the first step a no-op.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()
