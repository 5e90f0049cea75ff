"""The engine's attention for layers that are more than `softmax(q k^T s) v` over the causal prefix: sliding windows
(Mistral, Gemma2/3, gpt-oss), score soft-capping (Gemma2) and attention sinks (gpt-oss). Written as HF's eager
attention of those models computes them, against the engine's KV cache in every layout (prefill, extend, slot
decode, grouped decode).

A window W lets the query at position p see keys at positions `(p - W, p]` (transformers' `sliding_window_overlay`);
a window >= the cache length cuts nothing and is dropped (`Extras.of`). Sinks add one logit per query head to the
softmax's denominator: `softmax([s, sink])[:-1]`, as `eager_attention_forward` of gpt-oss does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Extras:
    """What one layer's attention adds (from the kwargs HF's attention module passes)."""

    window: int | None
    """Keys visible to position p: `(p - window, p]`; None: all earlier keys."""
    softcap: float | None
    """Scores become `softcap * tanh(s / softcap)` before the mask."""
    sinks: torch.Tensor | None
    """`[H]` per-query-head sink logits."""

    @staticmethod
    def of(kwargs: dict, cache_len: int) -> Extras | None:
        """The extras of an attention call's kwargs, or None when it is plain causal attention (a window that
        reaches past `cache_len` positions cuts nothing)."""
        window = kwargs.get("sliding_window")
        window = window if window is not None and window < cache_len else None
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        if window is None and softcap is None and sinks is None:
            return None
        return Extras(window, softcap, sinks)


def attend(q, k, v, visible, scale: float, ex: Extras, sinks_rows=None) -> torch.Tensor:
    """q `[B, N, M, hd]`, k/v `[B, N, L, hd]`, visible bool broadcastable to `[B, N, M, L]` -> `[B, N, M, hd]`.

    N heads of M query rows each; `sinks_rows` (with `ex.sinks`) broadcasts to `[B, N, M, 1]`: the sink logit of
    each row's query head. Every row must see at least one key.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, N, M, L]
    if ex.softcap is not None:
        scores = torch.tanh(scores / ex.softcap) * ex.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if ex.sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        logits = torch.cat([scores, sinks_rows.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        logits = logits - logits.amax(-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs, v)


def window_visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """`[..., M, 1]` query positions, `[..., 1, L]` key positions -> bool `[..., M, L]`: causal, within the window."""
    visible = key_pos <= query_pos
    return visible if window is None else visible & (key_pos > query_pos - window)


def prefill(q, k, v, ex: Extras, scale: float) -> torch.Tensor:
    """Fresh right-padded prompts from position 0: q `[B, H, T, hd]`, k/v `[B, n_kv, T, hd]` -> `[B, H, T, hd]`."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    pos = torch.arange(q.shape[2], device=q.device)
    sinks = None if ex.sinks is None else ex.sinks.view(1, -1, 1, 1)
    return attend(q, k, v, window_visible(pos[:, None], pos[None, :], ex.window), scale, ex, sinks)


def extend_row(q, keys, values, start: int, ex: Extras, scale: float) -> torch.Tensor:
    """One extend row: q `[1, H, n, hd]` at positions `start...`, its slot's keys/values `[1, H, start + n, hd]`."""
    n = q.shape[2]
    qpos = start + torch.arange(n, device=q.device)
    kpos = torch.arange(start + n, device=q.device)
    sinks = None if ex.sinks is None else ex.sinks.view(1, -1, 1, 1)
    return attend(q, keys, values, window_visible(qpos[:, None], kpos[None, :], ex.window), scale, ex, sinks)


def decode(q, keys, values, mask, ctx, ex: Extras, scale: float) -> torch.Tensor:
    """A decode step in the `DecodeAttention` layout: q `[B', n_kv, M, hd]` (M = k G rows: k samples of a group
    row, G query heads per KV head; k = `ctx.group`), keys/values `[B', n_kv, L, hd]`, the engine's bool mask
    `[B', 1, M, L]` -> `[B', n_kv, M, hd]`. The window is cut on positions: in the grouped layout index
    `P + t k + j` holds position `P + t` (P the row's prompt length)."""
    k_grp, n_kv, m, length = ctx.group, q.shape[1], q.shape[2], keys.shape[2]
    g = m // k_grp  # query heads per KV head
    if ex.window is not None:
        idx = torch.arange(length, device=q.device)[None, :]  # [1, L]
        pos = ctx.positions[:, None]  # [B, 1]
        if k_grp == 1:
            key_pos = idx
        else:
            p = ctx.prefix_len[:, None]
            key_pos = torch.where(idx < p, idx, p + torch.div(idx - p, k_grp, rounding_mode="floor"))
        inside = (key_pos > pos - ex.window).view(-1, k_grp, 1, length).expand(-1, -1, g, -1)  # [B', k, G, L]
        mask = mask & inside.reshape(-1, 1, m, length)
    sinks = None
    if ex.sinks is not None:  # row r = (sample r // G, head r % G) of KV head j is query head j G + r % G
        sinks = ex.sinks.view(1, n_kv, 1, g).expand(1, n_kv, k_grp, g).reshape(1, n_kv, m, 1)
    return attend(q, keys, values, mask, scale, ex, sinks)
