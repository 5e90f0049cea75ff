"""Data parallelism of one RL step: split the rollout by DP rank (driver), then, on each rank, pack its shard,
recompute log-probs and train with GLOBAL normalisation (all-reduced counts), so the gradient equals the
single-process gradient up to float summation order.

Driver:  shards = split_steps_by_dp(samples, gbs, dp, balance)   # [rank][optimizer step] -> samples
Rank r:  step = ShardStep(cfg, backend, pad_token_id); step.pack(shards[r]); step.compute_log_probs(); step.train()

Each optimizer step's global batch is the same set of samples as in a single-process run (samples
[s*gbs, (s+1)*gbs) of the rollout); only that set is divided over the ranks (equal counts, balanced tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlbench.algorithms import ResponseBatch, build_loss, build_loss_inputs
from rlbench.algorithms.aggregation import GlobalNorm
from rlbench.algorithms.loss import global_norm, is_batch_stats
from rlbench.packing import num_micro_batches, split_by_dp
from rlbench.packing.pack import make_step_packs
from rlbench.trainer import train_optimizer_steps
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


def _all_reduce(values: list[float], group, op=dist.ReduceOp.SUM, device=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def _sample_means(values: list[torch.Tensor | None], packs) -> list[float]:
    """Per-sample masked means (the trainer's rollout/*log_probs summaries), to be averaged on the driver."""
    out = []
    for v, p in zip(values, packs):
        if v is None:
            return []
        for vs, ms in zip(torch.split(v, p.response_lengths), torch.split(p.loss_mask, p.response_lengths)):
            out.append(float((vs * ms).sum() / ms.sum().clamp(min=1)))
    return out


class ShardStep:
    """One trainer rank's part of an RL step: pack, log-probs, optimizer steps (all collective over the ranks).

    Args:
        cfg: the RunConfig (uses `batch`, `loss`, `backend.cp_size`).
        backend: this rank's TrainBackend (already `init()`-ed, in the trainer process group).
        pad_token_id: pad id for packs.
    """

    def __init__(self, cfg, backend, pad_token_id: int) -> None:
        self.cfg, self.backend, self.pad_token_id = cfg, backend, pad_token_id
        self.loss = build_loss(cfg.loss)
        self.device = backend.env.device if backend.env.device.type == "cuda" else None  # gloo reduces CPU tensors
        self.group = backend.env.mesh["dp"].get_group()  # CP peers hold the same samples: reduce over DP only
        self.packs: list[list] = []
        self.old: list[list] | None = None
        self.ref: list[list] | None = None

    def _reduce_max(self, n: int) -> int:
        return int(_all_reduce([float(n)], self.group, dist.ReduceOp.MAX, self.device)[0])

    def pack(self, steps: list[list[Sample]]) -> list[list]:
        """`[step][micro-batch] -> Pack` for this rank's samples; the micro-batch count is the DP-wide MAX."""
        b = self.cfg.batch
        if b.use_dynamic_batch_size:
            mode = {"max_tokens": b.max_tokens_per_gpu, "cp_size": self.backend.cfg.cp_size}
        else:
            mode = {"micro_batch_size": b.micro_batch_size}
        budget = b.max_tokens_per_gpu * self.backend.cfg.cp_size if b.use_dynamic_batch_size else None
        self.packs = []
        for samples in steps:
            n_mb = num_micro_batches([s.total_length for s in samples], **mode, reduce_max=self._reduce_max)
            self.packs.append(make_step_packs(samples, n_mb, budget, pad_token_id=self.pad_token_id))
        self.old = self.ref = None
        return self.packs

    def compute_log_probs(self) -> dict:
        """Old (and ref) log-probs of every pack; returns per-sample means and times (combined by the driver)."""
        out: dict = {"old": [], "ref": [], "rollout": []}
        if not self.cfg.loss.use_rollout_logprobs:
            start = time.perf_counter()
            self.old = [[o.log_probs for o in self.backend.compute_log_prob(p, model="actor")] for p in self.packs]
            out["perf/log_probs_time"] = time.perf_counter() - start
            out["old"] = [m for s, p in zip(self.old, self.packs) for m in _sample_means(s, p)]
        if self.cfg.loss.needs_ref:
            start = time.perf_counter()
            self.ref = [[o.log_probs for o in self.backend.compute_log_prob(p, model="ref")] for p in self.packs]
            out["perf/ref_log_probs_time"] = time.perf_counter() - start
            out["ref"] = [m for s, p in zip(self.ref, self.packs) for m in _sample_means(s, p)]
        out["rollout"] = [m for p in self.packs for m in _sample_means([q.rollout_log_probs for q in p], p)]
        return out

    def _response_batches(self, s: int) -> list[ResponseBatch]:
        return [
            ResponseBatch(
                loss_mask=p.loss_mask, advantages=p.advantages, response_lengths=list(p.response_lengths),
                old_log_probs=self.old[s][i] if self.old is not None else None, rollout_log_probs=p.rollout_log_probs,
                ref_log_probs=self.ref[s][i] if self.ref is not None else None,
            )
            for i, p in enumerate(self.packs[s])
        ]

    def _global_inputs(self, mbs: list[ResponseBatch]):
        """Loss inputs normalised by the counts of the whole global batch (all ranks), IS stats DP-summed."""
        local = global_norm(self.cfg.loss, mbs)
        n_samples, n_tokens = _all_reduce([float(local.n_samples), float(local.n_tokens)], self.group, device=self.device)
        norm = GlobalNorm(int(round(n_samples)), n_tokens, local.constant)
        stats = is_batch_stats(self.cfg.loss, mbs)
        if stats is not None:
            stats = torch.tensor(_all_reduce(stats.double().tolist(), self.group, device=self.device), dtype=stats.dtype)
        return build_loss_inputs(self.cfg.loss, mbs, norm=norm, batch_stats=stats)

    def train(self) -> dict[str, float]:
        """One optimizer step per global batch; `train/*` are global (the backend all-reduces its sums)."""
        if self.old is None and self.ref is None and not self.cfg.loss.use_rollout_logprobs:
            self.compute_log_probs()
        steps = ((packs, self._global_inputs(self._response_batches(s))) for s, packs in enumerate(self.packs))
        metrics = train_optimizer_steps(self.backend, self.loss, steps)
        # Summed over ranks: each rank's first micro-batch (exactly 0 when the policy is unchanged).
        metrics["train/ppo_kl_first_mb"] = _all_reduce([metrics["train/ppo_kl_first_mb"]], self.group, device=self.device)[0]
        return metrics
