"""Which keys each query row reads: the tile layout shared by the CPU and GPU batch-invariant attention.

Every caller (engine prefill, engine decode against the KV cache, packed training, padded training)
describes its queries the same way, so one attention routine serves them all:

- queries `q [B, T, H, hd]`, flat token index n = b*T + t, with `positions[n]` = the token's position in its
  sequence;
- keys/values `[KB, L, n_kv, hd]`: the keys of a query's sequence are `k[kb, kstart + j]` for j = 0..position;
- tiles: runs of consecutive query tokens of ONE sequence (`tok0`, `ntok`, `kb`, `kstart` per tile), each
  attended by one program per KV head whose rows are (token, query head of the group) pairs.

A row's result depends only on its query, its position and its sequence's keys, never on the tile it sits
in: keys are consumed in fixed blocks of absolute positions from 0, and a block past a row's position is
an exact no-op for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Documents:
    """The sequences of a `[B, T]` batch of queries whose keys are the batch's own tokens (prefill, training)."""

    row: torch.Tensor
    """`[D]` long: the batch row of each sequence."""
    start: torch.Tensor
    """`[D]` long: index in the row of the sequence's first token (position 0)."""
    length: torch.Tensor
    """`[D]` long: tokens in the sequence."""


@dataclass
class Tiles:
    """Query tiles and positions for one attention call (see the module docstring)."""

    positions: torch.Tensor
    """`[B*T]` long: each query token's position in its sequence."""
    tok0: torch.Tensor
    """`[NT]` int32: first flat query token of the tile."""
    ntok: torch.Tensor
    """`[NT]` int32: consecutive query tokens in the tile."""
    kb: torch.Tensor
    """`[NT]` int32: key batch index of the tile's sequence."""
    kstart: torch.Tensor
    """`[NT]` int32: index in the key tensor's L dimension of the sequence's position 0."""
    documents: Documents | None = None
    """The sequences (prefill/training calls); None for decode against a cache."""
    cu_seqlens: torch.Tensor | None = None
    """With `documents`: `[D + 1]` long on the CPU, the flat token index where each sequence starts, then B*T (the
    sequences tile the flat tokens in order); what the backward needs."""
    kprefix: torch.Tensor | None = None
    """Decode in the engine's grouped layout (`KVCache.group_view`): `[NT]` int32 prompt length P of the tile's
    sample; the key of position j < P is at `kstart + j`, from P on at `kstart + P + (j - P) kstride + klane`.
    None: the key of position j is at `kstart + j`."""
    klane: torch.Tensor | None = None
    """`[NT]` int32: the sample's lane in its group row (grouped layout)."""
    kstride: int = 1
    """Samples per group row (grouped layout)."""


def documents(position_ids: torch.Tensor) -> Documents:
    """The sequences of `[B, T]` position ids: a new sequence wherever the position does not step by 1.

    Every sequence must start at position 0 (packed streams and right-padded batches do); a row whose first
    token has another position would need keys the batch does not hold.
    """
    pos = position_ids.detach().to("cpu", torch.long)
    b, t = pos.shape
    step = torch.diff(pos, dim=1, prepend=pos[:, :1] - 1)  # [B, T]
    first = step != 1  # [B, T]: a sequence starts here
    first[:, 0] = True
    rows, starts = first.nonzero(as_tuple=True)
    if (pos[rows, starts] != 0).any():
        bad = int((pos[rows, starts] != 0).nonzero()[0, 0])
        raise ValueError(
            f"position_ids row {int(rows[bad])} starts a sequence at index {int(starts[bad])} with position "
            f"{int(pos[rows[bad], starts[bad]])}; batch-invariant attention needs every sequence to start at "
            "position 0 (pack sequences or right-pad them)"
        )
    flat = rows * t + starts  # [D] flat index of each sequence start
    ends = torch.cat([flat[1:], torch.tensor([b * t], device="cpu")])
    ends = torch.minimum(ends, (rows + 1) * t)  # a sequence never crosses its row
    return Documents(rows, starts, ends - flat)


def tiles_for_documents(tok0, lengths, kb, kstart, tokens_per_tile: int, device) -> tuple[torch.Tensor, ...]:
    """Tile metadata for documents given one entry each (1-D, any int dtype): the flat query token of its
    position 0 (`tok0`), its length, and where its keys live (`kb`, `kstart`). A document of length n gets
    ceil(n / tokens_per_tile) tiles. Returns `(tok0, ntok, kb, kstart)` per tile, int32 (host sync: the tile
    count). Packed stream: kb = 0, kstart = tok0; padded batch `[B, T]`: tok0 = b T, kb = b, kstart = 0."""
    per = tokens_per_tile
    tok0, lengths, kb, kstart = (torch.as_tensor(t, device=device).to(torch.int64).reshape(-1)
                                 for t in (tok0, lengths, kb, kstart))
    n_tiles = (lengths + per - 1) // per
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), n_tiles)
    j = torch.arange(doc.numel(), device=device) - (torch.cumsum(n_tiles, 0) - n_tiles)[doc]
    ntok = torch.clamp(lengths[doc] - j * per, max=per)
    return tuple(t.to(torch.int32) for t in (tok0[doc] + j * per, ntok, kb[doc], kstart[doc]))


def tiles_for_decode(slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Decode tiles (no host sync): token b attends to cache slot `slots[b]` from position 0."""
    b = slots.numel()
    tok0 = torch.arange(b, device=slots.device, dtype=torch.int32)
    return tok0, torch.ones_like(tok0), slots.reshape(-1).to(torch.int32), torch.zeros_like(tok0)


def document_tiles(position_ids: torch.Tensor, tokens_per_tile: int) -> Tiles:
    """Tiles for queries whose keys are their own batch's tokens (`k`/`v` shaped `[B, T, n_kv, hd]`)."""
    docs = documents(position_ids)
    t = position_ids.shape[1]
    starts = docs.row * t + docs.start  # [D] flat index of each sequence's first token
    tiles = tiles_for_documents(starts, docs.length, docs.row, docs.start, tokens_per_tile, position_ids.device)
    cu_seqlens = torch.cat([starts, starts.new_tensor([position_ids.numel()])])
    return Tiles(position_ids.reshape(-1).to(torch.long), *tiles, documents=docs, cu_seqlens=cu_seqlens)


def decode_tiles(positions: torch.Tensor, slots: torch.Tensor, group: int = 1,
                 prefix_len: torch.Tensor | None = None) -> Tiles:
    """Tiles for one new token per sequence (`q [B, 1, H, hd]`) against a cache `[S, L, n_kv, hd]`: tile i is
    token i, keys in cache row `slots[i]` from index 0. With `group` k > 1 the cache is the grouped layout's
    `[S / k, k L, n_kv, hd]`: slot s is lane s % k of group row s // k, whose first `prefix_len[i]` keys are
    the shared prompt's. Device ops only (no host sync: CUDA-graph safe)."""
    if group == 1:
        return Tiles(positions.to(torch.long), *tiles_for_decode(slots))
    tok0, ntok, _, kstart = tiles_for_decode(slots)
    slots = slots.reshape(-1)
    return Tiles(positions.to(torch.long), tok0, ntok, (slots // group).to(torch.int32), kstart,
                 kprefix=prefix_len.reshape(-1).to(torch.int32), klane=(slots % group).to(torch.int32), kstride=group)


def extend_tiles(starts: list[int], lengths: list[int], slots: list[int], t: int, tokens_per_tile: int,
                 device: torch.device | str) -> Tiles:
    """Tiles for suffixes appended to cached sequences (`q [B, T, H, hd]` right-padded) against a cache
    `[S, L, n_kv, hd]`: row b's `lengths[b]` tokens sit at positions `starts[b]`, `starts[b] + 1`, ... and read cache
    row `slots[b]` from index 0 (its earlier positions, and this call's tokens once written). Padding tokens are
    in no tile."""
    b = len(starts)
    positions = (torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(t)).reshape(-1)  # [B*T]
    tiles = tiles_for_documents(torch.arange(b) * t, lengths, slots, torch.zeros(b, dtype=torch.long),
                                tokens_per_tile, "cpu")
    return Tiles(positions.to(device), *(x.to(device) for x in tiles))
