"""The engine's attention function, registered with transformers' `AttentionInterface` as "rlbench_kv".

The HF decoder layers stay untouched: they compute q/k/v (with q/k-norm and RoPE) and call the registered
attention function, which receives our `KVContext` through the forward kwargs (`rl_kv=`). It writes the
new keys/values into the slot cache and attends:

- prefill: a right-padded batch `[B, T]` of fresh prompts; causal attention over the batch's own keys
  (padding sits after every real token, so it never reaches a real query).
- decode: one token per slot for slots `[0, B)`; the query attends to cache positions `<= position`,
  reading only the first `kv_len` positions (a bucket >= the longest running sequence).

Without `rl_kv` (e.g. the trainer calling the same model) it is plain SDPA, so the model stays usable.
Swapping this function (or the matmuls around it) is how the true on-policy mode plugs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "rlbench_kv"


@dataclass
class KVContext:
    """Per-forward state the attention function needs (all tensors preallocated by the engine)."""

    k_cache: list[torch.Tensor]
    """Per layer `[S, n_kv, L_max + KV_PAD, hd]`."""
    v_cache: list[torch.Tensor]
    """Per layer `[S, n_kv, L_max + KV_PAD, hd]`."""
    slots: torch.Tensor
    """`[B]` long: the cache slot of each batch row (decode: `arange(B)`)."""
    decode: bool
    """True: one new token per row at `positions`; False: prefill of a right-padded batch from position 0."""
    positions: torch.Tensor | None = None
    """Decode: `[B]` long position of the new token."""
    kv_len: int = 0
    """Decode: cache positions read, `[0, kv_len)`."""
    mask: torch.Tensor | None = None
    """Decode: `[B, 1, 1, kv_len]` bool, True where the key is visible."""


def decode_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """`[B]` positions -> `[B, 1, 1, kv_len]` bool mask of visible keys (key index <= position)."""
    keys = torch.arange(kv_len, device=positions.device)
    return (keys[None, :] <= positions[:, None])[:, None, None, :]


def _prefill(module, q, k, v, ctx: KVContext, scaling: float) -> torch.Tensor:
    """q `[B, H, T, hd]`, k/v `[B, n_kv, T, hd]` -> `[B, H, T, hd]`; stores k/v in the slots."""
    layer, t = module.layer_idx, k.shape[2]
    ctx.k_cache[layer][ctx.slots, :, :t] = k.to(ctx.k_cache[layer].dtype)
    ctx.v_cache[layer][ctx.slots, :, :t] = v.to(ctx.v_cache[layer].dtype)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)


def _decode(module, q, k, v, ctx: KVContext, scaling: float) -> torch.Tensor:
    """q `[B, H, 1, hd]`, k/v `[B, n_kv, 1, hd]` -> `[B, H, 1, hd]` against the cached prefix."""
    layer = module.layer_idx
    kc, vc = ctx.k_cache[layer], ctx.v_cache[layer]
    kc[ctx.slots, :, ctx.positions] = k[:, :, 0].to(kc.dtype)
    vc[ctx.slots, :, ctx.positions] = v[:, :, 0].to(vc.dtype)
    b, h, _, hd = q.shape
    n_kv = k.shape[1]
    # GQA without copying K/V: the G query heads of one KV head become G "query positions"
    # (they all sit at the same position, so one mask row serves them all).
    qg = q.reshape(b, n_kv, h // n_kv, hd)
    keys, values = kc[:b, :, : ctx.kv_len], vc[:b, :, : ctx.kv_len]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=ctx.mask, scale=scaling)
    return out.reshape(b, h, 1, hd)


def rlbench_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`AttentionInterface` entry point. Returns `([B, T, H, hd], None)` like every HF attention function."""
    ctx: KVContext | None = kwargs.get("rl_kv")
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("the torch engine does not support sliding-window layers; use the sglang engine")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    fn = _decode if ctx.decode else _prefill
    out = fn(module, query, key, value, ctx, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, rlbench_kv_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
