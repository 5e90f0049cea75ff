"""Pack samples into flat `[T]` micro-batches and map model outputs back to response tokens.

Layout of a `Pack` of n sequences (all offsets explicit, nothing is inferred from token values):

    tokens      | seq 0 | pad0 | seq 1 | pad1 | ... | seq n-1 | pad n-1 | trailing pad |
    cu_seqlens  0       c1             c2          ...                  c_n            T
                 `-- slot 0 --'

Slot i holds sequence i (`seq_lengths[i]` real tokens) followed by `seq_pads[i]` alignment tokens
(only when built with `seq_align > 1`, which zig-zag context parallelism needs). Alignment tokens
continue the sequence's positions, so a causal kernel or a position-id document mask keeps them
after the real tokens: real tokens never attend to them. The trailing `pad_length` tokens form their
own pseudo-sequence (positions restart at 0) and are outside `cu_seqlens` (`cu_seqlens_with_pad`
includes them). Position `p` predicts token `p+1`; `response_index` lists, in response order, the
positions that predict each response token.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rlbench.packing.balance import check_budget, first_fit_count, partition
from rlbench.types import Sample

__all__ = [
    "Pack",
    "as_samples",
    "make_step_packs",
    "pack_samples",
    "repad",
    "response_values",
    "round_up",
    "truncate_sample",
    "unpack_response",
    "unpack_tokens",
]

SampleLike = Sample | Sequence[int]


@dataclass
class Pack:
    """One micro-batch: n sequences flattened into T tokens. See the module docstring for the layout."""

    tokens: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, restarts at 0 per sequence and for the trailing pad
    cu_seqlens: torch.Tensor  # [n+1] int32 slot boundaries; cu_seqlens[-1] == T - pad_length
    seq_lengths: torch.Tensor  # [n] long, real tokens per sequence (slot minus alignment pad)
    sample_ids: list[int]  # [n] positions of the sequences in the list the pack was built from
    response_lengths: list[int]  # [n]
    response_index: torch.Tensor  # [R] long, position predicting each response token
    loss_mask: torch.Tensor  # [R] float32
    advantages: torch.Tensor  # [R] float32
    rollout_log_probs: torch.Tensor | None  # [R] float32, None when the engine gave none
    pad_length: int  # trailing pad tokens (their own pseudo-sequence)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [R] response-space arrays
    truncated_ids: list[int] = field(default_factory=list)  # sample_ids cut to fit the token budget
    pad_token_id: int = 0  # id written into pad slots (never read back to find padding)

    @property
    def num_tokens(self) -> int:
        """T, including all padding."""
        return int(self.tokens.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)

    @property
    def num_real_tokens(self) -> int:
        return int(self.seq_lengths.sum())

    @property
    def num_padding(self) -> int:
        """Alignment pads inside slots plus the trailing pad."""
        return self.num_tokens - self.num_real_tokens

    @property
    def seq_pads(self) -> torch.Tensor:
        """[n] long, alignment tokens after each sequence."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long() - self.seq_lengths

    @property
    def cu_seqlens_with_pad(self) -> torch.Tensor:
        """[n+1] or [n+2] int32: `cu_seqlens` plus the trailing pad as one more slot when present."""
        if self.pad_length == 0:
            return self.cu_seqlens
        return torch.cat([self.cu_seqlens, self.cu_seqlens.new_tensor([self.num_tokens])])


def as_samples(items: Sequence[SampleLike]) -> list[Sample]:
    """Samples as given; a plain token list becomes a Sample whose response is all but its first token."""
    return [x if isinstance(x, Sample) else Sample(tokens=list(x), response_length=len(x) - 1) for x in items]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def truncate_sample(sample: Sample, max_len: int) -> Sample:
    """A copy cut to its first `max_len` tokens; response arrays are cut to the response tokens kept."""
    keep = max(0, min(sample.response_length, max_len - sample.prompt_length))
    cut = {
        name: getattr(sample, name)[:keep]
        for name in ("loss_mask", "rollout_log_probs", "token_advantages")
        if getattr(sample, name) is not None
    }
    return dataclasses.replace(sample, tokens=sample.tokens[:max_len], response_length=keep, **cut)


def _response_arrays(s: Sample, i: int, extras: Mapping[str, Sequence[Sequence[float]]]) -> dict:
    """Per-token response arrays of sample i (all of length response_length)."""
    adv = s.token_advantages if s.token_advantages is not None else [s.advantage or 0.0] * s.response_length
    out = {"loss_mask": s.loss_mask, "advantages": adv, "rollout_log_probs": s.rollout_log_probs}
    for name, values in extras.items():
        if len(values[i]) < s.response_length:
            raise ValueError(f"extras[{name!r}][{i}] has {len(values[i])} values, need {s.response_length}")
        out[name] = values[i][: s.response_length]  # truncated samples keep the leading values
    return out


def _concat(arrays: list, dtype: type) -> torch.Tensor:
    """Concatenate Python lists into one tensor (numpy is ~3x faster than torch.tensor on lists)."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(arrays), dtype=dtype))


def pack_samples(
    samples: Sequence[SampleLike],
    indices: Sequence[int] | None = None,
    *,
    pad_multiple: int = 1,
    seq_align: int = 1,
    pad_token_id: int = 0,
    extras: Mapping[str, Sequence[Sequence[float]]] | None = None,
    truncated_ids: Sequence[int] = (),
) -> Pack:
    """Flatten `samples[indices]` (default: all) into one Pack.

    Args:
        samples: Samples (or plain token lists, see `as_samples`); each needs a prompt of >= 1 token,
            since position p-1 of the same sequence predicts response token p.
        indices: which samples, in pack order; recorded as `Pack.sample_ids`.
        pad_multiple: T is rounded up to a multiple of this with a trailing pad pseudo-sequence.
        seq_align: every slot is rounded up to a multiple of this (2*cp for zig-zag CP).
        extras: name -> per-sample per-response-token values (indexed like `samples`), e.g. old/ref logprobs.
    """
    if pad_multiple < 1 or seq_align < 1:
        raise ValueError(f"pad_multiple={pad_multiple} and seq_align={seq_align} must be >= 1")
    samples = as_samples(samples)
    ids = list(range(len(samples))) if indices is None else [int(i) for i in indices]
    extras = dict(extras or {})
    pieces, arrays = [], {}
    for i in ids:
        s = samples[i]
        if s.prompt_length < 1:
            raise ValueError(f"sample {i} has no prompt token; a response token needs a predecessor")
        pieces += (s.tokens, [pad_token_id] * (round_up(s.total_length, seq_align) - s.total_length))
        for name, values in _response_arrays(s, i, extras).items():
            arrays.setdefault(name, []).append(values)
    real = torch.tensor([samples[i].total_length for i in ids], dtype=torch.long)  # [n]
    slots = -(-real // seq_align) * seq_align  # [n]
    bounds = torch.cat([real.new_zeros(1), slots.cumsum(0)])  # [n+1]
    pad = round_up(int(bounds[-1]), pad_multiple) - int(bounds[-1]) if ids else pad_multiple
    pieces.append([pad_token_id] * pad)
    return _make_pack(samples, ids, _concat(pieces, np.int64), real, bounds, pad, pad_token_id, arrays, truncated_ids)


def _ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Concatenated aranges: [starts[0], starts[0]+sizes[0]) ++ [starts[1], ...) ..."""
    offsets = torch.cumsum(sizes, 0) - sizes  # [n] exclusive cumsum
    return torch.arange(int(sizes.sum())) + torch.repeat_interleave(starts - offsets, sizes)


def _make_pack(samples, ids, tokens, real, bounds, pad, pad_token_id, arrays, truncated_ids):
    logps = arrays.pop("rollout_log_probs", [])
    if any(v is None for v in logps) and not all(v is None for v in logps):
        raise ValueError("some samples have rollout_log_probs and some do not; pass all or none")
    f32 = np.float32
    resp = torch.tensor([samples[i].response_length for i in ids], dtype=torch.long)  # [n]
    slot_sizes = torch.cat([bounds[1:] - bounds[:-1], torch.tensor([pad])])  # slots + trailing pad
    return Pack(
        tokens=tokens,
        position_ids=_ranges(torch.zeros_like(slot_sizes), slot_sizes),
        cu_seqlens=bounds.to(torch.int32),
        seq_lengths=real,
        sample_ids=ids,
        response_lengths=resp.tolist(),
        response_index=_ranges(bounds[:-1] + real - resp - 1, resp),
        loss_mask=_concat(arrays.pop("loss_mask", []), f32),
        advantages=_concat(arrays.pop("advantages", []), f32),
        rollout_log_probs=_concat(logps, f32) if logps and logps[0] is not None else None,
        pad_length=pad,
        extras={name: _concat(v, f32) for name, v in arrays.items()},
        truncated_ids=sorted(set(ids) & set(truncated_ids)),
        pad_token_id=pad_token_id,
    )


def response_values(pack: Pack, values_t: torch.Tensor) -> torch.Tensor:
    """Position-space outputs `[T, ...]` (or `[T-1, ...]`) -> response space `[R, ...]`."""
    return values_t[pack.response_index]


def unpack_response(pack: Pack, values_r: torch.Tensor) -> list[torch.Tensor]:
    """Response-space `[R, ...]` -> one tensor per sequence, exactly its response tokens."""
    if values_r.shape[0] != len(pack.response_index):
        raise ValueError(
            f"values have {values_r.shape[0]} rows but the pack has R={len(pack.response_index)} response "
            f"tokens; map position-space outputs with response_values(pack, values) first"
        )
    return list(torch.split(values_r, pack.response_lengths))


def unpack_tokens(pack: Pack, values_t: torch.Tensor) -> list[torch.Tensor]:
    """Position-space `[T, ...]` -> per sequence its real tokens' rows (alignment and trailing pad dropped)."""
    starts = pack.cu_seqlens[:-1].tolist()
    return [values_t[s : s + n] for s, n in zip(starts, pack.seq_lengths.tolist())]


def repad(pack: Pack, *, seq_align: int = 1, pad_multiple: int = 1) -> Pack:
    """The same sequences re-laid out with new alignment (old padding removed first)."""
    toks = unpack_tokens(pack, pack.tokens)
    samples: list[SampleLike] = [[0]] * (max(pack.sample_ids, default=-1) + 1)
    resp = {"loss_mask": pack.loss_mask, "token_advantages": pack.advantages}
    if pack.rollout_log_probs is not None:
        resp["rollout_log_probs"] = pack.rollout_log_probs
    split = {name: unpack_response(pack, v) for name, v in (resp | pack.extras).items()}
    extras: dict[str, list] = {name: [[]] * len(samples) for name in pack.extras}
    for j, i in enumerate(pack.sample_ids):
        fields = {name: split[name][j].tolist() for name in resp}
        samples[i] = Sample(tokens=toks[j].tolist(), response_length=pack.response_lengths[j], **fields)
        for name in extras:
            extras[name][i] = split[name][j].tolist()
    return pack_samples(
        samples, pack.sample_ids, pad_multiple=pad_multiple, seq_align=seq_align,
        pad_token_id=pack.pad_token_id, extras=extras, truncated_ids=pack.truncated_ids,
    )


def make_step_packs(
    samples: Sequence[SampleLike],
    n_micro_batches: int | None = None,
    max_tokens: int | None = None,
    pad_multiple: int = 1,
    *,
    seq_align: int = 1,
    truncate: bool = False,
    pad_token_id: int = 0,
    extras: Mapping[str, Sequence[Sequence[float]]] | None = None,
) -> list[Pack]:
    """All packs (micro-batches) of one optimizer step of one DP rank.

    Args:
        samples: this rank's samples of the step; `Pack.sample_ids` index this list.
        n_micro_batches: pack count, normally `num_micro_batches(...)` after the DP MAX all-reduce;
            None = first-fit count under the budget (single-rank use).
        max_tokens: budget per pack INCLUDING padding (for CP: max_tokens_per_gpu * cp_size).
            Sequences are costed at their aligned slot size and packs get at most
            `max_tokens // pad_multiple * pad_multiple` slot tokens, so the padded T never exceeds it.
        truncate: cut sequences longer than the budget (recorded in `Pack.truncated_ids`) instead of
            raising ValueError.
    Returns:
        n_micro_batches packs (more only if n_micro_batches is below the first-fit count; see
        `partition`). A pack with no sequences is a `pad_multiple`-token pad-only pack.
    """
    samples, truncated = as_samples(samples), []
    budget = None if max_tokens is None else max_tokens // pad_multiple * pad_multiple
    if budget is not None and truncate:
        limit = budget // seq_align * seq_align
        truncated = [i for i, s in enumerate(samples) if s.total_length > limit]
        samples = [truncate_sample(s, limit) if i in truncated else s for i, s in enumerate(samples)]
    costs = [round_up(s.total_length, seq_align) for s in samples]
    if n_micro_batches is None:
        if budget is None:
            raise ValueError("pass n_micro_batches= or max_tokens= (dynamic count)")
        n_micro_batches = max(1, first_fit_count(costs, budget)) if costs else 1
    if budget is not None:
        check_budget(costs, budget)
    parts = partition(costs, n_micro_batches, budget)
    return [
        pack_samples(samples, p, pad_multiple=pad_multiple, seq_align=seq_align, pad_token_id=pad_token_id,
                     extras=extras, truncated_ids=truncated)
        for p in parts
    ]
