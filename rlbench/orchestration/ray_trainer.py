"""`RayTrainer`: the `rlbench.Trainer` loop with its process-bound sub-steps running on Ray actors.

    cfg = rlbench.presets.cpu_test(model="tiny")
    trainer = RayTrainer(cfg, cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=2))
    trainer.step()          # same loop, same metric keys; trainer ranks and engines are Ray actors

The driver keeps everything light: the prompt dataset, the rollout manager (its engine is an `EngineGroup`
that splits prompts over the engine actors), scoring (rewards, per-sample scalars), metrics and checkpoint
bookkeeping. The heavy parts are fanned out: `pack` splits each global batch by DP rank (balanced) and
`ray.put`s one shard per rank; `compute_log_probs` / `compute_advantages` / `train_step` run collectively on the
trainer ranks (the same `RankStep` stages as one process); `sync_weights` pushes trainer -> engines directly
(CUDA IPC colocated, broadcast group disaggregated).

Async (`cluster.async_rollout`, disaggregated only): `rollout()` returns the batch generated during the
previous step and immediately starts the next generation on a driver thread, so generation of rollout
r+1 overlaps training on rollout r; `sync_weights()` first waits for that generation (weights never
change mid-generation). Every sample records `metadata["staleness"]` (= policy updates since the weights
that generated it: 0 synchronous, one rollout's optimizer steps async); `rollout/staleness_*` summarise it. TIS/MIS (`LossConfig`)
correct for the off-policy gap exactly as in a synchronous run.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import torch

from rlbench.configs.cluster import ClusterConfig, check_batch_layout
from rlbench.orchestration.local import build_data, build_rollouts
from rlbench.orchestration.ray_cluster import RayCluster, max_merge
from rlbench.orchestration.ray_dp import split_steps_by_dp
from rlbench.rank_step import token_mean
from rlbench.rollout.manager import RolloutBatch
from rlbench.trainer import Components, Trainer, prepare_run


def build_ray_components(cfg, cluster: ClusterConfig) -> tuple[Components, RayCluster]:
    """Driver-side data (tokenizer, prompts, eval items) and rollout manager, plus the Ray actors standing in for
    backend, engine and weight sync. The driver is seeded (`prepare_run`) once the actors are up."""
    tokenizer, dataset, eval_items = build_data(cfg)
    ray_cluster = RayCluster(cfg, cluster, tokenizer)
    try:
        prepare_run(cfg)
        engine = ray_cluster.engine_group()
        parts = Components(tokenizer, dataset, eval_items, ray_cluster.train_group(), engine,
                           build_rollouts(cfg, engine, dataset, tokenizer), ray_cluster.weight_group(),
                           torch.device("cpu"), ray_cluster.num_params)
    except BaseException:
        ray_cluster.shutdown()
        raise
    return parts, ray_cluster


class RayTrainer(Trainer):
    """`Trainer` whose backend and engine are Ray actors (see the module docstring).

    Args:
        cfg: the run config (`cfg.cluster` is used when present).
        cluster: overrides `cfg.cluster`; must have backend "ray".
        components: must be None (the actors are built here); accepted so `build_trainer(cfg, components=...)`
            fails with a clear error.
        sinks: metric sinks (default from `cfg.logging`).
    """

    def __init__(self, cfg, *, cluster: ClusterConfig | None = None, components=None, sinks=None) -> None:
        cluster = cluster or getattr(cfg, "cluster", None) or ClusterConfig(backend="ray")
        if cluster.backend != "ray":
            raise ValueError(f"RayTrainer needs cluster.backend='ray', got {cluster.backend!r}")
        self.dp_size = check_batch_layout(cfg, cluster)
        self.cluster_cfg = cluster
        self.async_rollout = cluster.async_rollout
        self._packed: RolloutBatch | None = None
        self._fit_target: int | None = None  # fit()'s last rollout: no generation is started beyond it
        self._log_probs_of: RolloutBatch | None = None  # the batch whose log-probs the ranks hold
        self._values_of: RolloutBatch | None = None  # ... whose critic values
        self._advantages_of: RolloutBatch | None = None  # ... and whose advantages
        self._pending: concurrent.futures.Future | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbench-rollout")
        if components is not None:
            raise ValueError("RayTrainer builds its components on Ray actors; do not pass components= (use backend 'local')")
        components, self.cluster = build_ray_components(cfg, cluster)
        try:
            super().__init__(cfg, components, sinks=sinks)
        except BaseException:
            self.cluster.shutdown()
            raise
        offload = cfg.offload if cfg.offload is not None else cfg.backend.device == "cuda"
        self.offload = offload and cluster.colocate  # disaggregated engines never share a device

    def _plan_memory(self):
        """None: the actors hold the models; offload follows `cfg.offload` (None: on for colocated CUDA ranks)."""
        return None

    def fit(self, num_rollout: int | None = None) -> list[dict]:
        """`Trainer.fit`; async mode generates nothing past the last rollout of this call."""
        self._fit_target = self.cfg.batch.num_rollout if num_rollout is None else num_rollout
        try:
            return super().fit(num_rollout)
        finally:
            self._fit_target = None

    # ------------------------------------------------------------------ sub-steps on the actors
    def rollout(self) -> RolloutBatch:
        """This step's batch; in async mode the one generated during the last step, and the next one is started."""
        self._enter("rollout")
        batch = self._take_pending() if self._pending is not None else self.rollouts.generate(self.rollout_id)
        last = self._fit_target if self._fit_target is not None else self.cfg.batch.num_rollout
        if self.async_rollout and self.rollout_id + 1 < last:
            self._pending = self._pool.submit(self.rollouts.generate, self.rollout_id + 1)
        batch.metrics |= self._staleness(batch)
        self.last_rollout = batch
        return batch

    def pack(self, batch: RolloutBatch) -> list[dict]:
        """Split each global batch over the DP ranks (balanced), `ray.put` one shard per rank, pack on the ranks.

        Returns (and sets `batch.packs` to) one summary per rank: micro-batches per optimizer step, tokens.
        The packs themselves live on the trainer ranks.
        """
        b = self.cfg.batch
        shards = split_steps_by_dp(batch.samples, b.global_batch_size, self.dp_size, b.balance_data)
        ranks = [shards[dp] for dp in self.cluster.dp_ranks]
        batch.packs = self.cluster.call_trainers_with_shards("pack", self.cluster.put_shards(ranks))
        self._packed, self._log_probs_of, self._values_of, self._advantages_of = batch, None, None, None
        return batch.packs

    def compute_log_probs(self, batch: RolloutBatch, *, first_from_forward: bool = False) -> dict[str, float]:
        """Old (and ref) log-probs on every rank; returns the same `rollout/*log_probs` means as one process
        (`first_from_forward`: as `Trainer.compute_log_probs`)."""
        self._enter("train")
        if self._packed is not batch:
            self.pack(batch)
        per_rank = self.cluster.call_trainers("compute_log_probs", first_from_forward)  # rollout/* global on every rank
        out = dict(per_rank[0]) | {k: v for k, v in max_merge(per_rank).items() if k.startswith("perf/")}
        self._log_probs_of, self._advantages_of = batch, None  # the log-probs themselves stay on the trainer ranks
        return out

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Token-level advantages on every rank (kept there); returns the global `rollout/advantages`."""
        self._enter("train")
        if self._log_probs_of is not batch:
            self.compute_log_probs(batch)
        if self.has_critic and self._values_of is not batch:
            self.compute_values(batch)
        per_rank = self.cluster.call_trainers("compute_advantages", self.kl_coef_now())
        self._advantages_of = batch
        per_sample = {k: v for _, values in per_rank for k, v in values.items()}
        adv = [per_sample[s.index] for s in batch.samples]  # in batch order: the one-process float32 sum
        masks = [torch.tensor(s.loss_mask[: len(a)], dtype=torch.float32) for s, a in zip(batch.samples, adv)]
        return dict(per_rank[0][0]) | {"rollout/advantages": token_mean(adv, masks)}

    def compute_values(self, batch: RolloutBatch) -> dict[str, float]:
        """The critic's values on every rank (kept there); `perf/*` of the slowest rank."""
        self._enter("train")
        if self._packed is not batch:
            self.pack(batch)
        per_rank = self.cluster.call_trainers("compute_values")
        self._values_of, self._advantages_of = batch, None
        return {k: v for k, v in max_merge(per_rank).items() if k.startswith("perf/")}

    def train_critic(self, batch: RolloutBatch, progress=None) -> dict[str, float]:
        """One critic optimizer step per global batch on every rank; `critic/*` global, `perf/*` the slowest's."""
        self._enter("train")
        if self._advantages_of is not batch:
            self.compute_advantages(batch)
        per_rank = self.cluster.call_trainers("train_critic")
        return dict(per_rank[0]) | {k: v for k, v in max_merge(per_rank).items() if k.startswith("perf/")}

    def train_actor(self, batch: RolloutBatch, progress=None) -> dict[str, float]:
        """One optimizer step per global batch on every rank; `train/*` are global, `perf/*` the slowest rank's.

        `policy_version` goes up by the optimizer steps applied. `progress` is not used: on Ray an interrupted
        driver does not stop the ranks' call (docs/reliability.md)."""
        self._enter("train")
        if self._advantages_of is not batch:
            self.compute_advantages(batch)
        per_rank = self.cluster.call_trainers("train")
        metrics = dict(per_rank[0]) | {k: v for k, v in max_merge(per_rank).items() if k.startswith("perf/")}
        self.policy_version += round(metrics["train/optimizer_steps"] * (1.0 - metrics["train/skipped"]))
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Push trainer weights into every engine, stamped `policy_version`. Async: waits for the running generation."""
        self._drain()
        if self.async_rollout and (self.rollout_id + 1) % self.cluster_cfg.update_weights_interval:
            self._enter("train")
            return {}  # async with --update-weights-interval: not this step (counted in rollouts)
        return super().sync_weights()

    def evaluate(self) -> dict[str, float]:
        self._drain()
        return super().evaluate()

    def close(self) -> None:
        """Stop the rollout thread, kill the actors, remove the placement group, close the sinks."""
        if self._pending is not None:
            self._pending.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cluster.shutdown()
        super().close()

    # ------------------------------------------------------------------ async helpers
    def _take_pending(self) -> RolloutBatch:
        self._drain()
        batch, self._pending = self._pending.result(), None
        return batch

    def _drain(self) -> None:
        """Wait (at most `cluster.timeout_s`) for the generation started by the last `rollout()`."""
        if self._pending is None:
            return
        done, _ = concurrent.futures.wait([self._pending], timeout=self.cluster_cfg.timeout_s)
        if not done:
            raise RuntimeError(
                f"async rollout {self.rollout_id + 1} did not finish within timeout_s={self.cluster_cfg.timeout_s:g}s "
                "(a dead or hung engine?); call trainer.close() and restart"
            )
        self._pending.result()  # re-raise a generation error here, on the driver's main thread

    def _staleness(self, batch: RolloutBatch) -> dict[str, float]:
        """Per-sample policy lag (updates since the generating weights) into metadata, summarised."""
        lags = []
        for s in batch.samples:
            s.metadata["staleness"] = self.policy_version - s.weight_version
            lags.append(s.metadata["staleness"])
        return {"rollout/staleness_mean": float(np.mean(lags)), "rollout/staleness_max": float(max(lags))}

