"""`RMTrainConfig`: one reward-model training run (`rlbench rm`, `rlbench.reward_model.train.run_rm`)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class RMTrainConfig:
    """Train a sequence-scoring model (HF decoder + scalar head, `*ForTokenClassification`) on preference pairs with the Bradley-Terry loss."""

    data: str | None = None
    """Preference pairs: a .jsonl with `prompt`, `chosen`, `rejected` (optional `margin`) per line."""
    model: str = "tiny"
    """Where the model starts: an HF causal-LM directory (zero head), a value-model directory (its head: a reward
    model or a critic export) or a model preset (random init, zero head) (--hf-checkpoint)."""
    out: str | None = None
    """Directory for the trained model: an HF token-classification directory + tokenizer + version.json (the
    version stamp) + rm_metrics.json; None saves nothing."""
    eval_data: str | None = None
    """Held-out pairs (same format); None: hold out `eval_fraction` of `data`."""
    eval_fraction: float = 0.1
    """Share of `data` held out for the per-epoch pair accuracy when `eval_data` is None."""
    epochs: int = 1
    """Passes over the training pairs."""
    batch_size: int = 32
    """Pairs per optimizer step (the last step of an epoch takes the remainder)."""
    lr: float = 1e-4
    """Peak AdamW learning rate (linear warm-up over `warmup_steps`, then cosine to 10% at the last step)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    clip_grad: float = 1.0
    """Gradient-norm clip."""
    max_tokens: int = 4096
    """Token budget of one packed micro-batch (a pair's two sequences always share one)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template and the generation prompt, as the RL run's data does."""
    seed: int = 0
    """Seed of the held-out split, the pair order and a preset model's random init."""
    device: str = "cpu"
    """Where to train ("cpu", "cuda", "cuda:1"); on CUDA the forward runs under bf16 autocast (fp32 weights)."""
    num_threads: int | None = None
    """torch.set_num_threads for the run; None leaves the default."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("reward-model training needs data: a preference .jsonl (--data FILE) with 'prompt', "
                             "'chosen' and 'rejected' per line")
        for name in ("epochs", "batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.eval_data is None and not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in (0, 1) (or give eval_data)")
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0 or self.clip_grad <= 0:
            raise ValueError(f"lr={self.lr} and clip_grad={self.clip_grad} must be > 0, weight_decay="
                             f"{self.weight_decay} and warmup_steps={self.warmup_steps} >= 0")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r} must be 'cpu', 'cuda' or 'cuda:N'")
