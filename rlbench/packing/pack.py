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
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rlbench.packing.balance import check_budget, first_fit_count, partition
from rlbench.types import Sample

__all__ = [
    "Pack",
    "as_samples",
    "bucket_length",
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

BUCKET_STEP = 128  # shape buckets: multiples of this up to 8 * BUCKET_STEP (flex_attention's block size) ...
BUCKETS_PER_DOUBLING = 8  # ... then this many lengths per doubling of T (at most 1/8 of T is bucket padding)


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
    images: list = field(default_factory=list)  # [n] per sequence its `ImageInputs` or None (VLM prompts)

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


def bucket_length(n: int, cap: int | None = None, multiple: int = 1) -> int:
    """The padded length of a pack of `n` tokens under shape bucketing: the smallest ladder length >= n.

    Ladder: 128, 256, ..., 1024, then 8 lengths per doubling (1152, 1280, ..., 2048, 2304, ...), each rounded up
    to `multiple`, and `cap` (the micro-batch budget, a multiple of `multiple`) when the next length is above it.
    Packs of up to `cap` tokens so take at most `8 + 8 * ceil(log2(cap / 1024)) + 1` distinct lengths.
    """
    if cap is not None and n > cap:
        raise ValueError(f"a pack of {n} tokens is over its budget cap={cap}; the budget bounds the packed tokens")
    k = max(1, n - 1).bit_length() - 1  # n in (2^k, 2^(k+1)]: steps of 2^k / BUCKETS_PER_DOUBLING
    step = max(BUCKET_STEP, (1 << k) // BUCKETS_PER_DOUBLING)
    length = round_up(round_up(max(n, 1), step), multiple)
    return length if cap is None else min(length, cap)


def truncate_sample(sample: Sample, max_len: int) -> Sample:
    """A copy cut to its first `max_len` tokens; response arrays are cut to the response tokens kept."""
    keep = max(0, min(sample.response_length, max_len - sample.prompt_length))
    cut = {
        name: getattr(sample, name)[:keep]
        for name in ("loss_mask", "rollout_log_probs", "token_advantages")
        if getattr(sample, name) is not None
    }
    return dataclasses.replace(sample, tokens=sample.tokens[:max_len], response_length=keep, **cut)


def _response_sources(s: Sample, i: int, extras: Mapping[str, Sequence[Sequence[float]]]) -> dict:
    """Per response token values of sample i: name -> (list of >= response_length values or None, fill).

    None means "response_length copies of fill" (a scalar advantage, an all-ones loss mask), which
    `_response_f32` writes with one vectorised op instead of converting a Python list.
    """
    n = s.response_length
    mask = s.loss_mask
    if isinstance(mask, list) and mask.count(1) == n:  # count(1) is a C loop, no per-token Python
        mask = None
    out = {"loss_mask": (mask, 1.0), "advantages": (s.token_advantages, s.advantage or 0.0),
           "rollout_log_probs": (s.rollout_log_probs, 0.0)}
    for name, values in extras.items():
        if len(values[i]) < n:
            raise ValueError(f"extras[{name!r}][{i}] has {len(values[i])} values, need {n}")
        out[name] = (values[i], 0.0)  # truncated samples keep the leading values
    return out


def _response_f32(sources: list, resp: list[int], offsets: list[int]) -> torch.Tensor:
    """[R] float32 from per-sample (values or None, fill): one repeat, then one slice write per list."""
    out = np.repeat(np.array([f for _, f in sources], dtype=np.float32), resp)  # [R]
    for (values, _), o, n in zip(sources, offsets, resp):
        if values is not None:
            out[o : o + n] = values[:n] if len(values) != n else values
    return torch.from_numpy(out)


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
    padded = functools.partial(round_up, multiple=pad_multiple)
    return _build_pack(samples, ids, padded, seq_align, pad_token_id, dict(extras or {}), truncated_ids)


def _build_pack(samples: list[Sample], ids: list[int], padded: Callable[[int], int], seq_align: int,
                pad_token_id: int, extras: dict, truncated_ids: Sequence[int]) -> Pack:
    """The Pack of `samples[ids]`, `padded(slot tokens)` tokens long: numpy index arithmetic, one
    `torch.from_numpy` per field.

    Only numpy (single-threaded) runs here: small torch ops each pay intra-op thread wake-ups, which
    cost ~10x more than the work on hosts with many cores.
    """
    chosen = [samples[i] for i in ids]
    for i, s in zip(ids, chosen):
        if s.prompt_length < 1:
            raise ValueError(f"sample {i} has no prompt token; a response token needs a predecessor")
    real = np.array([s.total_length for s in chosen], dtype=np.int64)  # [n]
    resp = np.array([s.response_length for s in chosen], dtype=np.int64)  # [n]
    bounds = np.zeros(len(ids) + 1, dtype=np.int64)  # [n+1] slot boundaries
    np.cumsum(-(-real // seq_align) * seq_align, out=bounds[1:])
    used = int(bounds[-1])
    pad = padded(max(used, 1)) - used  # an empty pack is one padded length of pad
    tokens = np.full(used + pad, pad_token_id, dtype=np.int64)  # [T]
    for s, o in zip(chosen, bounds.tolist()):
        tokens[o : o + s.total_length] = s.tokens
    slot_sizes = np.append(np.diff(bounds), pad)  # [n+1] slots + trailing pad
    r_off = np.cumsum(resp) - resp  # [n] exclusive cumsum: where each response starts in R
    first = bounds[:-1] + real - resp - 1  # [n] position predicting each first response token
    sources = [_response_sources(s, i, extras) for i, s in zip(ids, chosen)]
    names = ["loss_mask", "advantages", "rollout_log_probs", *(extras if ids else ())]  # empty pack: no extras
    pack = _assemble(tokens, bounds, real, resp, r_off, slot_sizes, first, names, sources, ids, pad, pad_token_id,
                     truncated_ids)
    pack.images = [s.images for s in chosen]
    return pack


def _assemble(tokens, bounds, real, resp, r_off, slot_sizes, first, names, sources, ids, pad, pad_token_id,
              truncated_ids):
    """Response-space arrays and the position-space index arrays of `_build_pack`, as a Pack."""
    has_logps = [src["rollout_log_probs"][0] is not None for src in sources]
    if any(has_logps) and not all(has_logps):
        raise ValueError("some samples have rollout_log_probs and some do not; pass all or none")
    resp_l, off_l = resp.tolist(), r_off.tolist()
    arrays = {name: _response_f32([src[name] for src in sources], resp_l, off_l) for name in names
              if name != "rollout_log_probs" or (has_logps and has_logps[0])}
    n_pos, n_resp = int(slot_sizes.sum()), int(resp.sum())
    return Pack(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.from_numpy(np.arange(n_pos, dtype=np.int64) - np.repeat(np.cumsum(slot_sizes) - slot_sizes, slot_sizes)),
        cu_seqlens=torch.from_numpy(bounds.astype(np.int32)),
        seq_lengths=torch.from_numpy(real),
        sample_ids=ids,
        response_lengths=resp_l,
        response_index=torch.from_numpy(np.arange(n_resp, dtype=np.int64) + np.repeat(first - r_off, resp)),
        loss_mask=arrays.pop("loss_mask"),
        advantages=arrays.pop("advantages"),
        rollout_log_probs=arrays.pop("rollout_log_probs", None),
        pad_length=pad,
        extras=arrays,
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
        samples[i] = Sample(tokens=toks[j].tolist(), response_length=pack.response_lengths[j],
                            images=pack.images[j] if pack.images else None, **fields)
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
    bucket: bool = False,
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
        bucket: pad each pack's T up to `bucket_length` (capped at the budget), so that compiled kernels
            see a few distinct shapes; the extra tokens join the trailing pad pseudo-sequence.
    Returns:
        n_micro_batches packs (more only if n_micro_batches is below the first-fit count; see
        `partition`). A pack with no sequences is a pad-only pack of `pad_multiple` tokens (bucket: one bucket).
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
    extras = dict(extras or {})
    if bucket:
        padded = functools.partial(bucket_length, cap=budget, multiple=pad_multiple)
    else:
        padded = functools.partial(round_up, multiple=pad_multiple)
    return [
        _build_pack(samples, [int(i) for i in p], padded, seq_align, pad_token_id, extras, truncated) for p in parts
    ]
