"""Context-parallel (CP) layout of a pack: padding, zig-zag or contiguous slicing, and the exact inverse.

Zig-zag is per sequence (as Megatron does): every slot (sequence + alignment pad, and the trailing pad
pseudo-sequence) has a length divisible by 2*cp and is cut into 2*cp equal chunks; rank r keeps chunks
r and 2cp-1-r of every slot, in slot order. Causal attention cost per rank is then balanced for every
sequence, and each rank holds `slot/cp` tokens of every slot, so the local cu_seqlens are the global
ones divided by cp. Per-pack zig-zag would need no per-sequence padding but would unbalance the work
under a document mask (a short sequence lands on one rank), so it is not offered.

Contiguous slicing (slime's FSDP CP) cuts the padded pack into cp equal consecutive pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlbench.packing.pack import Pack, repad

__all__ = ["CPLayout", "cp_gather", "cp_layout", "cp_local_response", "cp_slice", "pad_for_cp"]


def pad_for_cp(pack: Pack, cp_size: int, *, zigzag: bool = True, pad_multiple: int = 1) -> Pack:
    """Re-lay out a pack for CP: zig-zag aligns every slot to 2*cp; contiguous pads T to a multiple of cp.

    Padding goes into explicit per-slot alignment (after each sequence's real tokens) and the trailing
    pad pseudo-sequence; real sequences are never extended. `pad_multiple` is also honoured (lcm).
    """
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1")
    if zigzag:
        return repad(pack, seq_align=2 * cp_size, pad_multiple=math.lcm(2 * cp_size, pad_multiple))
    return repad(pack, seq_align=1, pad_multiple=math.lcm(cp_size, pad_multiple))


@dataclass
class CPLayout:
    """Where every token of a pack lives under CP, plus what a CP attention kernel needs."""

    cp_size: int
    zigzag: bool
    cu_seqlens: torch.Tensor  # [S+1] int32, GLOBAL slot boundaries incl. the trailing pad slot
    indices: list[torch.Tensor]  # cp x [T/cp] long: global positions held by each rank, in local order
    local_cu_seqlens: list[torch.Tensor]  # cp x [S+1] int32: slot boundaries in each rank's local tensor

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def _owner(cu: torch.Tensor, cp_size: int, zigzag: bool) -> torch.Tensor:
    """[T] long: the CP rank that holds each global position."""
    total = int(cu[-1])
    t = torch.arange(total)
    if not zigzag:
        return t // (total // cp_size)
    slot = torch.searchsorted(cu[1:].long(), t, right=True)  # [T] slot of each token
    start, length = cu[:-1].long()[slot], (cu[1:] - cu[:-1]).long()[slot]
    chunk = (t - start) // (length // (2 * cp_size))  # [T] in [0, 2cp)
    return torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)


def cp_layout(pack: Pack, cp_size: int, *, zigzag: bool = True) -> CPLayout:
    """The CP layout of a pack already padded with `pad_for_cp` (raises with the fix otherwise)."""
    cu = pack.cu_seqlens_with_pad
    slots = (cu[1:] - cu[:-1]).long()
    if zigzag and bool((slots % (2 * cp_size)).any()):
        raise ValueError(f"zig-zag CP needs every slot divisible by 2*cp={2 * cp_size}; call pad_for_cp first")
    if not zigzag and pack.num_tokens % cp_size:
        raise ValueError(f"T={pack.num_tokens} is not divisible by cp={cp_size}; call pad_for_cp first")
    owner = _owner(cu, cp_size, zigzag)
    indices = [torch.nonzero(owner == r).flatten() for r in range(cp_size)]
    local_cu = []
    for idx in indices:  # local slot boundaries: how many of the rank's tokens precede each global boundary
        local_cu.append(torch.searchsorted(idx, cu.long()).to(torch.int32))
    return CPLayout(cp_size, zigzag, cu, indices, local_cu)


def cp_slice(x: torch.Tensor, layout: CPLayout, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """This rank's part of a position-space tensor (`[T, ...]` along `dim`)."""
    return x.index_select(dim, layout.indices[cp_rank].to(x.device))


def cp_gather(chunks: list[torch.Tensor], layout: CPLayout, dim: int = 0) -> torch.Tensor:
    """Exact inverse of `cp_slice`: the per-rank parts (rank order) -> the full `[T, ...]` tensor.

    Autograd-aware (index_copy), so it works on the output of an autograd all-gather.
    """
    first = chunks[0]
    shape = list(first.shape)
    shape[dim] = layout.num_tokens
    out = first.new_zeros(shape)
    for idx, chunk in zip(layout.indices, chunks):
        out = out.index_copy(dim, idx.to(first.device), chunk)
    return out


def cp_local_response(pack: Pack, layout: CPLayout, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Response tokens this rank can score without gathering logits.

    Returns:
        local_pos [R_r] long: positions in the rank's local tensor whose output predicts a response token;
        resp_ids [R_r] long: the response-space index of that token. Over all ranks the resp_ids cover
        range(R) exactly once. Targets: `pack.tokens[layout.indices[r][local_pos] + 1]`.
    """
    idx = layout.indices[cp_rank]
    local_of_global = torch.full((layout.num_tokens,), -1, dtype=torch.long)
    local_of_global[idx] = torch.arange(len(idx))
    local = local_of_global[pack.response_index]  # [R]
    resp_ids = torch.nonzero(local >= 0).flatten()
    return local[resp_ids], resp_ids
