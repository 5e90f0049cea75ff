"""The critic's part of one rank's RL step (PPO with a value model), the same code at one process and at N ranks.

    critic = CriticStep(cfg.loss, backend, reduce)          # RankStep builds it when the run has a critic
    values, metrics = critic.compute_values(packs)         # V_old, [step][micro-batch] -> [R], after the log-probs
    adv, returns, m = rank_step.advantages_and_returns(packs, old, ref, values)   # GAE on the ranks
    metrics = critic.train(packs, values, returns, done)   # one critic optimizer step per global batch

The values are computed over the actor's packs (same micro-batches, same response space), by the backend's
critic (`compute_values` / `train_critic`, `rlbench.backends.fsdp.critic`). The value loss is
`rlbench.algorithms.value_loss` (½·max((V − G)², (clip(V, V_old ± value_clip) − G)²)) with the policy loss's
per-token weights (`loss_aggregation`) under the GLOBAL batch's counts (all ranks, `reduce`), so the critic's
gradient does not depend on how samples fall into micro-batches and ranks, as the actor's does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlbench.algorithms.aggregation import GlobalNorm, loss_token_weights
from rlbench.algorithms.value_loss import value_loss
from rlbench.interrupts import defer_sigint

StepTensors = list[list[torch.Tensor]]  # [optimizer step][micro-batch] -> [R]


@dataclass
class ValueInputs:
    """One micro-batch's value-loss inputs, in response space `[R]`."""

    old_values: torch.Tensor
    """`[R]` V_old: the critic's values the returns were computed with."""
    returns: torch.Tensor
    """`[R]` the regression targets G (GAE advantages + V_old on trained tokens)."""
    loss_mask: torch.Tensor
    """`[R]` 1 on trained tokens."""
    weights: torch.Tensor
    """`[R]` `loss_token_weights` under the global batch's counts."""
    metric_weights: torch.Tensor | None = None
    """`[R]` sample-mean weights of the metrics under `seq_sum_constant` (None: `weights`)."""


class CriticStep:
    """Values and the critic update of this rank's packs (collective over the backend's ranks).

    Args:
        loss: the algorithm config (`value_clip`, `loss_aggregation` and its constant).
        backend: this rank's TrainBackend with a critic (`compute_values`, `train_critic`).
        reduce: `SingleRank()` / `DPAllReduce(group)` (`rlbench.rank_step`).
    """

    def __init__(self, loss, backend, reduce) -> None:
        self.loss_cfg, self.backend, self.reduce = loss, backend, reduce

    def _critic_backend(self):
        """The backend, checked to have a critic (the Ray driver's stand-in has none and never calls these)."""
        if not hasattr(self.backend, "train_critic"):
            raise ValueError(f"{type(self.backend).__name__} has no critic; PPO with a critic (advantage_estimator="
                             "'gae') needs the FSDP backend built with TrainConfig.critic (build_backend does)")
        return self.backend

    def compute_values(self, packs) -> tuple[StepTensors, dict[str, float]]:
        """V_old of every pack, `[step][micro-batch] -> [R]`, and `perf/values_time`, `perf/values_tokens`."""
        start = time.perf_counter()
        values = [self._critic_backend().compute_values(step) for step in packs]
        tokens = self.reduce.sum([sum(p.num_real_tokens for step in packs for p in step)])[0]
        return values, {"perf/values_time": time.perf_counter() - start, "perf/values_tokens": float(tokens)}

    def value_inputs(self, packs, old_values, returns) -> list[ValueInputs]:
        """One optimizer step's `ValueInputs`, weighted by the counts of the whole global batch (all ranks)."""
        cfg = self.loss_cfg
        masks, lengths = [p.loss_mask for p in packs], [list(p.response_lengths) for p in packs]
        local = GlobalNorm.from_masks(masks, lengths, cfg.loss_aggregation_constant or 1.0)
        n_samples, n_tokens, n_nonempty = self.reduce.sum([local.n_samples, local.n_tokens, local.n_nonempty])
        norm = GlobalNorm(int(round(n_samples)), n_tokens, local.constant, int(round(n_nonempty)))
        out = []
        for p, v, g in zip(packs, old_values, returns):
            w = loss_token_weights(p.loss_mask, p.response_lengths, cfg.loss_aggregation, norm)
            mw = (loss_token_weights(p.loss_mask, p.response_lengths, "sample_mean", norm)
                  if cfg.loss_aggregation == "seq_sum_constant" else None)
            out.append(ValueInputs(v, g, p.loss_mask, w, mw))
        return out

    def loss(self, values: torch.Tensor, _entropy, inputs: ValueInputs):
        """The backend's `loss_fn` for the critic: `value_loss` of one micro-batch (a global weighted sum)."""
        return value_loss(values, inputs.old_values, inputs.returns, inputs.loss_mask, inputs.weights,
                          self.loss_cfg.value_clip, metric_weights=inputs.metric_weights)

    def train(self, packs, values: StepTensors, returns: StepTensors, done: list[dict] | None = None
              ) -> dict[str, float]:
        """One critic optimizer step per global batch; `critic/*` averaged over the steps (each global).

        `done` (resumable, like `TrainProgress.per_step`): the metrics of the steps already finished; those are
        skipped, and each step's `backend.train_critic` and its record run with SIGINT held back, so after a
        KeyboardInterrupt `done` says exactly which critic updates were applied.
        """
        done = [] if done is None else done
        for s in range(len(done), len(packs)):
            inputs = self.value_inputs(packs[s], values[s], returns[s])
            with defer_sigint():
                done.append(self._critic_backend().train_critic(packs[s], inputs, self.loss))
        metrics = {k: float(sum(m[k] for m in done) / len(done)) for k in done[0]}
        metrics["critic/step"] = done[-1]["critic/step"]
        metrics["perf/critic_train_time"] = float(sum(m["perf/critic_train_time"] for m in done))
        return metrics


def token_mean_global(values: StepTensors, packs, reduce) -> float:
    """Mean of `values` over the trained tokens of the global batch (every rank's packs), as one float."""
    total = sum(float((v * p.loss_mask).sum()) for vs, step in zip(values, packs) for v, p in zip(vs, step))
    count = sum(float(p.loss_mask.sum()) for step in packs for p in step)
    total, count = reduce.sum([total, count])
    return total / max(count, 1.0)
