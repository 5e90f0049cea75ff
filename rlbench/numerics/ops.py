"""The batch-invariant ops as the model calls them: device dispatch (Triton on CUDA, `torch_ops` elsewhere) and
autograd. Only forward values must match between the engine and the trainer, so every backward is the
ordinary one (cuBLAS GEMMs, the HF RMSNorm formula, flash varlen attention on CUDA in bf16/fp16 and SDPA per
sequence elsewhere), recomputed where needed.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from rlbench.numerics import torch_ops
from rlbench.numerics.layout import Tiles


def _triton():
    try:
        from rlbench.numerics import triton_ops
    except ImportError as err:  # triton missing or too old
        raise RuntimeError(
            f"batch-invariant numerics on CUDA need Triton ({err}); install triton (pip install triton) or run "
            "without true_on_policy_mode / batch_invariant"
        ) from err
    return triton_ops


def _impl(t: torch.Tensor):
    return _triton() if t.is_cuda else torch_ops


def tokens_per_tile(device: torch.device, group: int) -> int:
    """Query tokens per attention tile on `device` for `group` query heads per KV head."""
    return (_triton() if device.type == "cuda" else torch_ops).tokens_per_tile(group)


# ---------------------------------------------------------------- linear
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = x.new_empty(*x.shape[:-1], weight.shape[0])  # written through a 2-D view: the output is no view
        _impl(x).matmul(x.reshape(-1, x.shape[-1]), weight, bias, out=out.view(-1, weight.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose forward rows do not depend on the other rows."""
    return _Linear.apply(x, weight, bias)


# ---------------------------------------------------------------- RMSNorm
def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's (Qwen3/Llama) RMSNorm, op for op: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        out = _triton().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(hf_rms_norm(xr, wr, ctx.eps), (xr, wr), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with HF's cast order; one program per row on CUDA (torch's reductions pick their split from the
    number of rows there), HF's own formula on the CPU (row-local already)."""
    return _RMSNorm.apply(x, weight, eps) if x.is_cuda else hf_rms_norm(x, weight, eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU: torch's elementwise kernel on CUDA (one formula per element), `torch_ops.silu` on the CPU."""
    return F.silu(x) if x.is_cuda else torch_ops.silu(x)


def logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """`logsumexp(z, -1)` of `[M, V]` float32, each row reduced in one fixed order."""
    return _impl(z).logsumexp_rows(z.contiguous())


# ---------------------------------------------------------------- attention
def _reference(q, k, v, tiles: Tiles, scale: float) -> torch.Tensor:
    """Differentiable causal attention per sequence (SDPA), for the backward: q `[B, T, H, hd]`, k/v
    `[B, T, n_kv, hd]` -> `[B, T, H, hd]`."""
    docs = tiles.documents
    group = q.shape[2] // k.shape[2]
    out = torch.zeros_like(q)
    for row, start, length in zip(docs.row.tolist(), docs.start.tolist(), docs.length.tolist()):
        span = slice(start, start + length)
        qd = q[row, span].transpose(0, 1)[None]  # [1, H, n, hd]
        kd = k[row, span].transpose(0, 1).repeat_interleave(group, dim=0)[None]
        vd = v[row, span].transpose(0, 1).repeat_interleave(group, dim=0)[None]
        out[row, span] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


def _varlen_reference(q, k, v, tiles: Tiles, scale: float) -> torch.Tensor:
    """`_reference` in one flash varlen call (CUDA, bf16/fp16): the documents tile the `B*T` flat tokens in order
    (`layout.documents`), so their starts are the cumulative sequence lengths."""
    from torch.nn.attention.varlen import varlen_attn

    docs = tiles.documents
    b, t, h, hd = q.shape
    starts = docs.row * t + docs.start
    cu = torch.cat([starts, starts.new_tensor([b * t])]).to(q.device, torch.int32, non_blocking=True)
    longest = int(docs.length.max())
    k, v = k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:])
    if k.shape[1] != h:  # GQA: torch < 2.13's varlen_attn takes no enable_gqa (flash reads the copies once)
        k, v = k.repeat_interleave(h // k.shape[1], dim=1), v.repeat_interleave(h // v.shape[1], dim=1)
    causal = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}  # torch 2.11: is_causal
    out = varlen_attn(q.reshape(b * t, h, hd), k, v, cu, cu, longest, longest, scale=scale, **causal)
    return out.view(b, t, h, hd)


def _varlen_params() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN_PARAMS = _varlen_params()


def _flash_varlen(q: torch.Tensor) -> bool:
    """Whether the backward can run `_varlen_reference` (CUDA, half precision, a varlen_attn taking a scale)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and "scale" in _VARLEN_PARAMS


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles: Tiles, scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.tiles, ctx.scale = tiles, scale
        return _impl(q).attention(q, k, v, *tiles.kernel_args, scale, **tiles.kernel_kwargs)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        if ctx.tiles.documents is None:
            raise RuntimeError("batch-invariant attention against a KV cache has no backward (decode is inference)")
        with torch.enable_grad():
            qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
            reference = _varlen_reference if _flash_varlen(q) else _reference
            out = reference(qr, kr, vr, ctx.tiles, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qr, kr, vr), grad)
        return gq, gk, gv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, scale: float) -> torch.Tensor:
    """Fixed-block causal attention (`rlbench.numerics.layout`): q `[B, T, H, hd]`, k/v `[KB, L, n_kv, hd]`
    -> `[B, T, H, hd]`. Differentiable when the keys are the queries' own tokens (`tiles.documents`)."""
    return _Attention.apply(q, k, v, tiles, scale)
