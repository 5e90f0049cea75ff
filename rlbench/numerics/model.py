"""Switch a HF causal LM to the batch-invariant ops, in place: the engine's copy and the trainer's FSDP model run
the same module code with the same ops, so a token's forward values are the same bits on both sides.

`make_batch_invariant(model)` re-points, per module instance:
- every `nn.Linear` (all projections and `lm_head`) to `ops.linear`;
- every RMSNorm (a module with `weight` and `variance_epsilon`, HF's Qwen/Llama norms) to `ops.rms_norm`;
- every SiLU activation (`act_fn`) to `ops.silu`;
- every MoE router and experts module (Qwen3-MoE, Mixtral) to `rlbench.models.moe`'s forwards over `ops.linear`
  and `ops.silu` (expert GEMMs, routing GEMM; softmax / top-k / the weighted sum are row-local);
- the attention to "rlbench_bi" (`batch_invariant_attention`): the engine's calls carry its `KVContext`
  (`rl_kv=`: prefill, or decode against the slot cache or its grouped layout), all others (training, a plain forward) are
  described by their `position_ids`.
Embeddings, RoPE and residual adds are elementwise or gathers: row-local as they are.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rlbench.models.moe import patch_moe
from rlbench.numerics import ops
from rlbench.numerics.layout import Tiles, decode_tiles, document_tiles
from rlbench.numerics.layout import extend_tiles as layout_extend_tiles

ATTN_NAME = "rlbench_bi"

_tile_cache: list = [None, None, None, None]  # [position_ids, its _version, tokens per tile, Tiles]: one forward


def _tiles_for(position_ids: torch.Tensor, group: int) -> Tiles:
    """`document_tiles` of a forward's position ids, computed once per forward (the tensor is shared by every
    layer; holding it keeps its identity from being reused by another tensor)."""
    per = ops.tokens_per_tile(position_ids.device, group)
    if position_ids.is_inference():  # no version counter: not cached
        return document_tiles(position_ids, per)
    held, version, held_per, tiles = _tile_cache
    if held is not position_ids or version != position_ids._version or held_per != per:
        tiles = document_tiles(position_ids, per)
        _tile_cache[:] = [position_ids, position_ids._version, per, tiles]
    return tiles


@functools.lru_cache(maxsize=64)
def _prefill_tiles(b: int, t: int, device: torch.device, group: int) -> Tiles:
    """Tiles of the engine's right-padded prefill `[B, T]`: each row one sequence from position 0."""
    with torch.inference_mode(False):
        positions = torch.arange(t, device=device).expand(b, t)
        return document_tiles(positions, ops.tokens_per_tile(device, group))


def forward_tiles(position_ids: torch.Tensor, config, device: torch.device | str | None = None) -> Tiles:
    """The attention tiles of a forward without a KV cache (training, log-probs) from its `[B, T]` position ids,
    built before the layers run: pass them as `model(..., rl_tiles=tiles)`, so that a compiled layer needs no
    host sync. Tile and sequence counts are padded to powers of two with empty entries (a compiled layer
    specialises on their sizes: a few graphs per pack length, not one per pack). The tiles are built on the host
    (a pack's position ids are there already: no device sync) and copied to `device` (default: the ids')."""
    device = position_ids.device if device is None else torch.device(device)
    group = config.num_attention_heads // config.num_key_value_heads
    tiles = document_tiles(position_ids.cpu(), ops.tokens_per_tile(device, group))
    pad = _to_power_of_two(tiles.tok0.numel())
    if pad:  # empty tiles (no tokens)
        zeros = tiles.tok0.new_zeros(pad)
        tiles.tok0, tiles.ntok, tiles.kb, tiles.kstart = (torch.cat([t, zeros]) for t in
                                                          (tiles.tok0, tiles.ntok, tiles.kb, tiles.kstart))
    cu = tiles.cu_seqlens
    extra = _to_power_of_two(cu.numel())
    if extra:  # empty sequences at the end
        tiles.cu_seqlens = torch.cat([cu, cu[-1:].expand(extra)])
    if device.type != "cpu":  # the kernels' per-token and per-tile fields; documents and cu_seqlens stay on the host
        pin = device.type == "cuda"  # an asynchronous copy from pageable memory may wait for the stream
        tiles.positions, tiles.tok0, tiles.ntok, tiles.kb, tiles.kstart = (
            (t.pin_memory() if pin else t).to(device, non_blocking=True)
            for t in (tiles.positions, tiles.tok0, tiles.ntok, tiles.kb, tiles.kstart))
    return tiles


def _to_power_of_two(n: int) -> int:
    """How many entries take `n` up to the next power of two."""
    return (1 << max(0, n - 1).bit_length()) - n


def extend_tiles(starts: list[int], lengths: list[int], slots: list[int], t: int, config,
                 device: torch.device | str) -> Tiles:
    """The attention tiles of an engine extend batch (`rlbench.engine.attention.Extend`: suffixes appended to
    cached sequences), for this device's tile size; built once per batch, before the layers run."""
    group = config.num_attention_heads // config.num_key_value_heads
    return layout_extend_tiles(starts, lengths, slots, t, ops.tokens_per_tile(torch.device(device), group), device)


def _write_cache(ctx, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store this call's keys/values (`[B, n_kv, T, hd]`) in the engine's slots before attending."""
    if ctx.extend is not None:  # real tokens only, at their positions (the engine's write_extend)
        e, (b, n_kv, t, hd) = ctx.extend, key.shape
        ctx.k_cache[e.rows, :, e.index] = key.transpose(1, 2).reshape(b * t, n_kv, hd)[e.tokens].to(ctx.k_cache.dtype)
        ctx.v_cache[e.rows, :, e.index] = value.transpose(1, 2).reshape(b * t, n_kv, hd)[e.tokens].to(ctx.v_cache.dtype)
    elif ctx.decode:  # the slot layout, or the grouped layout's group rows at the engine's write index
        rows = ctx.slots if ctx.group == 1 else ctx.slots // ctx.group
        index = ctx.positions if ctx.write_index is None else ctx.write_index
        ctx.k_cache[rows, :, index] = key[:, :, 0].to(ctx.k_cache.dtype)
        ctx.v_cache[rows, :, index] = value[:, :, 0].to(ctx.v_cache.dtype)
    else:
        t = key.shape[2]
        ctx.k_cache[ctx.slots, :, :t] = key.to(ctx.k_cache.dtype)
        ctx.v_cache[ctx.slots, :, :t] = value.to(ctx.v_cache.dtype)


def batch_invariant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`AttentionInterface` entry: query `[B, H, T, hd]`, key/value `[B, n_kv, T, hd]` -> (`[B, T, H, hd]`, None)."""
    if dropout:
        raise ValueError(f"attention dropout={dropout}: batch-invariant attention has none; set attention_dropout=0")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"batch-invariant attention has no {name} (attention soft-capping / sinks); run without "
                             "--true-on-policy-mode")
    b, h, t, hd = query.shape
    group = h // key.shape[1]
    scale = scaling if scaling is not None else hd**-0.5
    q = query.transpose(1, 2)  # [B, T, H, hd]
    ctx = kwargs.get("rl_kv")
    _check_window(kwargs.get("sliding_window"), ctx, kwargs.get("rl_tiles"), kwargs.get("position_ids"))
    if ctx is not None:
        _write_cache(ctx, key, value)
    extend = None if ctx is None else ctx.extend
    if ctx is not None and (ctx.decode or extend is not None):
        tiles = extend.tiles if extend is not None else decode_tiles(ctx.positions, ctx.slots, ctx.group,
                                                                     ctx.prefix_len)
        keys, values = ctx.k_cache.transpose(1, 2), ctx.v_cache.transpose(1, 2)  # [S, L, n_kv, hd] views
        return ops.attention(q, keys, values, tiles, scale), None
    positions = kwargs.get("position_ids") if ctx is None else None
    if ctx is None and kwargs.get("rl_tiles") is not None:  # built before the layers (`forward_tiles`)
        tiles = kwargs["rl_tiles"]
    elif positions is None:  # engine prefill (right-padded rows from position 0) or a forward without positions
        tiles = _prefill_tiles(b, t, q.device, group)
    else:
        tiles = _tiles_for(positions.expand(b, t) if positions.shape[0] == 1 else positions, group)
    return ops.attention(q, key.transpose(1, 2), value.transpose(1, 2), tiles, scale), None


def _check_window(window: int | None, ctx, tiles: Tiles | None, positions: torch.Tensor | None) -> None:
    """Refuse a sliding window that cuts a sequence of this call: the kernels attend to every earlier key. The
    engine's calls are bounded by its cache length; a training forward by its longest sequence (its tiles'
    host `cu_seqlens`, else its position ids)."""
    if window is None:
        return
    if ctx is not None:
        longest = ctx.longest
    elif tiles is not None:
        longest = int(torch.diff(tiles.cu_seqlens).max())
    elif positions is not None:
        longest = int(positions.max()) + 1
    else:
        longest = None
    if longest is None or window < longest:
        raise ValueError(f"sliding window {window} < a sequence of {longest} tokens: batch-invariant attention attends "
                         "to every earlier key; run without --true-on-policy-mode or with shorter sequences")


def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, scale: float) -> torch.Tensor:
    """`batch_invariant_attention` with the engine's `kv_attention` signature (its fused layer forward): q
    `[B, H, T, hd]`, k/v `[B, n_kv, T, hd]`, the engine's `KVContext` -> `[B, H, T, hd]`."""
    out, _ = batch_invariant_attention(None, q, k, v, None, scaling=scale, rl_kv=ctx)
    return out.transpose(1, 2)


def _no_mask(*args, **kwargs):
    return None  # sequences are read off position_ids (or the engine's context), never off a mask


AttentionInterface.register(ATTN_NAME, batch_invariant_attention)
AttentionMaskInterface.register(ATTN_NAME, _no_mask)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, self.weight, self.bias)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm(x, self.weight, self.variance_epsilon)


class SiLU(nn.Module):
    """`ops.silu` as a module (HF's `act_fn`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu(x)


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Switch `model` (a HF Qwen3/Qwen2/Llama-style causal LM or Qwen3-MoE / Mixtral, FSDP-wrapped or not) to the batch-invariant ops in
    place; returns it. Raises for modules it cannot make invariant (another activation, another norm)."""
    config = model.config
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")  # Gemma: the former
    if act != "silu":
        raise ValueError(f"batch-invariant numerics support hidden_act='silu', the model has {act!r}")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = _linear_forward.__get__(module)
        elif _is_rms_norm(module):
            module.forward = _norm_forward.__get__(module)
        elif "Norm" in type(module).__name__:
            raise ValueError(f"batch-invariant numerics do not cover {type(module).__name__}; only RMSNorm")
        for name in ("act_fn", "activation_fn"):  # activation_fn: Phi3's MLP
            if isinstance(getattr(module, name, None), nn.Module):
                setattr(module, name, SiLU())
    if getattr(config, "router_jitter_noise", 0):  # HF's block multiplies training inputs by noise; rollouts have none
        raise ValueError(f"router_jitter_noise={config.router_jitter_noise}: the trainer's MoE routing would differ "
                         "from the engine's; set router_jitter_noise=0 for true on-policy mode")
    patch_moe(model, linear=ops.linear, silu=ops.silu)
    config._attn_implementation = ATTN_NAME
    return model
