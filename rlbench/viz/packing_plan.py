"""What rlbench's packing does to one optimizer step of lengths, as plain data for the figures.

`plan_packing` runs the library's own functions in the order the trainer does: `split_by_dp`
(equal sample counts per DP rank), `num_micro_batches` per rank reduced with MAX over ranks, then
`partition` (Karmarkar–Karp with the budget repaired) or a naive in-order first-fit for comparison.
The padding and imbalance numbers are computed from that plan; nothing here draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlbench import packing
from rlbench.types import Sample

PACKERS = ("karmarkar-karp", "first-fit")


def first_fit_packs(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Naive in-order first-fit: each sequence goes into the first pack with room (slime's count)."""
    packs: list[list[int]] = []
    loads: list[int] = []
    for i, n in enumerate(lengths):
        b = next((b for b, load in enumerate(loads) if load + n <= capacity), None)
        if b is None:
            packs.append([])
            loads.append(0)
            b = len(packs) - 1
        packs[b].append(i)
        loads[b] += n
    return packs


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple  # the library's packing.pack.round_up


@dataclass
class PackingPlan:
    """One optimizer step packed over `dp_size` ranks: `packs[r][m]` is micro-batch m of rank r (a real `Pack`).

    `positions[r]` maps a pack's `sample_ids` (indices into rank r's samples) back to positions in
    `lengths`; `sample_ids[pos]` is the Sample.index shown in hovers.
    """

    lengths: list[int]
    sample_ids: list[int]
    max_tokens_per_gpu: int
    dp_size: int
    cp_size: int
    packer: str
    positions: list[list[int]] = field(default_factory=list)
    packs: list[list[packing.Pack]] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        """Token budget of one micro-batch (a CP group shares it): max_tokens_per_gpu * cp_size."""
        return self.max_tokens_per_gpu * self.cp_size

    @property
    def seq_align(self) -> int:
        """Zig-zag CP cuts every sequence slot into 2*cp equal chunks, so slots align to 2*cp."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    @property
    def n_micro_batches(self) -> int:
        return max(len(r) for r in self.packs)

    @property
    def ranks(self) -> list[list[list[int]]]:
        """`ranks[r][m]`: positions in `lengths` of the sequences of pack m of rank r, in pack order."""
        return [[[pos[i] for i in p.sample_ids] for p in rank] for rank, pos in zip(self.packs, self.positions)]

    def pack_tokens(self, r: int, m: int) -> int:
        """Real tokens in pack m of rank r (0 for a slot a rank leaves empty)."""
        return self.packs[r][m].num_real_tokens if m < len(self.packs[r]) else 0

    def pack_pad(self, r: int, m: int) -> int:
        """Alignment + trailing pad tokens of pack m of rank r."""
        return self.packs[r][m].num_padding if m < len(self.packs[r]) else 0

    def cu_seqlens(self, r: int, m: int) -> list[int]:
        """[n+1] slot offsets of pack m of rank r: [0, slot1, slot1+slot2, ...] (slot = sequence + alignment)."""
        return self.packs[r][m].cu_seqlens.tolist()

    def report(self) -> packing.PackingReport:
        """The library's PackingReport over all packs of all ranks."""
        return packing.PackingReport.from_packs([p for rank in self.packs for p in rank], self.capacity)

    def summary(self) -> dict[str, float]:
        """Padding and balance numbers of the plan.

        - `pad_tokens`: alignment tokens so every slot splits into 2*cp equal CP chunks, plus trailing pads.
        - `rank_imbalance`: max / mean of the real tokens per DP rank (1.0 = perfect).
        - `pack_imbalance`: max / mean of the real tokens per pack (the library's PackingReport).
        - `lockstep_idle`: ranks run micro-batch m together, so the step costs Σ_m max_r tokens(r, m)
          (padding included); this is the fraction of those token slots with no real token.
        - `budget_fill`: real tokens / (n_micro_batches * dp * capacity).
        """
        total = sum(self.lengths)
        n_mb, dp = self.n_micro_batches, self.dp_size
        cost = [max(self.pack_tokens(r, m) + self.pack_pad(r, m) for r in range(dp)) for m in range(n_mb)]
        per_rank = [sum(self.pack_tokens(r, m) for m in range(n_mb)) for r in range(dp)]
        mean = total / dp
        return {
            "sequences": len(self.lengths),
            "tokens": total,
            "n_micro_batches": n_mb,
            "pad_tokens": sum(self.pack_pad(r, m) for r in range(dp) for m in range(n_mb)),
            "rank_imbalance": max(per_rank) / mean if mean else 1.0,
            "pack_imbalance": self.report().imbalance,
            "lockstep_idle": 1.0 - total / (dp * sum(cost)) if sum(cost) else 0.0,
            "budget_fill": total / (n_mb * dp * self.capacity),
        }


def plan_packing(lengths: Sequence[int] | None = None, *, max_tokens_per_gpu: int, dp_size: int = 1,
                 cp_size: int = 1, packer: str = "karmarkar-karp", balance_dp: bool = True,
                 samples: Sequence[Sample] | None = None, sample_ids: Sequence[int] | None = None) -> PackingPlan:
    """Packs one optimizer step the way the trainer does (see module docstring), with the library's own Packs.

    Args:
        lengths: [N] sequence lengths (token lists of zeros are packed), or None when `samples` is given.
        samples: real Samples to pack instead (their `total_length`s are the lengths).
        sample_ids: [N] ids shown in hovers; default `Sample.index` or 0..N-1.
    Raises:
        ValueError: from the library (uneven DP split, a sequence over budget) or an unknown packer.
    """
    if packer not in PACKERS:
        raise ValueError(f"packer={packer!r} is not one of {PACKERS}")
    if (lengths is None) == (samples is None):
        raise ValueError("pass exactly one of lengths= or samples=")
    items = list(samples) if samples is not None else [[0] * int(n) for n in lengths]
    items = packing.as_samples(items)
    ids = list(sample_ids) if sample_ids is not None else (
        [s.index for s in items] if samples is not None else list(range(len(items))))
    if len(ids) != len(items):
        raise ValueError(f"{len(ids)} sample_ids for {len(items)} sequences; pass one id per sequence")
    plan = PackingPlan([s.total_length for s in items], ids, max_tokens_per_gpu, dp_size, cp_size, packer)
    plan.positions = packing.split_by_dp(plan.lengths, dp_size, balance=balance_dp)
    align = plan.seq_align
    costs = [[round_up(plan.lengths[i], align) for i in pos] for pos in plan.positions]
    n_mb = max(packing.num_micro_batches([plan.lengths[i] for i in pos], max_tokens=max_tokens_per_gpu,
                                         cp_size=cp_size, seq_align=align) for pos in plan.positions)
    for pos, cost in zip(plan.positions, costs):  # n_mb above is the all-reduce(MAX) over DP
        rank_samples = [items[i] for i in pos]
        if packer == "karmarkar-karp":
            packs = packing.make_step_packs(rank_samples, n_mb, plan.capacity, align, seq_align=align)
        else:
            packs = [packing.pack_samples(rank_samples, part, pad_multiple=align, seq_align=align)
                     for part in first_fit_packs(cost, plan.capacity)]
        plan.packs.append(packs)
    return plan


def cp_segments(pack: packing.Pack, cp_size: int) -> list[tuple[int, int, int, int | None]]:
    """Where the tokens of a (CP-aligned) pack live under the library's zig-zag CP layout.

    Returns (cp_rank, start, end, j): maximal runs of global positions [start, end) held by one CP rank
    and belonging to one sequence j of the pack (j = None for alignment or trailing padding).
    """
    layout = packing.cp_layout(pack, cp_size, zigzag=True)
    owner = [0] * pack.num_tokens
    for r, idx in enumerate(layout.indices):
        for t in idx.tolist():
            owner[t] = r
    seq_of: list[int | None] = [None] * pack.num_tokens
    for j, (start, n) in enumerate(zip(pack.cu_seqlens[:-1].tolist(), pack.seq_lengths.tolist())):
        seq_of[start : start + n] = [j] * n
    runs: list[tuple[int, int, int, int | None]] = []
    for t in range(pack.num_tokens):
        if runs and runs[-1][0] == owner[t] and runs[-1][3] == seq_of[t] and runs[-1][2] == t:
            r, a, _, j = runs[-1]
            runs[-1] = (r, a, t + 1, j)
        else:
            runs.append((owner[t], t, t + 1, seq_of[t]))
    return runs


def cp_work(pack: packing.Pack, cp_size: int, *, zigzag: bool = True) -> list[int]:
    """Causal-attention work per CP rank: Σ over the rank's query tokens of (position_id + 1).

    Under a document mask token t attends to position_ids[t] + 1 keys, so this is each rank's share of
    the attention FLOPs. The pack must be laid out with `packing.pad_for_cp(pack, cp_size, zigzag=...)`.
    """
    layout = packing.cp_layout(pack, cp_size, zigzag=zigzag)
    return [int((pack.position_ids[idx] + 1).sum()) for idx in layout.indices]


def padding_waste(lengths: Sequence[int], micro_batch_size: int) -> float:
    """Fraction of padded slots when fixed-size micro-batches pad each sequence to the batch max."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    slots = 0
    for s in range(0, len(lengths), micro_batch_size):
        chunk = lengths[s : s + micro_batch_size]
        slots += max(chunk) * len(chunk)
    return 1.0 - sum(lengths) / slots if slots else 0.0


def samples_of(rollout: object) -> list[Sample]:
    """The Samples of a RolloutBatch (`.samples`), of a trainer (`.last_rollout`) or a Sample list."""
    if hasattr(rollout, "last_rollout"):
        rollout = rollout.last_rollout
    return list(getattr(rollout, "samples", rollout))


def log_normal_lengths(n: int, *, median: int, sigma: float, max_len: int, seed: int = 0) -> list[int]:
    """A long-tailed length distribution (log-normal, clipped to [1, max_len]) for packing demos."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return [int(x) for x in np.clip(np.round(raw), 1, max_len)]
