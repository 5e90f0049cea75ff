"""A preallocated, slot-based KV cache: one fixed-length row per running sequence.

Layout per layer: `k[l], v[l]` of shape `[S, n_kv, L_max + KV_PAD, head_dim]` (S slots, L_max = max sequence
length; the pad keeps every decode slice `[:kv_len]` a strict one),
the layout SDPA reads directly. Slots are handed out lowest-first, so a decode batch over slots `[0, B)`
covers every running sequence with little waste; a finished sequence frees its slot for a waiting prompt.

Grouped layout (`group_view(k)`, the n samples of one prompt): the same memory seen as `S // k` group rows of
`k (L_max + KV_PAD)` positions, `[S // k, n_kv, k (L_max + KV_PAD), head_dim]`. A group row holds its prompt's K/V
once at `[0, P)`, then its k samples' tokens interleaved: the t-th token after the prompt of sample j at
`P + t k + j`. A decode step then reads each prompt once for all k samples instead of once per sample, and
the allocator hands out whole group rows.

Slots kept by sessions (`TorchEngine.generate(keep=True)`) stay busy across calls: `reset(group, busy)` leaves
every unit holding a busy slot out of the free list. A kept sample decoded in the grouped layout is moved to its
own slot by `ungroup` (its slot index in the slot layout is its row's index, so no other slot is taken).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import torch

KV_PAD = 16
"""Extra positions allocated past `max_seq_len` (never written or read). The decode attention reads the
slice `[:kv_len]` with kv_len <= max_seq_len, so the slice is never the whole (contiguous) dimension;
otherwise a kv_len bucket equal to the full length is a special case that recompiles the whole model."""


@dataclass(frozen=True)
class CacheShape:
    """Geometry of the cache."""

    num_layers: int
    """Decoder layers (one K and one V tensor each)."""
    num_kv_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Channels per head."""
    num_slots: int
    """Sequences that can run at once."""
    max_seq_len: int
    """Prompt + response tokens per slot (a multiple of 16, for the attention kernels)."""

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be >= 1; give more memory or a smaller max_seq_len")
        if self.max_seq_len < 16 or self.max_seq_len % 16:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be a positive multiple of 16")

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return slot_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.max_seq_len, dtype)


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one slot."""
    positions = max_seq_len + KV_PAD
    return 2 * num_layers * num_kv_heads * head_dim * positions * torch.empty((), dtype=dtype).element_size()


def slots_for_memory(free_bytes: int, fraction: float, per_slot: int, cap: int) -> int:
    """How many slots fit in `fraction` of `free_bytes`, at most `cap`."""
    return max(0, min(cap, int(free_bytes * fraction) // per_slot))


class KVCache:
    """The K/V tensors plus a lowest-first slot allocator."""

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device | str):
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._free: list[int] = []
        self.group = 1
        """Slots per allocation unit (`reset(group)`): 1, or the k samples of a grouped-layout prompt."""
        self._views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        """(Re-)create the tensors (zeros, so masked-out garbage is never NaN) and free every slot."""
        s = self.shape
        dims = (s.num_slots, s.num_kv_heads, s.max_seq_len + KV_PAD, s.head_dim)
        self.k = [torch.zeros(dims, dtype=self.dtype, device=self.device) for _ in range(s.num_layers)]
        self.v = [torch.zeros(dims, dtype=self.dtype, device=self.device) for _ in range(s.num_layers)]
        self._views = {}
        self.reset()

    def release(self) -> None:
        """Drop the tensors (`sleep`); `allocate` brings them back."""
        self.k, self.v = [], []
        self._views = {}
        self._free = []

    def reset(self, group: int = 1, busy: Iterable[int] = ()) -> None:
        """Mark every unit free (the contents stay; they are masked by length): slots, or with `group` k > 1 the
        `S // k` group rows of `group_view(k)`; units holding a slot of `busy` (kept sessions) stay taken."""
        if not 1 <= group <= self.shape.num_slots:
            raise ValueError(f"group={group} must be in [1, num_slots={self.shape.num_slots}]")
        self.group = group
        taken = {slot // group for slot in busy}
        self._free = [u for u in range(self.num_units) if u not in taken]
        heapq.heapify(self._free)

    @property
    def num_units(self) -> int:
        """Allocation units: slots, or group rows of `group` slots."""
        return self.shape.num_slots // self.group

    def group_view(self, group: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V as `[S // group, n_kv, group (L_max + KV_PAD), hd]` views (group 1: the tensors)."""
        if group == 1:
            return self.k, self.v
        if group not in self._views:
            units = self.shape.num_slots // group

            def view(t: torch.Tensor) -> torch.Tensor:
                return t[: units * group].view(units, t.shape[1], group * t.shape[2], t.shape[3])

            self._views[group] = ([view(t) for t in self.k], [view(t) for t in self.v])
        return self._views[group]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """The lowest free unit (a slot, or a group row)."""
        if not self._free:
            raise RuntimeError("no free KV-cache slot (scheduler bug: check num_free first)")
        return heapq.heappop(self._free)

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Copy the first `length` positions of slot `src` into slots `dst` (n samples share a prefill)."""
        if not dst:
            return
        index = torch.tensor(dst, device=self.device)
        for cache in (*self.k, *self.v):
            cache[index, :, :length] = cache[src, :, :length].unsqueeze(0)

    def ungroup(self, row: int, group: int, prefix_len: int, length: int) -> None:
        """Rewrite group row `row` of `group_view(group)` as its `group` samples' own slots (slot layout): slot
        `row * group + j` gets positions `[0, length)` of sample j, the prompt `[0, prefix_len)` then the sample's
        interleaved tokens (`P + t k + j` -> `P + t`). Positions past a sample's own length hold another lane's
        keys: masked by length, as any stale position."""
        pos = torch.arange(length, device=self.device)
        lane = torch.arange(group, device=self.device)[:, None]
        index = torch.where(pos < prefix_len, pos, prefix_len + (pos - prefix_len) * group + lane)  # [k, length]
        for grouped, flat in zip((*self.group_view(group)[0], *self.group_view(group)[1]), (*self.k, *self.v)):
            moved = grouped[row][:, index]  # [n_kv, k, length, hd]: a copy, read before the memory is rewritten
            flat[row * group : (row + 1) * group, :, :length] = moved.transpose(0, 1)
