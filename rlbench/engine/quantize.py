"""Weight rounding for a rollout engine less precise than the trainer (`TorchEngineConfig.weight_format`).

"fp8_e4m3" is the FP8 rollout of slime/verl ("fp8 rollout, bf16 training"): each weight matrix rounded to
float8_e4m3fn with one scale per output row (row amax / 448, the e4m3 max), then kept dequantized in the
engine's dtype. The engine's matmuls stay in its dtype; only the weights' values carry the FP8 rounding.
"""

from __future__ import annotations

import torch

from rlbench.engine.config import WEIGHT_FORMATS

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


def round_to_fp8(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded to float8_e4m3fn with a per-row scale (row amax / 448), dequantized, in its own dtype.

    Rows are the first dim (a linear weight's output features); the amax is over all other dims. 1-D (and 0-D)
    tensors are returned unchanged; all-zero rows stay zero. Idempotent: a rounded tensor rounds to itself.
    """
    if tensor.dim() < 2:
        return tensor
    x = tensor.float()
    amax = x.abs().reshape(x.shape[0], -1).amax(dim=1).reshape(-1, *([1] * (x.dim() - 1)))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(tensor.dtype)


def apply_weight_format(tensor: torch.Tensor, weight_format: str | None) -> torch.Tensor:
    """`tensor` as an engine with `weight_format` stores it (None: unchanged)."""
    if weight_format is None:
        return tensor
    if weight_format == "fp8_e4m3":
        return round_to_fp8(tensor)
    raise ValueError(f"weight_format={weight_format!r} must be None or one of {WEIGHT_FORMATS}")
