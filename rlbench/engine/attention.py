"""The engine's attention: KV-cache writes plus prefill/decode attention, for one decoder layer at a time.

Two callers share it. The engine's own (fused-weight) layer forward calls `kv_attention` directly; the HF
decoder layers (fallback path, `fused_weights=False`) reach it through transformers' `AttentionInterface`
as "rlbench_kv", getting the engine's `KVContext` through the forward kwargs (`rl_kv=`). Either way it
writes the new keys/values into the slot cache and attends:

- prefill: a right-padded batch `[B, T]` of fresh prompts; causal attention over the batch's own keys
  (padding sits after every real token, so it never reaches a real query).
- extend (`KVContext.extend`, sessions): a right-padded batch of suffixes appended to sequences the cache
  already holds; each row's real tokens are written at their positions, then attend to their slot's keys up to
  their own position (one SDPA call per row over a view of its slot: no gathered copy of the cached keys).
- decode: one token per slot for slots `[0, B)`; the query attends to cache positions `<= position`,
  reading only the first `kv_len` positions (a bucket >= the longest running sequence). Two decode
  implementations (`decode_attention`), chosen once per engine: "sdpa" (one fused SDPA call; its kernels
  parallelise over batch x KV heads only, ~16 blocks at batch 1), "split" (fp32 reductions that inductor
  spreads over kv_len as well) and "split_kv" (a Triton kernel over chunks of kv_len, `engine.split_kv`).
- grouped decode (`KVContext.group` k > 1, the cache's `group_view(k)`): the k samples of one prompt decode
  together, so their g query heads per KV head become one `[k g]`-row query against the group row (the prompt
  once, then the k samples' interleaved tokens), each row masked to the prompt plus its own tokens. Per step the
  prompt's K/V are read once per group, not once per sample.

A `KVContext` holds ONE layer's cache tensors (not a list indexed by `layer_idx`), so every layer makes
the same calls with different tensors and one compiled layer graph serves them all.
Without `rl_kv` (e.g. the trainer calling the same model) it is plain SDPA, so the model stays usable (HF's mask
functions cut sliding windows; a layer with soft-capping or sinks refuses: SDPA has neither).
Swapping this function (or the matmuls around it) is how the true on-policy mode plugs in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlbench.engine import attention_extras as extras
from rlbench.engine.attention_extras import Extras

ATTN_NAME = "rlbench_kv"

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""`(q [B, n_kv, G, hd], keys [B, n_kv, L, hd], values [B, n_kv, L, hd], mask [B, 1, 1 or G, L], scale)`
-> `[B, n_kv, G, hd]` in q's dtype: the G query rows of KV head j attend to its L cached keys (the grouped
layout passes group rows as B and its k samples' query heads as G rows, each with its own mask row)."""


def sdpa_decode(q, keys, values, mask, scale: float) -> torch.Tensor:
    """One SDPA call; GQA without copying K/V: the G query heads of a KV head act as G "query positions"
    (they all sit at the same position, so one mask row serves them all)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


SPLIT_CHUNKS = 16
"""`split_decode` sums the values in 16 chunks of kv_len / 16 (kv_len is always a multiple of 16)."""


def split_decode(q, keys, values, mask, scale: float) -> torch.Tensor:
    """Masked attention written as fp32 reductions, for the compiled step.

    Inductor fuses each line into one kernel without materialising the broadcast products: scores reduce
    over head_dim (`B*n_kv*G*L` outputs: parallel over kv_len), and the value sum reduces per chunk of
    kv_len (`B*n_kv*G*16*hd` outputs) before a 16-way sum: split-KV ("flash-decoding") in plain torch.
    Eager it DOES materialise `[B, n_kv, G, L, hd]` float32 products; the runner uses it only compiled.
    """
    length = keys.shape[2]
    scores = (q.float()[:, :, :, None, :] * keys.float()[:, :, None, :, :]).sum(-1) * scale  # [B, n_kv, G, L]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # [B, n_kv, G, L]
    chunks = (SPLIT_CHUNKS, length // SPLIT_CHUNKS)
    probs = probs.unflatten(-1, chunks)[..., None]  # [B, n_kv, G, C, L/C, 1]
    vals = values.unflatten(2, chunks)[:, :, None].float()  # [B, n_kv, 1, C, L/C, hd] (a view of the cache)
    partial = (probs * vals).sum(-2)  # [B, n_kv, G, C, hd]
    return partial.sum(-2).to(q.dtype)  # [B, n_kv, G, hd]


SPLIT_MAX_BLOCKS = 64
"""`auto_decode` uses `split_decode` while batch x KV heads < 64, i.e. while SDPA's grid would leave most of an
H200's 132 SMs idle. Above it SDPA wins: `split_decode` re-reads K and V once per query head of a group and
runs without tensor cores, which at batch 64-256 (where the KV reads dominate the step) cost 2.7-3.4x in
engine throughput (2026-11-30, docs/LOG.md)."""


def auto_decode(q, keys, values, mask, scale: float) -> torch.Tensor:
    """`split_decode` for small batches, `sdpa_decode` otherwise (see `SPLIT_MAX_BLOCKS`). Compiled with a
    dynamic batch, the test on `B` becomes a guard: one layer graph per side, not per batch."""
    fn = split_decode if q.shape[0] * q.shape[1] < SPLIT_MAX_BLOCKS else sdpa_decode
    return fn(q, keys, values, mask, scale)


DECODE_ATTENTION_FNS: dict[str, DecodeAttention] = {"sdpa": sdpa_decode, "split": split_decode, "auto": auto_decode}
"""The decode attentions written in torch (`decode_attention` adds `TRITON_DECODE_ATTENTION`)."""
TRITON_DECODE_ATTENTION = ("split_kv",)
"""The Triton decode attentions, imported on first use (`rlbench.engine.split_kv`)."""


def decode_attention(name: str, *, compiled: bool, grouped: bool, cuda: bool) -> DecodeAttention:
    """The decode attention `name` for one layout of one engine.

    "auto": on CUDA the grouped layout takes "split_kv" (its few group rows x KV heads each hold k G query
    rows over the prompt plus k interleaved samples: SDPA would walk those keys on few SMs); otherwise the
    compiled step takes `auto_decode`. Eager, "auto" and "split" run SDPA (`split_decode` would materialise its
    `[B, n_kv, G, L, hd]` products).
    """
    if name == "auto" and cuda and grouped:
        name = "split_kv"
    elif name in ("auto", "split") and not compiled:
        name = "sdpa"
    if name == "split_kv":
        from rlbench.engine.split_kv import split_kv_decode

        return split_kv_decode
    return DECODE_ATTENTION_FNS[name]


@dataclass
class Extend:
    """A prefill of suffixes into slots that already hold their sequences' earlier positions (sessions).

    Row b of the right-padded `[B, T]` batch holds `lengths[b]` new tokens at positions `starts[b]`,
    `starts[b] + 1`, ... of the sequence in cache slot `slots[b]`. The flat tensors list the real tokens."""

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    rows: torch.Tensor
    """`[N]` long: the cache slot of each real token."""
    index: torch.Tensor
    """`[N]` long: its position (cache index)."""
    tokens: torch.Tensor
    """`[N]` long: its flat index `b T + t` in the batch."""
    masks: list[torch.Tensor]
    """Per row `[lengths[b], starts[b] + lengths[b]]` bool: key visible to the query (key <= query position)."""
    tiles: object = None
    """The batch-invariant attention's tiles (`rlbench.numerics.extend_tiles`), when the engine runs it."""


@dataclass
class KVContext:
    """Per-layer state the attention needs (all tensors preallocated by the engine)."""

    k_cache: torch.Tensor
    """This layer's keys `[S, n_kv, L_max + KV_PAD, hd]`."""
    v_cache: torch.Tensor
    """This layer's values `[S, n_kv, L_max + KV_PAD, hd]`."""
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
    decode_attention: DecodeAttention = sdpa_decode
    """Decode: the implementation (`decode_attention`)."""
    group: int = 1
    """Decode: rows per group row of the cache (1: a slot per row; k: `KVCache.group_view(k)`, rows
    `[g k, (g + 1) k)` are group row g's samples and `mask` is `[B / k, 1, k G, kv_len]`)."""
    write_index: torch.Tensor | None = None
    """Decode: `[B]` long cache index of the new token (None: `positions`, the slot layout)."""
    prefix_len: torch.Tensor | None = None
    """Decode in the grouped layout: `[B]` long prompt length of each row (the batch-invariant attention maps
    positions to cache indices itself; the default one reads `mask`)."""
    extend: Extend | None = None
    """Not decode: the batch appends suffixes to cached sequences (None: fresh prompts from position 0)."""
    max_len: int = 0
    """Longest sequence a slot holds (the engine's `max_seq_len`; 0: the cache's length): a sliding window at least
    this long cuts nothing."""

    @property
    def longest(self) -> int:
        """`max_len`, or the positions of one cache row."""
        return self.max_len or self.k_cache.shape[2]


def decode_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """`[B]` positions -> `[B, 1, 1, kv_len]` bool mask of visible keys (key index <= position)."""
    keys = torch.arange(kv_len, device=positions.device)
    return (keys[None, :] <= positions[:, None])[:, None, None, :]


def group_decode_mask(positions: torch.Tensor, prefix_len: torch.Tensor, group: int, heads_per_kv: int,
                      kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped layout's write index `[B]` and mask `[B / k, 1, k G, kv_len]` (k = `group`, G = `heads_per_kv`).

    Row r = (group row r // k, sample j = r % k) at `positions[r]` = P + t writes at index P + t k + j and sees
    the prompt `[0, P)` plus its own earlier tokens (indices >= P congruent to j mod k, up to its write index).
    """
    b = positions.shape[0]
    lane = torch.arange(b, device=positions.device) % group
    index = (prefix_len + (positions - prefix_len) * group + lane).clamp(0, kv_len - 1)  # idle rows stay in bounds
    keys = torch.arange(kv_len, device=positions.device)[None, :]
    p = prefix_len[:, None]
    visible = (keys < p) | (((keys - p) % group == lane[:, None]) & (keys <= index[:, None]))  # [B, kv_len]
    mask = visible.view(b // group, group, 1, kv_len).expand(-1, -1, heads_per_kv, -1)
    return index, mask.reshape(b // group, 1, group * heads_per_kv, kv_len)


def _prefill(q, k, v, ctx: KVContext, scale: float, ex: Extras | None = None) -> torch.Tensor:
    """q `[B, H, T, hd]`, k/v `[B, n_kv, T, hd]` -> `[B, H, T, hd]`; stores k/v in the slots."""
    t = k.shape[2]
    ctx.k_cache[ctx.slots, :, :t] = k.to(ctx.k_cache.dtype)
    ctx.v_cache[ctx.slots, :, :t] = v.to(ctx.v_cache.dtype)
    if ex is not None:
        return extras.prefill(q, k, v, ex, scale)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def write_extend(ctx: KVContext, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the real tokens' k/v `[B, n_kv, T, hd]` of an extend batch at their slots and positions."""
    e, (b, n_kv, t, hd) = ctx.extend, k.shape
    ctx.k_cache[e.rows, :, e.index] = k.transpose(1, 2).reshape(b * t, n_kv, hd)[e.tokens].to(ctx.k_cache.dtype)
    ctx.v_cache[e.rows, :, e.index] = v.transpose(1, 2).reshape(b * t, n_kv, hd)[e.tokens].to(ctx.v_cache.dtype)


def _extend(q, k, v, ctx: KVContext, scale: float, ex: Extras | None = None) -> torch.Tensor:
    """q `[B, H, T, hd]`, k/v `[B, n_kv, T, hd]` -> `[B, H, T, hd]` (zeros on padding) against each row's slot."""
    write_extend(ctx, k, v)
    e, out = ctx.extend, torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for row, (slot, start, n, mask) in enumerate(zip(e.slots, e.starts, e.lengths, e.masks)):
        keys = ctx.k_cache[slot : slot + 1, :, : start + n].repeat_interleave(groups, dim=1)
        values = ctx.v_cache[slot : slot + 1, :, : start + n].repeat_interleave(groups, dim=1)
        if ex is not None:
            out[row : row + 1, :, :n] = extras.extend_row(q[row : row + 1, :, :n], keys, values, start, ex, scale)
            continue
        out[row : row + 1, :, :n] = F.scaled_dot_product_attention(q[row : row + 1, :, :n], keys, values,
                                                                    attn_mask=mask, scale=scale)
    return out


def _decode(q, k, v, ctx: KVContext, scale: float, ex: Extras | None = None) -> torch.Tensor:
    """q `[B, H, 1, hd]`, k/v `[B, n_kv, 1, hd]` -> `[B, H, 1, hd]` against the cached prefix."""
    kc, vc, k_grp = ctx.k_cache, ctx.v_cache, ctx.group
    rows = ctx.slots if k_grp == 1 else ctx.slots // k_grp
    index = ctx.positions if ctx.write_index is None else ctx.write_index
    kc[rows, :, index] = k[:, :, 0].to(kc.dtype)
    vc[rows, :, index] = v[:, :, 0].to(vc.dtype)
    b, h, _, hd = q.shape
    n_kv = k.shape[1]
    g = b // k_grp
    keys, values = kc[:g, :, : ctx.kv_len], vc[:g, :, : ctx.kv_len]
    attend = ctx.decode_attention
    if ex is not None:
        def attend(qq, kk, vv, mask, s):
            return extras.decode(qq, kk, vv, mask, ctx, ex, s)
    if k_grp == 1:
        out = attend(q.reshape(b, n_kv, h // n_kv, hd), keys, values, ctx.mask, scale)
        return out.reshape(b, h, 1, hd)
    qg = q.reshape(g, k_grp, n_kv, h // n_kv, hd).transpose(1, 2).reshape(g, n_kv, k_grp * (h // n_kv), hd)
    out = attend(qg, keys, values, ctx.mask, scale)  # [B / k, n_kv, k G, hd]
    return out.reshape(g, n_kv, k_grp, h // n_kv, hd).transpose(1, 2).reshape(b, h, 1, hd)


def kv_attention(q, k, v, ctx: KVContext, scale: float, ex: Extras | None = None) -> torch.Tensor:
    """Write k/v into the cache and attend. q `[B, H, T, hd]`, k/v `[B, n_kv, T, hd]` -> `[B, H, T, hd]`.
    `ex`: the layer's sliding window, soft-capping and sinks (`attention_extras`; None: plain causal)."""
    return (_decode if ctx.decode else _prefill if ctx.extend is None else _extend)(q, k, v, ctx, scale, ex)


def rlbench_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`AttentionInterface` entry point. Returns `([B, T, H, hd], None)` like every HF attention function."""
    ctx: KVContext | None = kwargs.get("rl_kv")
    if ctx is None:
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:  # SDPA would drop them
            raise ValueError("the engine's model runs soft-capping and attention sinks only inside the engine (rl_kv); "
                             "run a plain forward on a model built with attn_implementation='eager'")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    ex = Extras.of(kwargs, ctx.longest)
    return kv_attention(query, key, value, ctx, scaling, ex).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, rlbench_kv_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
