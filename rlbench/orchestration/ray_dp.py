"""Data parallelism of one RL step, the driver's half: split the rollout by DP rank.

Driver:  shards = split_steps_by_dp(samples, gbs, dp, balance)   # [rank][optimizer step] -> samples
Rank r:  RankStep(..., reduce=DPAllReduce(dp_group)): pack its shard, recompute log-probs and train with
         GLOBAL normalisation (all-reduced counts), so the gradient equals the single-process gradient up to
         float summation order (`rlbench.rank_step`, the same class the local Trainer runs).

Each optimizer step's global batch is the same set of samples as in a single-process run (samples
[s*gbs, (s+1)*gbs) of the rollout); only that set is divided over the ranks (equal counts, balanced tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlbench.packing import split_by_dp
from rlbench.types import Sample


def split_steps_by_dp(samples: Sequence[Sample], gbs: int, dp_size: int, balance: bool) -> list[list[list[Sample]]]:
    """`[rank][step] -> samples`: each global batch of `gbs` consecutive samples split over `dp_size` ranks.

    balance=True: equal counts with balanced total tokens (equal-size Karmarkar-Karp); False: strided round-robin.
    """
    if len(samples) % gbs:
        raise ValueError(f"{len(samples)} samples are not a multiple of global_batch_size={gbs}")
    shards: list[list[list[Sample]]] = [[] for _ in range(dp_size)]
    for start in range(0, len(samples), gbs):
        step = list(samples[start : start + gbs])
        parts = split_by_dp([s.total_length for s in step], dp_size, balance=balance)
        for rank, idx in enumerate(parts):
            shards[rank].append([step[i] for i in idx])
    return shards

