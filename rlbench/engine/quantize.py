"""Weight rounding for a rollout engine less precise than the trainer (`TorchEngineConfig.weight_format`).

Each format rounds a weight matrix and keeps it dequantized in the engine's dtype: the engine's matmuls stay in
its dtype; only the weights' values carry the rounding. 1-D (and 0-D) tensors (norms, biases) are left as sent.

- "fp8_e4m3": the FP8 rollout of slime/verl ("fp8 rollout, bf16 training"): float8_e4m3fn with one scale per
  output row (row amax / 448, the e4m3 max).
- "mxfp4": OCP Microscaling FP4 (the format gpt-oss ships its MoE weights in): e2m1 values in blocks of 32
  along the input dim, one power-of-two (E8M0) scale per block, 2^(floor(log2(block amax)) - 2); values past
  6 x scale saturate to 6 x scale, as the spec's conversion does.
- "nvfp4": NVIDIA's NVFP4: e2m1 values in blocks of 16, each block's scale (block amax / 6) stored in e4m3
  relative to one float32 scale per tensor (tensor amax / (448 x 6)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlbench.configs.engine import WEIGHT_FORMATS

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative float4 e2m1 values; the index is the 3-bit code (even codes have mantissa bit 0)."""
E2M1_MAX = 6.0
"""Largest e2m1 value."""
MX_BLOCK = 32
"""Elements per MX scale block (OCP MX spec)."""
NV_BLOCK = 16
"""Elements per NVFP4 scale block."""


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


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float32 `y` rounded to the nearest e2m1 value (ties to the even code), saturating at +-6."""
    grid = torch.tensor(E2M1_GRID, device=y.device)
    mids = (grid[1:] + grid[:-1]) / 2  # [7] decision points 0.25 ... 5
    a = y.abs()
    code = torch.bucketize(a, mids)  # a on a midpoint -> the lower code
    tie_up = (code < len(mids)) & (a == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    return torch.sign(y) * grid[code + tie_up.long()]


def _blocks(tensor: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """float32 `[rows, n_blocks, block]` view of `tensor` (last dim zero-padded to a multiple of `block`) and
    the pad."""
    x = tensor.float().reshape(-1, tensor.shape[-1])
    pad = -x.shape[-1] % block
    x = F.pad(x, (0, pad))
    return x.reshape(x.shape[0], -1, block), pad


def _unblocks(q: torch.Tensor, pad: int, like: torch.Tensor) -> torch.Tensor:
    q = q.reshape(q.shape[0], -1)
    return q[:, : q.shape[1] - pad].reshape(like.shape).to(like.dtype)


def round_to_mxfp4(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded to MXFP4 (e2m1 in blocks of 32 along the last dim, scale 2^(floor(log2 amax) - 2)),
    dequantized, in its own dtype. 1-D tensors unchanged; all-zero blocks stay zero; idempotent."""
    if tensor.dim() < 2:
        return tensor
    x, pad = _blocks(tensor, MX_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)  # [rows, n_blocks, 1]
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2  # e2m1's emax is 2
    scale = torch.exp2(exp)  # a power of two: x / scale is exact
    return _unblocks(round_to_e2m1(x / scale) * scale, pad, tensor)


def round_to_nvfp4(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded to NVFP4 (e2m1 in blocks of 16 along the last dim; block scale amax / 6 rounded to e4m3
    in units of a per-tensor scale, tensor amax / (448 x 6)), dequantized, in its own dtype. 1-D unchanged."""
    if tensor.dim() < 2:
        return tensor
    x, pad = _blocks(tensor, NV_BLOCK)
    t_amax = x.abs().amax()
    global_scale = t_amax / (FP8_E4M3_MAX * E2M1_MAX) if t_amax > 0 else torch.ones_like(t_amax)
    block_scale = (x.abs().amax(dim=-1, keepdim=True) / E2M1_MAX / global_scale).to(torch.float8_e4m3fn).float()
    scale = block_scale * global_scale  # [rows, n_blocks, 1]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a block whose scale is 0 is all (near) zero
    return _unblocks(torch.where(scale > 0, round_to_e2m1(x / safe) * safe, 0.0), pad, tensor)


FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8_e4m3": round_to_fp8, "mxfp4": round_to_mxfp4, "nvfp4": round_to_nvfp4,
}
"""`TorchEngineConfig.weight_format` name -> rounding function (same keys as `WEIGHT_FORMATS`)."""
assert tuple(FORMATS) == WEIGHT_FORMATS


def weight_rounder(weight_format: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function an engine with `weight_format` stores each received matrix through (None: as sent)."""
    if weight_format is None:
        return None
    if weight_format not in FORMATS:
        raise ValueError(f"weight_format={weight_format!r} must be None or one of {WEIGHT_FORMATS}")
    return FORMATS[weight_format]

