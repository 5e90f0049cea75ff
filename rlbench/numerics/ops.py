"""The batch-invariant ops as the model calls them: device dispatch (Triton on CUDA, `torch_ops` elsewhere) and
autograd. Only forward values must match between the engine and the trainer, so every backward is the
ordinary one (cuBLAS GEMMs, the HF RMSNorm formula, flash attention over the packed sequences on CUDA in
bf16/fp16, the attention gradient written out in float32 elsewhere), recomputed where needed.

Each op is a `torch.library` custom op (namespace `rlbench_bi`): opaque to `torch.compile`, so a compiled layer
runs these very kernels and inductor only fuses the elementwise code between them (RoPE, residual adds, the
gate x up product), which `compile_options` makes round as eager does.
"""

from __future__ import annotations

from typing import Optional  # torch.library reads the annotations: Optional parses on every torch

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
@torch.library.custom_op("rlbench_bi::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    out = x.new_empty(*x.shape[:-1], weight.shape[0])  # written through a 2-D view: the output is no view
    _impl(x).matmul(x.reshape(-1, x.shape[-1]), weight, bias, out=out.view(-1, weight.shape[0]))
    return out


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    gx = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
    gw = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose forward rows do not depend on the other rows."""
    return _linear(x, weight, bias)


# ---------------------------------------------------------------- RMSNorm
def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's (Qwen3/Llama) RMSNorm, op for op: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.library.custom_op("rlbench_bi::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not x.is_cuda:  # contiguous: a strided row (a slice of fused QKV) may take another vectorised CPU loop
        return hf_rms_norm(x.contiguous(), weight, eps)
    return _triton().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    """The gradient of `hf_rms_norm` in float32 (plain ops: a compiled backward fuses them)."""
    x, weight = ctx.saved_tensors
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    n = xf * r
    gn = grad.float() * weight.float()
    gx = (r * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
    gw = (grad.float() * n.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return gx, gw, None


_rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with HF's cast order; one program per row on CUDA (torch's reductions pick their split from the
    number of rows there), HF's own formula on the CPU (row-local already). Opaque to inductor either way."""
    return _rms_norm(x, weight, eps)


# ---------------------------------------------------------------- SiLU
@torch.library.custom_op("rlbench_bi::silu", mutates_args=())
def _silu(x: torch.Tensor) -> torch.Tensor:
    # contiguous out (the fake's layout); CPU: contiguous in too, a strided exp may take another loop
    return F.silu(x).contiguous() if x.is_cuda else torch_ops.silu(x.contiguous())


@_silu.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _silu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    xf = x.float()
    sig = torch.sigmoid(xf)
    return (grad.float() * sig * (1 + xf * (1 - sig))).to(x.dtype)


_silu.register_autograd(_silu_backward, setup_context=_silu_setup)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU: torch's elementwise kernel on CUDA (one formula per element), `torch_ops.silu` on the CPU; opaque to
    inductor, whose own SiLU is another formula."""
    return _silu(x)


@torch.library.custom_op("rlbench_bi::logsumexp_rows", mutates_args=())
def _logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    return _impl(z).logsumexp_rows(z.contiguous())


@_logsumexp_rows.register_fake
def _(z):
    return z.new_empty(z.shape[0])


def logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """`logsumexp(z, -1)` of `[M, V]` float32, each row reduced in one fixed order; opaque to inductor (a compiled
    sampling head keeps it, where inductor's own logsumexp would round otherwise). Forward only."""
    return _logsumexp_rows(z)


# ---------------------------------------------------------------- attention
def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


_cu_cache: list = [None, None]  # [host cu_seqlens, its int32 copy on the device]: one copy per forward, not per layer


def _cu_on_device(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`cu_seqlens` (host) as int32 on `device`, copied once for all layers of a pass (a copy from pageable memory
    waits for the stream, so a copy per layer would stall the backward 28 times a micro-batch)."""
    held, copy = _cu_cache
    if held is not cu_seqlens or copy.device != device:
        copy = cu_seqlens.to(device, torch.int32)
        _cu_cache[:] = [cu_seqlens, copy]
    return copy


def _flash_backward(grad, q, k, v, cu_seqlens: torch.Tensor, scale: float):
    """Causal attention's gradients per sequence, flash varlen (CUDA, bf16/fp16): the forward again for its
    log-sum-exp, then the backward; K/V heads repeated per query head and their gradients summed back."""
    b, t, h, hd = q.shape
    n, n_kv = b * t, k.shape[2]
    cu = _cu_on_device(cu_seqlens, q.device)
    longest = int(torch.diff(cu_seqlens).max())
    qf, gf = q.reshape(n, h, hd).contiguous(), grad.reshape(n, h, hd).contiguous()
    kf, vf = (x.reshape(n, n_kv, hd).repeat_interleave(h // n_kv, dim=1) for x in (k, v))
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        qf, kf, vf, cu, cu, longest, longest, 0.0, True, False, scale=scale)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        gf, qf, kf, vf, out, lse, cu, cu, longest, longest, 0.0, True, seed, offset, scale=scale)
    dk, dv = (x.view(n, n_kv, h // n_kv, hd).sum(2) for x in (dk, dv))
    return tuple(g.reshape(t.shape).to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))


MATH_BACKWARD_ROWS = 512
"""Query rows per step of `_math_backward`: its largest temporary is `[H, 512, L]` float32, not `[H, L, L]`."""


def _math_backward(grad, q, k, v, cu_seqlens: torch.Tensor, scale: float):
    """Causal attention's gradients per sequence, written out in float32 (any device and dtype), a block of query
    rows at a time (each row's softmax is its own): P = softmax(q k^T s), dv = P^T g,
    dS = P (g v^T - rowsum(g o)), dq = dS k s, dk = dS^T q s."""
    b, t, h, hd = q.shape
    n, n_kv = b * t, k.shape[2]
    qf, gf = q.reshape(n, h, hd).float(), grad.reshape(n, h, hd).float()
    kf, vf = (x.reshape(n, n_kv, hd).float().repeat_interleave(h // n_kv, dim=1) for x in (k, v))
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for start, end in _spans(cu_seqlens):
        for r0 in range(start, end, MATH_BACKWARD_ROWS):
            r1 = min(r0 + MATH_BACKWARD_ROWS, end)  # query rows [r0, r1) see keys [start, r1)
            qs, gs = (x[r0:r1].transpose(0, 1) for x in (qf, gf))  # [H, C, hd]
            ks, vs = (x[start:r1].transpose(0, 1) for x in (kf, vf))  # [H, K, hd]
            future = torch.arange(start, r1, device=q.device)[None, :] > torch.arange(r0, r1, device=q.device)[:, None]
            p = torch.softmax((qs @ ks.transpose(1, 2) * scale).masked_fill(future, float("-inf")), dim=-1)  # [H, C, K]
            ds = p * (gs @ vs.transpose(1, 2) - (gs * (p @ vs)).sum(-1, keepdim=True))
            dq[r0:r1] = (ds @ ks * scale).transpose(0, 1)
            dk[start:r1] += (ds.transpose(1, 2) @ qs * scale).transpose(0, 1)
            dv[start:r1] += (p.transpose(1, 2) @ gs).transpose(0, 1)
    dk, dv = (x.view(n, n_kv, h // n_kv, hd).sum(2) for x in (dk, dv))
    return tuple(g.reshape(t.shape).to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))


def _flash_ok(q: torch.Tensor) -> bool:
    """Whether the backward can run flash attention (CUDA, half precision, head_dim <= 256)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256


@torch.library.custom_op("rlbench_bi::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, tok0: torch.Tensor,
               ntok: torch.Tensor, kb: torch.Tensor, kstart: torch.Tensor, kprefix: Optional[torch.Tensor],  # noqa: UP045
               klane: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], kstride: int,  # noqa: UP045
               scale: float) -> torch.Tensor:
    grouped = {} if kprefix is None else {"tile_kprefix": kprefix, "tile_klane": klane, "kstride": kstride}
    return _impl(q).attention(q, k, v, positions, tok0, ntok, kb, kstart, scale, **grouped)


@_attention.register_fake
def _(q, k, v, positions, tok0, ntok, kb, kstart, kprefix, klane, cu_seqlens, kstride, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("rlbench_bi::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_flash_backward if _flash_ok(q) else _math_backward)(grad, q, k, v, cu_seqlens, scale)


@_attention_backward.register_fake
def _(grad, q, k, v, cu_seqlens, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real ones


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, scale = inputs[0], inputs[1], inputs[2], inputs[10], inputs[12]
    ctx.save_for_backward(q, k, v)
    ctx.cu_seqlens, ctx.scale = cu_seqlens, scale


def _attention_grad(ctx, grad):
    q, k, v = ctx.saved_tensors
    if ctx.cu_seqlens is None:
        raise RuntimeError("batch-invariant attention against a KV cache has no backward (decode is inference)")
    gq, gk, gv = _attention_backward(grad, q, k, v, ctx.cu_seqlens, ctx.scale)
    return gq, gk, gv, *([None] * 10)


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, scale: float) -> torch.Tensor:
    """Fixed-block causal attention (`rlbench.numerics.layout`): q `[B, T, H, hd]`, k/v `[KB, L, n_kv, hd]`
    -> `[B, T, H, hd]`. Differentiable when the keys are the queries' own tokens (`tiles.documents`)."""
    return _attention(q, k, v, tiles.positions, tiles.tok0, tiles.ntok, tiles.kb, tiles.kstart, tiles.kprefix,
                      tiles.klane, tiles.cu_seqlens, tiles.kstride, float(scale))
