"""The engine's decoder-layer forwards: its own fused-weight forward for the HF Qwen3/Qwen2/Llama family, and
the HF layer's own forward as the fallback (any other architecture, or `fused_weights=False`).

Fused weights: per layer, q/k/v_proj become one `[(H + 2 n_kv) hd, D]` matmul and gate/up_proj one
`[2 I, D]` matmul (7 GEMMs per layer -> 4; at batch 1 each small GEMM is launch/tile bound, not bandwidth
bound). The fused tensors own the storage and the HF `nn.Linear` weights are re-pointed to views of them,
so `update_weights` (copying an HF-named tensor into its parameter) writes the fused storage in place.

Both forwards take the layer's weights and `KVContext` as arguments (no `layer_idx` lookup), so one
compiled graph serves every layer. The attention function is `attention.kv_attention` with the
context's decode implementation, and the matmuls are plain `F.linear`: the seams (`LayerOps`) the true on-policy
mode swaps for its batch-invariant ops (with `fused_weights=False` the engine runs the trainer's module code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rlbench.engine.attention import KVContext, kv_attention

FUSABLE = ("Qwen3DecoderLayer", "Qwen2DecoderLayer", "LlamaDecoderLayer")
"""HF decoder layers whose forward `fused_layer_forward` reproduces: pre-norm RMSNorm, (q/k-norm), RoPE,
attention, o_proj, residual, RMSNorm, SiLU-gated MLP, residual."""


@dataclass
class FusedLayer:
    """One decoder layer's tensors as `fused_layer_forward` reads them (all `nn.Parameter`s, so a compile
    treats their shapes as static; the HF parameters are these tensors or views of them)."""

    input_norm: torch.Tensor
    """`[D]` RMSNorm weight before attention."""
    qkv: torch.Tensor
    """`[(H + 2 n_kv) hd, D]`: q_proj, k_proj, v_proj weights stacked."""
    qkv_bias: torch.Tensor | None
    """`[(H + 2 n_kv) hd]` or None."""
    q_norm: torch.Tensor | None
    """`[hd]` per-head RMSNorm of q (Qwen3) or None."""
    k_norm: torch.Tensor | None
    """`[hd]` per-head RMSNorm of k (Qwen3) or None."""
    o: torch.Tensor
    """`[D, H hd]` o_proj weight."""
    o_bias: torch.Tensor | None
    """`[D]` or None."""
    post_norm: torch.Tensor
    """`[D]` RMSNorm weight before the MLP."""
    gate_up: torch.Tensor
    """`[2 I, D]`: gate_proj, up_proj weights stacked."""
    gate_up_bias: torch.Tensor | None
    """`[2 I]` or None."""
    down: torch.Tensor
    """`[D, I]` down_proj weight."""
    down_bias: torch.Tensor | None
    """`[D]` or None."""
    eps: float
    """RMSNorm epsilon (all norms of the layer)."""
    scale: float
    """Attention score scale (the HF module's `scaling`)."""


def _fuse(linears: list[torch.nn.Linear], attr: str) -> torch.Tensor | None:
    """Stack `linear.<attr>` of `linears` into one new tensor and re-point each to its view (None if absent)."""
    parts = [getattr(lin, attr) for lin in linears]
    if parts[0] is None:
        return None
    fused = torch.nn.Parameter(torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                                           dtype=parts[0].dtype, device=parts[0].device), requires_grad=False)
    start = 0
    for p in parts:
        view = fused.data[start : start + p.shape[0]]
        view.copy_(p.data)
        p.data = view  # the old storage is freed here: one layer's weights extra at most
        start += p.shape[0]
    return fused


def _fusable(model: torch.nn.Module) -> bool:
    layers = getattr(model.model, "layers", None)
    if layers is None:  # a VLM: its decoder is `model.model.language_model` (HF-layer path)
        return False
    return (getattr(model.config, "hidden_act", None) == "silu"
            and all(type(layer).__name__ in FUSABLE for layer in layers)
            and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers))


def fuse_layers(model: torch.nn.Module) -> list[FusedLayer] | None:
    """Fuse QKV and gate/up of every decoder layer (re-pointing the HF weights); None if not `FUSABLE`.

    Call again after the parameters were re-allocated (`wake_up`): it re-fuses whatever they hold.
    """
    if not _fusable(model):
        return None
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_lin, gu_lin = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        out.append(FusedLayer(
            input_norm=layer.input_layernorm.weight, qkv=_fuse(qkv_lin, "weight"), qkv_bias=_fuse(qkv_lin, "bias"),
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
            o=attn.o_proj.weight, o_bias=attn.o_proj.bias, post_norm=layer.post_attention_layernorm.weight,
            gate_up=_fuse(gu_lin, "weight"), gate_up_bias=_fuse(gu_lin, "bias"),
            down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
            eps=layer.input_layernorm.variance_epsilon, scale=attn.scaling,
        ))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@dataclass(frozen=True)
class LayerOps:
    """The ops `fused_layer_forward` calls: torch's, or the batch-invariant ones (`ModelRunner.bind_weights` builds
    them from `rlbench.numerics`)."""

    linear: Callable = F.linear
    """`(x, weight, bias) -> y`."""
    rms_norm: Callable = rms_norm
    """`(x, weight, eps) -> y`, HF's cast order."""
    silu: Callable = F.silu
    attention: Callable = kv_attention
    """`(q [B, H, T, hd], k, v [B, n_kv, T, hd], ctx, scale) -> [B, H, T, hd]`, writing k/v into `ctx`'s cache."""


TORCH_OPS = LayerOps()


def fused_layer_forward(w: FusedLayer, hidden: torch.Tensor, pos_emb, ctx: KVContext,
                        ops: LayerOps = TORCH_OPS) -> torch.Tensor:
    """One decoder layer: hidden `[B, T, D]` -> `[B, T, D]`, writing this layer's K/V into `ctx`'s cache. Every
    elementwise step is the HF layer's, in its order (so with `ops` the trainer's, the bits are the HF layer's
    wherever a fused GEMM's columns equal the separate GEMMs')."""
    b, t, _ = hidden.shape
    hd = ctx.k_cache.shape[-1]  # sizes from static shapes, not Python ints (which a compile makes symbolic)
    q_size = w.o.shape[1]
    x = ops.rms_norm(hidden, w.input_norm, w.eps)
    qkv = ops.linear(x, w.qkv, w.qkv_bias)  # [B, T, (H + 2 n_kv) hd]
    q, k, v = qkv.split([q_size, (w.qkv.shape[0] - q_size) // 2, (w.qkv.shape[0] - q_size) // 2], dim=-1)
    q, k, v = q.view(b, t, -1, hd), k.view(b, t, -1, hd), v.view(b, t, -1, hd)
    if w.q_norm is not None:
        q, k = ops.rms_norm(q, w.q_norm, w.eps), ops.rms_norm(k, w.k_norm, w.eps)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *pos_emb)  # HF's own RoPE (all three families)
    attn = ops.attention(q, k, v.transpose(1, 2), ctx, w.scale)  # [B, H, T, hd]
    hidden = hidden + ops.linear(attn.transpose(1, 2).reshape(b, t, -1), w.o, w.o_bias)
    x = ops.rms_norm(hidden, w.post_norm, w.eps)
    gate, up = ops.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [B, T, I] each
    return hidden + ops.linear(ops.silu(gate) * up, w.down, w.down_bias)


def hf_layer_forward(layer: torch.nn.Module, hidden: torch.Tensor, pos_emb, ctx: KVContext) -> torch.Tensor:
    """The HF layer's own forward; its attention reaches `kv_attention` through "rlbench_kv" (`rl_kv=ctx`)."""
    return layer(hidden, attention_mask=None, position_embeddings=pos_emb, rl_kv=ctx)
