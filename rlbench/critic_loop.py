"""The loop's PPO pieces, a mixin of `rlbench.trainer.Trainer`: the critic's sub-steps (`advantage_estimator="gae"`)
and the KL-in-reward controller (`kl_coef` != 0, any estimator that shapes the reward).

    trainer.compute_log_probs(batch)     # old / ref log-probs (model_passes stage) ...
    trainer.compute_values(batch)        # ... then the critic's values V_old of the same packs
    trainer.compute_advantages(batch)    # GAE (KL-in-reward when kl_coef > 0) -> advantages and returns
    trainer.train_critic(batch)          # one critic optimizer step per global batch: critic/*
    trainer.train_step(batch)            # the critic, then the actor (not during num_critic_only_steps)

The rank-side work is `rlbench.rank_step.RankStep` (`compute_values`, `advantages_and_returns`, `train_critic`:
`rlbench.critic_step`), so the Ray ranks run the same code; `RayTrainer` overrides the two methods that call
the ranks. In `step()` the critic's updates count as optimizer steps for the interrupt guarantees: a step stopped
after a critic update finished is finished by the next `step()` (`TrainProgress.critic_steps`).

KL-in-reward: β of each step is the controller's value (`rlbench.algorithms.kl_control`: fixed, or adaptive
towards `kl_target`), passed to the ranks' advantages; `step()`'s advantages stage then updates the controller with
the batch's `rollout/reward_kl` over its samples (verl's order: β of this step, then the update). Its state is the
loop's: in `state_dict()` (checkpoints) and in the snapshot an interrupted step rolls back to.
"""

from __future__ import annotations

import math

from rlbench.algorithms.kl_control import build_kl_controller


class CriticLoop:
    """PPO-with-a-critic sub-steps of the Trainer (uses its `cfg`, `rank_step`, `rollout_id`, `pack`, `_enter`,
    `compute_advantages`)."""

    def init_kl_controller(self) -> None:
        """`kl_ctl`: the KL-in-reward controller (None without KL-in-reward)."""
        self.kl_ctl = build_kl_controller(self.cfg.loss) if self.cfg.loss.kl_coef != 0 else None

    def kl_coef_now(self) -> float | None:
        """β of KL-in-reward for the next advantages (None: no KL-in-reward)."""
        return self.kl_ctl.value if self.kl_ctl is not None else None

    def update_kl_controller(self, metrics: dict[str, float], n_samples: int) -> None:
        """After a step's advantages: the controller reads the batch's KL (`rollout/reward_kl`; a batch without
        trained tokens has none and leaves it as it is)."""
        kl = metrics.get("rollout/reward_kl", math.nan)
        if self.kl_ctl is not None and math.isfinite(kl):
            self.kl_ctl.update(kl, n_samples)

    @property
    def has_critic(self) -> bool:
        """Whether the run trains a critic (`LossConfig.needs_critic`: GAE)."""
        return self.cfg.loss.needs_critic

    def critic_only(self) -> bool:
        """Whether this rollout trains the critic alone (the first `critic.num_critic_only_steps` rollouts)."""
        return self.has_critic and self.rollout_id < self.cfg.backend.critic.num_critic_only_steps

    def compute_values(self, batch) -> dict[str, float]:
        """The critic's values V_old of every pack (`[step][micro-batch] -> [R]` into `batch.values`); the
        advantages and returns made from earlier values are dropped. Returns `perf/values_time`, `_tokens`."""
        self._enter("train")
        if batch.packs is None:
            self.pack(batch)
        batch.values, metrics = self.rank_step.compute_values(batch.packs)
        batch.advantages = batch.returns = None
        return metrics

    def train_critic(self, batch, progress=None) -> dict[str, float]:
        """One critic optimizer step per global batch on the returns of `compute_advantages` (run first when
        missing); `critic/*` averaged over the steps. `progress` resumes an interrupted call."""
        self._enter("train")
        if batch.returns is None:
            if self.rank_step.needs_log_probs(batch.old_log_probs, batch.ref_log_probs):
                self.compute_log_probs(batch)  # KL-in-reward needs every step's old and ref log-probs first
            self.compute_advantages(batch)
        return self.rank_step.train_critic(batch.packs, batch.values, batch.returns, progress)
