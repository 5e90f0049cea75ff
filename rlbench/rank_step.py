"""One rank's part of an RL step, the same code at one process and at N Ray ranks.

    step = RankStep(cfg.batch, cfg.loss, backend, cp_size=cfg.backend.cp_size, pad_token_id=tokenizer.pad_token_id)
    packs = step.pack(steps)                            # [optimizer step][micro-batch] -> Pack
    old, ref, metrics = step.compute_log_probs(packs)   # [step][micro-batch] -> [R] (None: not computed)
    adv, metrics = step.compute_advantages(packs, old, ref)  # token-level advantages, [step][micro-batch] -> [R]
    metrics = step.train(packs, old, ref, adv)          # one optimizer step per global batch

The packs carry each sample's scalar from scoring (`Pack.advantages`: group statistics broadcast over its
tokens); `compute_advantages` runs the token-level half of the estimator after the model passes
(`rlbench.algorithms.token_advantages`: REINFORCE++ returns, KL-in-reward, GAE with values) and whitens over
the global batch through the reductions below.

In the loop, `compute_log_probs(packs, first_from_forward=True)` skips the old-log-prob pass of the first
optimizer step when the loss allows it (`old_from_forward_ok`): the policy has not changed since the rollout,
so that step's training forward IS π_old (`old = logp.detach()`, TRL's and verl's on-policy shortcut); a
one-step-per-rollout run needs no old-log-prob pass at all; `train` fills those entries of `old` with the
forward's values. The PPO KL of that first micro-batch is then 0 by construction, so the step reports instead
`train/first_mb_kl_vs_rollout`: the first micro-batch's training forward against the ENGINE's log-probs of the
same tokens, before any update (0.0 only when trainer and engine agree bitwise: true on-policy mode).

The only thing that differs between one process and DP ranks is the reductions, taken from one small object
(torchtitan's single `train_step`, nanochat's `if ddp:`): `SingleRank()` is the identity (the local Trainer),
`DPAllReduce(group)` all-reduces over the data-parallel group (the Ray ranks). Through it the micro-batch count
is the DP-wide MAX, the loss normaliser counts the whole global batch, the MIS batch stats and the whitening
statistics are DP sums, and the summaries (`rollout/*log_probs`, `rollout/advantages`,
`train/first_mb_kl_vs_rollout`) are global on every rank. CP peers hold the same samples, so they are not in the
DP group; a CP group shares the token budget of one micro-batch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from rlbench.algorithms import (
    GlobalNorm,
    ResponseBatch,
    build_loss,
    build_loss_inputs,
    global_norm,
    is_batch_stats,
    old_from_forward_ok,
    token_advantages,
    token_advantages_and_returns,
)
from rlbench.algorithms.advantages import reward_kl
from rlbench.algorithms.kl_control import mean_sequence_kl
from rlbench.critic_step import CriticStep, token_mean_global
from rlbench.interrupts import defer_sigint
from rlbench.packing import num_micro_batches
from rlbench.packing.pack import Pack, make_step_packs

if TYPE_CHECKING:
    from rlbench.configs import BatchConfig, LossConfig
    from rlbench.types import Sample

StepTensors = list[list[torch.Tensor]]  # [optimizer step][micro-batch] -> [R]


class SingleRank:
    """The reductions of a one-rank run: every value is already global (the identity)."""

    def sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def max(self, value: int) -> int:
        return value


class DPAllReduce:
    """The reductions of a data-parallel rank: all-reduce (SUM / MAX, float64) over the DP process group.

    Args:
        group: the DP group (not the CP peers: they hold the same samples).
        device: where the reduced tensor lives: the rank's CUDA device for NCCL, None (CPU) for gloo.
    """

    def __init__(self, group, device: torch.device | None = None) -> None:
        self.group, self.device = group, device

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, value: int) -> int:
        return int(self._reduce([value], dist.ReduceOp.MAX)[0])


@dataclass
class TrainProgress:
    """The optimizer steps of one `RankStep.train` call finished so far (resume an interrupted call with it)."""

    per_step: list[dict[str, float]] = field(default_factory=list)
    """`backend.train` metrics of each finished optimizer step (applied, or skipped as non-finite)."""
    first_mb: tuple[float, float, float] | None = None
    """This rank's very first micro-batch: (Σ |log π_θ − log π_rollout| over its trained tokens, their count,
    1.0 when the samples have no rollout log-probs), set when the first optimizer step finished."""
    old_from_forward: bool = False
    """The first optimizer step took π_old from its training forward (`train` then reports `rollout/log_probs`)."""
    critic_steps: list[dict[str, float]] = field(default_factory=list)
    """`backend.train_critic` metrics of each finished critic optimizer step (PPO: the critic trains first)."""

    @property
    def started(self) -> bool:
        """Whether any optimizer step (critic or actor) has finished: the weights may have changed."""
        return bool(self.per_step or self.critic_steps)

    @property
    def applied(self) -> int:
        """Optimizer steps that changed the weights (skipped non-finite steps do not)."""
        return sum(1 for m in self.per_step if not m.get("train/skipped", 0.0))


class RankStep:
    """Pack, old/ref log-probs, loss inputs with GLOBAL normalisation, and training, for this rank's samples.

    Every method is collective over the backend's ranks (each rank calls it with its own samples).

    Args:
        batch: micro-batching (`use_dynamic_batch_size`, `max_tokens_per_gpu`, `micro_batch_size`).
        loss: the algorithm (log-probs to recompute, the loss and its normalisation).
        backend: this rank's TrainBackend, `init()`-ed.
        cp_size: context-parallel size (a micro-batch holds up to `max_tokens_per_gpu * cp_size` tokens).
        pad_token_id: pad id of the packs.
        reduce: `SingleRank()` at one rank, `DPAllReduce(group)` on DP ranks.
    """

    def __init__(self, batch: BatchConfig, loss: LossConfig, backend, *, cp_size: int = 1, pad_token_id: int = 0,
                 reduce: SingleRank | DPAllReduce | None = None) -> None:
        self.batch, self.loss_cfg, self.backend = batch, loss, backend
        self.cp_size, self.pad_token_id = cp_size, pad_token_id
        self.reduce = reduce or SingleRank()
        self.loss = build_loss(loss)
        # PPO with a critic: its values, the returns it regresses on, its update (`rlbench.critic_step`)
        self.critic = CriticStep(loss, backend, self.reduce) if loss.needs_critic else None
        self._graphs = _dynamo_graphs()  # for `perf/compiles`

    # ------------------------------------------------------------------ pack
    def pack(self, steps: Sequence[Sequence[Sample]]) -> list[list[Pack]]:
        """`[step][micro-batch] -> Pack` for this rank's samples of each optimizer step (`Pack.sample_ids` index
        the step's samples); every DP rank gets the same micro-batch count (the DP-wide MAX)."""
        b = self.batch
        # CP: every slot (sequence + alignment pad, trailing pad) a multiple of 2*cp, the zig-zag layout
        # (`rlbench.packing.cp.pad_for_cp`); the CP peers of a DP rank get the same samples, hence the same packs
        align = 2 * self.cp_size if self.cp_size > 1 else 1
        # a backend that compiles one graph per pack length (`pack_buckets`) gets a few bucketed lengths; the
        # training, old and ref passes all run these packs, so they share the graphs
        bucket = bool(getattr(self.backend, "pack_buckets", False))
        if b.use_dynamic_batch_size:
            # counted at the aligned slot sizes the packs will have, so no rank needs more than the DP MAX
            mode = {"max_tokens": b.max_tokens_per_gpu, "cp_size": self.cp_size, "seq_align": align}
            budget = b.max_tokens_per_gpu * self.cp_size  # a CP group shares the tokens of one micro-batch
        else:
            mode, budget = {"micro_batch_size": b.micro_batch_size}, None
        packs = []
        for samples in steps:
            n_mb = num_micro_batches([s.total_length for s in samples], **mode, reduce_max=self.reduce.max)
            packs.append(make_step_packs(samples, n_mb, budget, pad_multiple=align, seq_align=align, bucket=bucket,
                                         pad_token_id=self.pad_token_id))
        return packs

    # ------------------------------------------------------------------ log-probs
    @property
    def old_from_forward(self) -> bool:
        """Whether the first optimizer step may take π_old from its own training forward (`old_from_forward_ok`)."""
        return old_from_forward_ok(self.loss_cfg)

    def compute_log_probs(self, packs: list[list[Pack]], *, first_from_forward: bool = False
                          ) -> tuple[StepTensors | None, StepTensors | None, dict]:
        """Old (actor) log-probs unless the loss uses the rollout's (bypass), and ref log-probs when it needs them.

        Returns `(old, ref, metrics)`: `[step][micro-batch] -> [R]` (None when not computed), and `perf/*_time`,
        the global real-token count of each pass (`perf/log_probs_tokens`, `perf/ref_log_probs_tokens`: the
        FLOPs of `perf/mfu`), the global `rollout/log_probs`, `rollout/ref_log_probs`, `rollout/rollout_log_probs`
        (mean over samples of each sample's masked mean). With `first_from_forward` (and `old_from_forward`), `old[0]` is
        None: the first optimizer step's training forward supplies it, `train` fills it in and reports
        `rollout/log_probs` then; only the later steps' old log-probs are recomputed here (none with one step).
        """
        out: dict[str, float] = {}
        old = ref = None
        if not self.loss_cfg.use_rollout_logprobs and first_from_forward and self.old_from_forward:
            old = [None] + (self._log_probs(packs[1:], "actor", out, "perf/log_probs") if len(packs) > 1 else [])
        elif not self.loss_cfg.use_rollout_logprobs:
            old = self._log_probs(packs, "actor", out, "perf/log_probs")
            out["rollout/log_probs"] = self._sample_mean(old, packs)
        if self.loss_cfg.needs_ref:
            ref = self._log_probs(packs, "ref", out, "perf/ref_log_probs")
            out["rollout/ref_log_probs"] = self._sample_mean(ref, packs)
        rollout = [[p.rollout_log_probs for p in step] for step in packs]
        out["rollout/rollout_log_probs"] = self._sample_mean(rollout, packs)
        return old, ref, out

    def needs_log_probs(self, old: StepTensors | None, ref: StepTensors | None) -> bool:
        """Whether log-probs the loss needs are missing (`compute_log_probs` has not run for these packs); a
        missing first step is not, where its training forward supplies it (`old_from_forward`)."""
        if not self.loss_cfg.use_rollout_logprobs:
            if old is None or any(o is None for o in old[1:]) or (old[0] is None and not self.old_from_forward):
                return True
        return ref is None and self.loss_cfg.needs_ref

    def _log_probs(self, packs, model: str, out: dict, key: str) -> StepTensors:
        """`model`'s log-probs of `packs`; writes `{key}_time` and `{key}_tokens` (real tokens, all DP ranks)."""
        start = time.perf_counter()
        result = [[o.log_probs for o in self.backend.compute_log_prob(step, model=model)] for step in packs]
        out[f"{key}_time"] = time.perf_counter() - start
        out[f"{key}_tokens"] = float(self.reduce.sum([sum(p.num_real_tokens for step in packs for p in step)])[0])
        return result

    def _sample_mean(self, values: list[list[torch.Tensor | None]], packs: list[list[Pack]]) -> float:
        """Mean over the global batch's samples of each sample's masked mean (slime's rollout/log_probs)."""
        means, missing = [], 0
        for step_values, step_packs in zip(values, packs):
            for v, p in zip(step_values, step_packs):
                if v is None:
                    missing = 1
                    continue
                for vs, ms in zip(torch.split(v, p.response_lengths), torch.split(p.loss_mask, p.response_lengths)):
                    means.append(float((vs * ms).sum() / ms.sum().clamp(min=1)))
        total, count, missing = self.reduce.sum([float(np.sum(means)) if means else 0.0, len(means), missing])
        return float("nan") if missing or not count else total / count

    # ------------------------------------------------------------------ advantages
    def compute_advantages(self, packs: list[list[Pack]], old: StepTensors | None = None,
                           ref: StepTensors | None = None) -> tuple[StepTensors, dict[str, float]]:
        """Token-level advantages of every pack, after the model passes (`token_advantages`).

        The rank's samples are laid end to end in (optimizer step, sample id) order, the order of the batch
        (so one rank computes exactly what the whole batch gives in one call), the estimator's token half runs
        per sample, whitening spans the global batch (`self.reduce`). `old` / `ref` are read only when the
        estimator needs them (KL-in-reward). Returns `[step][micro-batch] -> [R]` float32 and the global
        `rollout/advantages` (mean over trained tokens). With a critic use `advantages_and_returns`.
        """
        adv, _, metrics = self.advantages_and_returns(packs, old, ref)
        return adv, metrics

    def advantages_and_returns(self, packs: list[list[Pack]], old: StepTensors | None = None,
                               ref: StepTensors | None = None, values: StepTensors | None = None, *,
                               kl_coef: float | None = None
                               ) -> tuple[StepTensors, StepTensors | None, dict[str, float]]:
        """`compute_advantages`, and with a critic (`values`: its V_old, `CriticStep.compute_values`) the returns it
        is trained on: G = A + V_old on trained tokens (0 elsewhere) from the raw GAE advantages A, which are then
        whitened over the global batch when `normalize_advantages`. Returns `(advantages, returns | None,
        metrics)`; with a critic the metrics add the global `critic/values_mean` and `critic/returns_mean`.

        KL-in-reward (`kl_coef` of the config != 0): β = `kl_coef` (the loop's KL controller's value; None: the
        config's), and the metrics add `rollout/kl_coef` (β) and `rollout/reward_kl`, the global
        `kl_control.mean_sequence_kl` of this batch (what an adaptive controller is updated with)."""
        if (values is None) != (self.critic is None):
            raise ValueError(f"advantage_estimator={self.loss_cfg.advantage_estimator!r} with values "
                             f"{'given' if values is not None else 'missing'}: GAE needs the critic's values "
                             "(compute_values) and the other estimators read none")
        seqs = []  # (step, sample id) -> (micro-batch i, sequence j within it, response length)
        for s, step in enumerate(packs):
            for i, p in enumerate(step):
                seqs += [((s, sid), i, j, n) for j, (sid, n) in enumerate(zip(p.sample_ids, p.response_lengths))]
        seqs.sort(key=lambda x: x[0])

        def laid_out(values: StepTensors) -> torch.Tensor:  # [R] of this rank, in batch order
            split = [[list(torch.split(v, p.response_lengths)) for v, p in zip(vs, step)]
                     for vs, step in zip(values, packs)]
            parts = [split[s][i][j] for (s, _), i, j, _ in seqs]
            return torch.cat(parts) if parts else torch.zeros(0)

        lengths = [n for *_, n in seqs]
        mask = laid_out([[p.loss_mask for p in step] for step in packs])
        needs_kl = self.loss_cfg.kl_coef != 0
        if needs_kl and (old is None or ref is None or any(o is None for o in old)):
            raise ValueError("KL-in-reward needs the old and ref log-probs of every step before the advantages; "
                             "run compute_log_probs(packs) (without first_from_forward) first")
        kw = dict(old_log_probs=laid_out(old) if needs_kl else None, ref_log_probs=laid_out(ref) if needs_kl else None)
        if needs_kl:
            kw["kl_coef"] = kl_coef
        base = laid_out([[p.advantages for p in step] for step in packs])
        if values is None:
            adv, returns = token_advantages(self.loss_cfg, base, lengths, mask, **kw, reduce_sum=self.reduce.sum), None
        else:  # the returns: A + V before the whitening (the value loss's targets), 0 on untrained tokens
            adv, returns = token_advantages_and_returns(self.loss_cfg, base, lengths, mask, **kw,
                                                        values=laid_out(values).to(base.dtype),
                                                        reduce_sum=self.reduce.sum)
            returns = torch.where(mask != 0, returns, torch.zeros((), dtype=returns.dtype))
        total, count = self.reduce.sum([float((adv * mask).sum()), float(mask.sum())])
        mean = float(torch.tensor(total, dtype=adv.dtype) / torch.tensor(count, dtype=adv.dtype).clamp(min=1))

        def per_pack(flat: torch.Tensor, fill) -> StepTensors:  # batch order -> [step][micro-batch] -> [R]
            per_seq = dict(zip([(s, i, j) for (s, _), i, j, _ in seqs], torch.split(flat, lengths)))
            return [[torch.cat([per_seq[(s, i, j)] for j in range(p.num_sequences)]) if p.num_sequences
                     else fill(p) for i, p in enumerate(step)] for s, step in enumerate(packs)]

        out = per_pack(adv, lambda p: p.advantages.clone())
        metrics = {"rollout/advantages": mean}
        if needs_kl:
            kl = reward_kl(self.loss_cfg, kw["old_log_probs"], kw["ref_log_probs"], mask)
            metrics |= {"rollout/kl_coef": self.loss_cfg.kl_coef if kl_coef is None else float(kl_coef),
                        "rollout/reward_kl": mean_sequence_kl(kl, lengths, mask, reduce_sum=self.reduce.sum)}
        if returns is not None:
            returns = per_pack(returns, lambda p: torch.zeros_like(p.loss_mask, dtype=torch.float32))
            metrics |= {"critic/values_mean": token_mean_global(values, packs, self.reduce),
                        "critic/returns_mean": token_mean_global(returns, packs, self.reduce)}
        return out, returns, metrics

    # ------------------------------------------------------------------ critic
    def compute_values(self, packs: list[list[Pack]]) -> tuple[StepTensors, dict[str, float]]:
        """The critic's values V_old of every pack (`CriticStep.compute_values`), after the log-probs."""
        return self._need_critic().compute_values(packs)

    def train_critic(self, packs: list[list[Pack]], values: StepTensors, returns: StepTensors,
                     progress: TrainProgress | None = None) -> dict[str, float]:
        """One critic optimizer step per global batch (`CriticStep.train`), resumable through
        `progress.critic_steps`; `critic/*` metrics."""
        progress = TrainProgress() if progress is None else progress
        return self._need_critic().train(packs, values, returns, progress.critic_steps)

    def _need_critic(self) -> CriticStep:
        if self.critic is None:
            raise ValueError(f"advantage_estimator={self.loss_cfg.advantage_estimator!r} trains no critic; use "
                             "advantage_estimator='gae' for PPO with a critic")
        return self.critic

    # ------------------------------------------------------------------ train
    def loss_inputs(self, packs: list[Pack], old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None,
                    adv: list[torch.Tensor] | None = None, *, old_from_forward: bool = False) -> list:
        """Loss inputs of one optimizer step's micro-batches, normalised by the counts of the whole global batch
        (all ranks) and with DP-summed IS batch stats; `adv` per micro-batch (None: the packs' `advantages`);
        `old_from_forward`: π_old = the training forward."""
        mbs = [
            ResponseBatch(
                loss_mask=p.loss_mask, advantages=p.advantages if adv is None else adv[i],
                response_lengths=list(p.response_lengths),
                old_log_probs=old[i] if old is not None else None, rollout_log_probs=p.rollout_log_probs,
                ref_log_probs=ref[i] if ref is not None else None,
            )
            for i, p in enumerate(packs)
        ]
        local = global_norm(self.loss_cfg, mbs)
        n_samples, n_tokens, n_nonempty = self.reduce.sum([local.n_samples, local.n_tokens, local.n_nonempty])
        norm = GlobalNorm(int(round(n_samples)), n_tokens, local.constant, int(round(n_nonempty)))
        if old_from_forward:
            return build_loss_inputs(self.loss_cfg, mbs, norm=norm, old_from_forward=True)
        stats = is_batch_stats(self.loss_cfg, mbs)
        if stats is not None:
            stats = torch.tensor(self.reduce.sum(stats.double().tolist()), dtype=stats.dtype)
        return build_loss_inputs(self.loss_cfg, mbs, norm=norm, batch_stats=stats)

    def train(self, packs: list[list[Pack]], old: StepTensors | None, ref: StepTensors | None,
              adv: StepTensors | None = None, progress: TrainProgress | None = None) -> dict[str, float]:
        """`backend.train` once per optimizer step; `train/*` averaged over the steps (the backend's are global).

        `adv`: the token-level advantages of `compute_advantages`; None trains on the packs' `advantages` as
        they are (packs built with final per-token advantages).

        `train/first_mb_kl_vs_rollout` is mean |log π_θ − log π_rollout| over the trained tokens of every rank's
        very first micro-batch, from the first optimizer step's training forward (before any update) against the
        engine's log-probs of the same tokens: 0.0 exactly when the trainer reproduces the engine bitwise (true
        on-policy mode), NaN when the samples carry no rollout log-probs. `perf/compiles`: graphs torch.compile
        built in this process since the previous call (since construction for the first).

        `progress` (resumable): the optimizer steps already finished are skipped, each finished one is recorded
        as it completes; a `backend.train` call and its record run with SIGINT held back except between
        micro-batches, so after a KeyboardInterrupt `progress` says exactly which updates were applied.

        A None `old` (or `old[0]`) with `old_from_forward`: the first step's π_old is its training forward; the
        values are written into `old[0]` (when `old` is a list) and `rollout/log_probs` is reported from them.
        """
        progress = TrainProgress() if progress is None else progress
        first_mb: list[torch.Tensor] = []  # [Σ|log π_θ − log π_rollout|, trained tokens] of the first micro-batch
        forward_old: list[torch.Tensor] = []
        if old is None and not self.loss_cfg.use_rollout_logprobs and self.old_from_forward and len(packs) == 1:
            old = [None]
        if old is not None and old[0] is None and not self.old_from_forward:
            raise ValueError("old log-probs of the first step are missing and this loss needs them before "
                             "training (bypass, batch-normalised MIS or KL-in-reward): run compute_log_probs(packs) "
                             "first")

        def loss_fn(logp, entropy, inputs):
            # Kept on the device and read after the optimizer step: a host read here would make the host wait for
            # every micro-batch's forward before it could queue the backward.
            if inputs.old_from_forward:
                forward_old.append(logp.detach())
            if not per_step and not first_mb and inputs.rollout_log_probs is not None:
                first_mb.extend(rollout_gap(logp.detach(), inputs.rollout_log_probs, inputs.loss_mask))
            return self.loss(logp, entropy, inputs)

        per_step = progress.per_step
        for s in range(len(per_step), len(packs)):
            step_packs = packs[s]
            step_old = old[s] if old is not None else None
            from_forward = old is not None and step_old is None
            if from_forward and s > 0:
                raise ValueError(f"old log-probs of optimizer step {s} are missing after the policy changed; "
                                 "run compute_log_probs(packs) before train")
            inputs = self.loss_inputs(step_packs, step_old, ref[s] if ref is not None else None,
                                      adv[s] if adv is not None else None, old_from_forward=from_forward)
            del first_mb[:], forward_old[:]
            with defer_sigint():  # an interrupt lands between micro-batches (raise_if_interrupted) or after the record
                done = self.backend.train(step_packs, inputs, loss_fn=loss_fn)
                if s == 0:  # no rollout log-probs: a custom rollout's samples (an empty pack has no samples)
                    missing = any(p.num_sequences and p.rollout_log_probs is None for p in step_packs)
                    progress.first_mb = (*(float(v) for v in first_mb), float(missing)) if first_mb else (0, 0, float(missing))
                if from_forward:
                    old[s], progress.old_from_forward = [t.cpu() for t in forward_old], True
                per_step.append(done)
        metrics = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
        metrics["train/step"] = per_step[-1]["train/step"]
        metrics["perf/train_time"] = float(sum(m["perf/train_time"] for m in per_step))
        metrics["train/optimizer_steps"] = float(len(per_step))
        gap, tokens, missing = self.reduce.sum(progress.first_mb or (0.0, 0.0, 1.0))
        metrics["train/first_mb_kl_vs_rollout"] = float("nan") if missing else gap / max(tokens, 1.0)
        graphs = _dynamo_graphs()  # 0 in a steady state: nothing recompiles (bucketed pack lengths)
        metrics["perf/compiles"], self._graphs = float(max(0, graphs - self._graphs)), graphs
        if progress.old_from_forward:  # what compute_log_probs did not report (every rank takes this branch)
            metrics["rollout/log_probs"] = self._sample_mean(old, packs)
        return metrics


def token_mean(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
    """Mean of per-sample `[R_i]` values over their trained tokens, laid end to end in the given order (one
    float32 sum, what `compute_advantages` reports at one rank): for a driver that gathered the samples' values
    from N ranks and reports the one-process number."""
    x, m = (torch.cat(list(v)) if len(v) else torch.zeros(0) for v in (values, masks))
    return float((x * m).sum() / m.sum().clamp(min=1))


def rollout_gap(logp: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor) -> list[torch.Tensor]:
    """`[Σ |logp − rollout| over the trained tokens, their count]` (0-dim, on `logp`'s device): the masked tokens'
    values (a −inf log-prob of a pad) never enter."""
    on = loss_mask != 0
    gap = torch.where(on, (logp - rollout.to(logp.dtype)).abs(), torch.zeros((), dtype=logp.dtype, device=logp.device))
    return [gap.sum(), on.sum().to(logp.dtype)]


def _dynamo_graphs() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far: decoder layers, flex_attention, a
    compiled engine's decode step. 0 while dynamo was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0
