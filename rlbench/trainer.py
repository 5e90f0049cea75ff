"""The RL loop: `Trainer.step()` = rollout -> score -> pack -> model passes -> advantages -> train -> sync weights.

    trainer = rlbench.Trainer(rlbench.presets.cpu_demo())  # the parts built by rlbench.orchestration.local
    batch = trainer.rollout()            # RolloutBatch: samples with rewards, rollout/* metrics
    trainer.score(batch)                 # rewards, and one scalar per sample (group statistics for GRPO)
    packs = trainer.pack(batch)          # [optimizer step][micro-batch] -> Pack
    trainer.compute_log_probs(batch)     # the model passes: old (and ref) log-probs per pack
    trainer.compute_advantages(batch)    # token-level advantages (REINFORCE++ returns, whitening) per pack
    trainer.train_step(batch)            # one optimizer step per global batch
    trainer.sync_weights()               # trainer -> engine, new policy version
    trainer.step()                       # all of the above + eval/save when due, logged to history

Every sub-step can be called alone and returns something inspectable. The Trainer takes its parts built
(`Components`: a builder in `rlbench.orchestration` makes them) and uses the backend, the engine, the rollout
manager and the weight sync only through their protocols; it never asks what kind they are, and it reaches
checkpoints only through the backend (`committed_steps`, `latest_step`, `committed_file`). pack / model passes
/ advantages / train are `rlbench.rank_step.RankStep` at one rank (the Ray ranks run the same class, with
all-reduces instead of the identity). Colocated with `offload`, the trainer state and the engine's KV cache take
turns on the device: `_enter("rollout")` / `_enter("train")` switch between them.

`step()` runs `Trainer.stages()` in order, each a method of the Trainer. PPO with a critic (`rlbench.critic_loop`,
a mixin) adds the critic's values to the model passes, its returns to the advantages and its update before the
actor's to the train stage.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbench.algorithms import sample_advantages
from rlbench.compile_cache import compile_seconds, use_compile_cache
from rlbench.configs import RunConfig
from rlbench.critic_loop import CriticLoop
from rlbench.interrupts import defer_sigint
from rlbench.loop_state import (
    LOOP_STATE,
    find_checkpoint,
    point_backend_at,
    rng_state,
    seed_everything,
    set_rng_state,
)
from rlbench.memory_plan import memory_plan
from rlbench.memory_start import measured_gap
from rlbench.metrics import MetricsLogger, build_sinks, to_floats
from rlbench.models.capabilities import check_run
from rlbench.rank_step import RankStep, TrainProgress
from rlbench.rewards import check_reward, describe_sample, get_reward_fn, score_batch
from rlbench.rollout.manager import RolloutBatch

# bf16 dense peak FLOP/s per GPU, for perf/mfu (absent on other devices).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}


@dataclass
class Components:
    """The built parts a `Trainer` runs (each implements its protocol; any of them can be swapped for a fake)."""

    tokenizer: Any
    """Tokenizer of the policy (eos = stop token, pad = pack padding)."""
    dataset: Any
    """Training prompts (`next_batch(n)`, `state_dict()`, `load_state_dict()`)."""
    eval_items: list
    """Held-out `PromptItem`s (empty when eval is off)."""
    backend: Any
    """A TrainBackend, already `init()`-ed."""
    engine: Any
    """A RolloutEngine (its weights are overwritten by the first sync)."""
    rollouts: Any
    """The `RolloutManager` over `engine` and `dataset` (`generate`, `evaluate`, `state_dict`)."""
    weight_sync: Any
    """Pushes the backend's weights into the engine(s): `push(version) -> weights/* metrics`."""
    device: torch.device
    """The device both sides run on (the driver's CPU for Ray)."""
    num_params: int
    """Policy parameter count (for perf/mfu)."""
    start_plan: Any = None
    """The start-up memory plan that sized the run (`rlbench.memory_start.StartPlan`); None: none was made."""


def prepare_run(cfg: RunConfig) -> None:
    """What a builder does before it builds a model: seed the RNGs (the model's initialisation draws from them),
    use the compile cache, resolve `rm_type` (a bad "module:function" fails here, not after the build) and refuse
    a model whose architecture the run's engine, trainer or mode does not implement (`models.capabilities`)."""
    seed_everything(cfg.seed)
    use_compile_cache()
    get_reward_fn(cfg.rollout.rm_type)
    check_run(cfg)


class Trainer(CriticLoop):
    """One RL run over built components (see the module docstring).

    Args:
        cfg: the run config.
        components: the built parts (`rlbench.orchestration.local.build_components(cfg)`, or the Ray actors'
            stand-ins); `rlbench.Trainer(cfg)` / `rlbench.build_trainer(cfg)` build them and this Trainer.
        sinks: metric sinks; None builds them from `cfg.logging`.
    """

    def __init__(self, cfg: RunConfig, components: Components, *, sinks=None) -> None:
        if not isinstance(components, Components):
            raise TypeError(f"Trainer(cfg, components) takes built Components, got {type(components).__name__}; "
                            "rlbench.Trainer(cfg) or rlbench.build_trainer(cfg) builds them from the config")
        self.cfg = cfg
        self.tokenizer, self.backend, self.engine = components.tokenizer, components.backend, components.engine
        self.dataset, self.eval_items = components.dataset, components.eval_items
        self.rollouts, self.weight_sync = components.rollouts, components.weight_sync
        self.rank_step = RankStep(cfg.batch, cfg.loss, self.backend, cp_size=cfg.backend.cp_size,
                                  pad_token_id=self.tokenizer.pad_token_id)
        self.logger = MetricsLogger(build_sinks(cfg.logging, cfg.to_dict()) if sinks is None else sinks)
        self.device, self.num_params = components.device, components.num_params
        self.start_plan = components.start_plan
        self.memory_plan = self._plan_memory()
        self.offload = self._decide_offload()
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._compiled_s = compile_seconds()  # perf/compile_time counts from here
        self.last_rollout: RolloutBatch | None = None
        self.rollout_id = 0  # completed RL steps
        self.policy_version = 0  # optimizer steps applied so far: the version of the trainer's weights
        self.version = 0  # policy version held by the engine (set only after a complete sync)
        self._phase = "train"
        self._offload_s = 0.0  # this step's seconds in `_enter`'s sleep / wake_up (perf/offload_time)
        self._engine_stale = False  # a sync was interrupted: the engine may hold a mix; resynced before use
        self._inflight: _InFlight | None = None  # a step() interrupted after its first optimizer step
        self._eval_rollout_id: int | None = None  # step()'s eval runs for the rollout it is finishing
        self.skipped_streak = 0  # optimizer steps skipped in a row (non-finite loss / grad norm)
        self.init_kl_controller()  # KL-in-reward's β (rlbench.critic_loop)
        self.sync_weights()  # the engine always starts from the trainer's weights (version 0)
        if cfg.checkpoint.load_dir:
            self.load(cfg.checkpoint.load_dir)

    # ------------------------------------------------------------------ the loop
    def step(self) -> dict:
        """One RL step; returns (and appends to `history`) its flat metric dict.

        Transactional with respect to interrupts and errors (docs/reliability.md): a step stopped (Ctrl-C,
        an exception) before its first optimizer step finished is rolled back, as if it had never started;
        one stopped later is finished by the next `step()` call, which returns its metrics. Either way
        "interrupt, then step() again" trains bit for bit like one uninterrupted step().
        """
        fl = self._inflight
        if fl is None:
            _reset_peak_memory()
            fl = _InFlight(self._snapshot(), time.perf_counter(), {"rollout/id": float(self.rollout_id)})
            self._offload_s = 0.0
        try:
            return self._run(fl)
        except BaseException:
            if fl.progress.started:  # weights changed: keep the step, the next step() finishes it
                self._inflight = fl
            else:  # nothing trained yet: back to the state before the step
                self._restore(fl.snapshot)
                self._inflight = None
            raise

    def _run(self, fl: _InFlight) -> dict:
        """The stages of one step from `fl.stage` on (each recorded when done, so a resumed step skips it)."""
        stages = self.stages()
        start = 0 if fl.stage is None else [name for name, _ in stages].index(fl.stage)
        for name, run in stages[start:]:
            fl.stage = name
            run(fl)
        self._inflight = None
        return fl.metrics

    def stages(self) -> list[tuple[str, Callable[[_InFlight], None]]]:
        """`step()`'s stages in order: (name, bound method); each adds its metrics to `fl.metrics`.

        rollout = generate + rewards + one scalar per sample (group statistics); model_passes = pack + old/ref
        log-probs (+ the critic's values); advantages = the token-level half on the ranks, from the scalars and
        the passes (+ the critic's returns); train = the critic's update, then the actor's. Interrupts (docs/reliability.md): a step stopped before its first optimizer
        step finished is rolled back whole, whatever stage it was in; a later one resumes at the stage it was in.
        """
        return [("eval0", self._stage_eval0), ("rollout", self._stage_rollout),
                ("model_passes", self._stage_model_passes), ("advantages", self._stage_advantages),
                ("train", self._stage_train), ("ref", self._stage_ref), ("sync", self._stage_sync),
                ("eval", self._stage_eval), ("record", self._stage_record), ("save", self._stage_save)]

    def _stage_eval0(self, fl: _InFlight) -> None:
        if self.rollout_id == 0 and self._eval_on and not self.cfg.eval.skip_before_train and not self.eval_history:
            self.evaluate()  # the starting policy, kept in eval_history

    def _stage_rollout(self, fl: _InFlight) -> None:
        fl.batch = self.rollout()
        fl.metrics |= fl.batch.metrics | self._phase_peak("rollout")
        fl.metrics |= self.score(fl.batch)

    def _stage_model_passes(self, fl: _InFlight) -> None:
        self.pack(fl.batch)
        fl.metrics |= self.compute_log_probs(fl.batch, first_from_forward=True)
        if self.has_critic:
            fl.metrics |= self.compute_values(fl.batch)
        fl.metrics |= self._phase_peak("log_probs")

    def _stage_advantages(self, fl: _InFlight) -> None:
        fl.metrics |= self.compute_advantages(fl.batch)
        self.update_kl_controller(fl.metrics, len(fl.batch.samples))

    def _stage_train(self, fl: _InFlight) -> None:
        fl.metrics |= self.train_step(fl.batch, progress=fl.progress)
        fl.metrics |= self._phase_peak("train")

    def _stage_ref(self, fl: _InFlight) -> None:
        fl.metrics |= self.update_ref()

    def _stage_sync(self, fl: _InFlight) -> None:
        fl.metrics |= self.sync_weights()
        fl.metrics |= self._phase_peak("update_weights")

    def _stage_eval(self, fl: _InFlight) -> None:
        m = fl.metrics
        if self._eval_on and (self.rollout_id + 1) % self.cfg.eval.interval == 0:
            if fl.eval_mark is None:
                fl.eval_mark = len(self.eval_history)
            if len(self.eval_history) == fl.eval_mark:
                self._eval_rollout_id = self.rollout_id + 1  # the policy after this step
                try:
                    self.evaluate()  # appends to eval_history last: a rerun is never doubled
                finally:
                    self._eval_rollout_id = None
            m |= {k: v for k, v in self.eval_history[fl.eval_mark].items() if k.startswith(("eval/", "perf/"))}

    def _stage_record(self, fl: _InFlight) -> None:  # rollout_id and history change together
        m = fl.metrics
        with defer_sigint():
            self.rollout_id += 1
            m |= self._perf(fl.batch, m, time.perf_counter() - fl.start)
            self.history.append(m)
            # recorded before the sinks write: a failing sink (disk full) or the deferred SIGINT must not make a
            # resumed step record twice; a line the logger cannot write stays pending in it
            fl.stage = "save"
            self.logger.log(m, step=self.rollout_id)

    def _stage_save(self, fl: _InFlight) -> None:
        if self._save_due():
            self._inflight = None  # the loop state is complete: save() may write it
            try:
                self.save()
            except BaseException:
                self._inflight = fl
                raise

    def fit(self, num_rollout: int | None = None) -> list[dict]:
        """Run `step()` until `num_rollout` RL steps are done (default `cfg.batch.num_rollout`)."""
        target = self.cfg.batch.num_rollout if num_rollout is None else num_rollout
        if self.rollout_id >= target:
            resumed = f" (resumed from {self.cfg.checkpoint.load_dir})" if self.cfg.checkpoint.load_dir else ""
            warnings.warn(
                f"nothing to train: the run is at rollout {self.rollout_id}{resumed} and num_rollout={target}; "
                f"raise num_rollout (--num-rollout) above {self.rollout_id} to train further",
                UserWarning,
                stacklevel=2,
            )
        while self.rollout_id < target:
            self.step()
        return self.history

    # ------------------------------------------------------------------ sub-steps
    def rollout(self) -> RolloutBatch:
        """Generate and reward `rollout_batch_size` groups with the engine's current policy."""
        self._resync_if_stale()
        self._enter("rollout")
        batch = self.rollouts.generate(self.rollout_id)
        self.last_rollout = batch
        return batch

    def score(self, batch: RolloutBatch) -> dict[str, float]:
        """Rewards (for samples that have none), then one scalar per sample into `Sample.advantage`: the group
        statistics of the estimator (GRPO's normalised reward, RLOO's leave-one-out, ...; the raw reward for
        REINFORCE++), `rlbench.algorithms.sample_advantages`. The token-level advantages come after the model
        passes (`compute_advantages`). Returns `rollout/raw_reward`.
        """
        missing = [i for i, s in enumerate(batch.samples) if s.reward is None]
        scored = score_batch([batch.samples[i] for i in missing], rm_type=self.cfg.rollout.rm_type,
                             timeout=self.cfg.rollout.reward_timeout, indices=missing)
        for i, r in zip(missing, scored):
            batch.samples[i].reward = r
        scored_here = set(missing)  # score_batch checked these already
        for i, s in enumerate(batch.samples):  # rewards set elsewhere (a custom rollout) are checked too
            if i not in scored_here:
                s.reward = check_reward(s.reward, f"the reward of {describe_sample(s, i)} (rm_type={self.cfg.rollout.rm_type!r})")
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)  # [N]
        scalars = sample_advantages(self.cfg.loss, rewards, self.cfg.rollout.n_samples_per_prompt)  # [N]
        for s, a in zip(batch.samples, scalars.tolist()):
            s.advantage, s.token_advantages = a, None  # packing broadcasts the scalar over the response
        return {"rollout/raw_reward": float(rewards.mean())}

    def pack(self, batch: RolloutBatch) -> list[list]:
        """Cut the batch into optimizer steps of `global_batch_size` samples and pack each into micro-batches.

        Returns `batch.packs`: `[optimizer step][micro-batch] -> Pack` (`Pack.sample_ids` index the step's
        slice of `batch.samples`).
        """
        gbs = self.cfg.batch.global_batch_size
        steps = [batch.samples[start : start + gbs] for start in range(0, len(batch.samples), gbs)]
        batch.packs, batch.advantages, batch.values, batch.returns = self.rank_step.pack(steps), None, None, None
        return batch.packs

    def compute_log_probs(self, batch: RolloutBatch, *, first_from_forward: bool = False) -> dict[str, float]:
        """Old (actor) log-probs, and ref log-probs when the loss needs them, for every pack.

        Sets `batch.old_log_probs` / `batch.ref_log_probs` (`[step][micro-batch] -> [R]`, None when not
        computed: bypass mode has no recompute). Returns `perf/*_time` and `rollout/*log_probs` means.
        `first_from_forward` (what `step()` does): the first optimizer step's old log-probs are left to its
        training forward where the loss allows it (`RankStep.compute_log_probs`); `train_step` fills them in.
        """
        self._enter("train")
        if batch.packs is None:
            self.pack(batch)
        batch.old_log_probs, batch.ref_log_probs, metrics = self.rank_step.compute_log_probs(
            batch.packs, first_from_forward=first_from_forward)
        return metrics

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """The token-level advantages of every pack, from the scored scalars and the model passes
        (`RankStep.advantages_and_returns`: REINFORCE++ returns, GAE from the critic's values, KL-in-reward,
        whitening over the global batch).

        Sets `batch.advantages` (`[step][micro-batch] -> [R]`) and with a critic `batch.returns`; returns
        `rollout/advantages` (mean over trained tokens), with a critic `critic/values_mean`, `critic/returns_mean`.
        """
        self._enter("train")
        if batch.packs is None:
            self.pack(batch)
        if self.has_critic and batch.values is None:
            self.compute_values(batch)
        batch.advantages, batch.returns, metrics = self.rank_step.advantages_and_returns(
            batch.packs, batch.old_log_probs, batch.ref_log_probs, batch.values, kl_coef=self.kl_coef_now())
        return metrics

    def train_step(self, batch: RolloutBatch, progress: TrainProgress | None = None) -> dict[str, float]:
        """The train stage: with a critic its update first (`train_critic`: `critic/*`), then the actor's
        (`train_actor`: `train/*`), which the first `num_critic_only_steps` rollouts skip. `progress` resumes an
        interrupted call."""
        progress = TrainProgress() if progress is None else progress
        metrics = self.train_critic(batch, progress) if self.has_critic else {}
        return metrics if self.critic_only() else metrics | self.train_actor(batch, progress)

    def train_actor(self, batch: RolloutBatch, progress: TrainProgress | None = None) -> dict[str, float]:
        """One actor optimizer step per packed global batch; returns `train/*` averaged over the steps.

        Runs the model passes and the advantages first when they have not run for these packs.
        `policy_version` goes up by one per optimizer step applied (a skipped non-finite step changes no
        weight and no version). `progress` resumes an interrupted call (`RankStep.train`, which also says what
        `train/first_mb_kl_vs_rollout` measures).
        """
        self._enter("train")
        if self.rank_step.needs_log_probs(batch.old_log_probs, batch.ref_log_probs):
            self.compute_log_probs(batch)
        if batch.advantages is None:
            self.compute_advantages(batch)
        progress = TrainProgress() if progress is None else progress
        version = self.policy_version - progress.applied  # the version before this call's first update
        try:
            metrics = self.rank_step.train(batch.packs, batch.old_log_probs, batch.ref_log_probs, batch.advantages,
                                           progress)
        finally:  # interrupted too: one version per optimizer step actually applied
            self.policy_version = version + progress.applied
        self._count_skipped(metrics)
        return metrics

    def update_ref(self) -> dict[str, float]:
        """Copy the actor into the reference model after every `ref_update_interval`-th rollout (slime's
        `--ref-update-interval`); every rank copies its own shards."""
        if not ref_update_due(self.cfg.backend.ref_update_interval, self.rollout_id):
            return {}
        return self.backend.update_ref()

    def sync_weights(self) -> dict[str, float]:
        """Push the trainer's weights into the engine, stamped with `policy_version` (optimizer steps so far).

        `version` changes only after the whole push succeeded; an interrupted or failed push marks the
        engine stale (it may hold a mix of old and new weights) and the next rollout / eval resyncs first.
        """
        self._enter("train")
        self._engine_stale = True
        metrics = self.weight_sync.push(self.policy_version)
        self.version, self._engine_stale = self.policy_version, False
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out `eval/*` of the engine's current policy; also appended to `eval_history`."""
        if not self.eval_items:
            raise ValueError("no eval prompts: set eval.interval (and eval.data_path or task) in the config")
        self._resync_if_stale()
        self._enter("rollout")
        metrics = self.rollouts.evaluate(self.eval_items, self.cfg.eval)
        rid = self.rollout_id if self._eval_rollout_id is None else self._eval_rollout_id
        self.eval_history.append({"rollout/id": float(rid), "weights/version": float(self.version)} | metrics)
        return metrics

    # ------------------------------------------------------------------ state
    def save(self, path: str | None = None) -> str:
        """Checkpoint model, optimizer, scheduler (backend) and loop state (data position, RNG, history)."""
        path = path or self.cfg.checkpoint.save_dir
        if path is None:
            raise ValueError("save() needs a path or cfg.checkpoint.save_dir (--save DIR)")
        if self._inflight is not None:
            raise RuntimeError(f"step {self.rollout_id} was interrupted after it changed the weights; call step() "
                               "to finish it before save() (its loop state is not consistent yet)")
        self._enter("train")
        point_backend_at(self.backend, path)
        # one atomic commit: the loop state is written inside the backend's checkpoint before the rename
        self.backend.save(extra={LOOP_STATE: self.state_dict()})
        return path

    def load(self, path: str, rollout_id: int | None = None) -> int:
        """Resume from `save(path)`: the checkpoint the tracker names, or the committed one holding
        `rollout_id`; the engine gets the restored weights. Returns the restored `rollout_id`."""
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint directory {path!r} does not exist; pass the directory given to save()")
        point_backend_at(self.backend, path)
        step, state = find_checkpoint(self.backend, path, rollout_id)
        self._enter("train")
        self.backend.load(step)
        self.load_state_dict(state)
        self._inflight = None
        self.sync_weights()
        return self.rollout_id

    def state_dict(self) -> dict:
        """Loop state (the backend saves model/optimizer/scheduler itself)."""
        return {
            "rollout_id": self.rollout_id,
            "policy_version": self.policy_version,
            "dataset": self.dataset.state_dict(),
            "rollouts": self.rollouts.state_dict(),
            "history": list(self.history),
            "eval_history": list(self.eval_history),
            "rng": rng_state(),
        } | ({"kl_ctl": self.kl_ctl.state_dict()} if self.kl_ctl is not None else {})

    def load_state_dict(self, state: dict) -> None:
        self.rollout_id, self.policy_version = int(state["rollout_id"]), int(state["policy_version"])
        self.dataset.load_state_dict(state["dataset"])
        self.rollouts.load_state_dict(state["rollouts"])
        self.history, self.eval_history = list(state["history"]), list(state["eval_history"])
        set_rng_state(state["rng"])
        if self.kl_ctl is not None and "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])

    def close(self) -> None:
        """Flush the metric sinks and stop the reward worker processes."""
        self.logger.close()
        if self.rollouts.reward_pool is not None:
            self.rollouts.reward_pool.close()

    # ------------------------------------------------------------------ helpers
    def _snapshot(self) -> dict:
        """What a step changes before its first optimizer step (restored when it is stopped there)."""
        return {"dataset": copy.deepcopy(self.dataset.state_dict()), "rollouts": self.rollouts.state_dict(),
                "eval_history": len(self.eval_history), "last_rollout": self.last_rollout, "rng": rng_state(),
                "kl_ctl": self.kl_ctl.state_dict() if self.kl_ctl is not None else None}

    def _restore(self, snap: dict) -> None:
        self.dataset.load_state_dict(snap["dataset"])
        self.rollouts.load_state_dict(snap["rollouts"])
        del self.eval_history[snap["eval_history"]:]
        self.last_rollout = snap["last_rollout"]
        set_rng_state(snap["rng"])
        if snap["kl_ctl"] is not None:
            self.kl_ctl.load_state_dict(snap["kl_ctl"])

    def _resync_if_stale(self) -> None:
        if self._engine_stale:
            self.sync_weights()

    def _count_skipped(self, metrics: dict[str, float]) -> None:
        """Track optimizer steps skipped in a row (a rollout whose steps all skipped extends the streak, any
        applied step ends it) and warn once when the streak reaches `logging.warn_skipped_steps`."""
        n = int(metrics.get("train/optimizer_steps", 1))
        skipped = round(metrics.get("train/skipped", 0.0) * n)
        before = self.skipped_streak
        self.skipped_streak = before + n if skipped == n else 0
        limit = self.cfg.logging.warn_skipped_steps
        if limit and before < limit <= self.skipped_streak:
            warnings.warn(
                f"{self.skipped_streak} optimizer steps in a row were skipped (non-finite loss or grad norm, "
                "train/skipped): the weights have not changed since; check the loss inputs, lower the lr or "
                "use fp32 (param_dtype)",
                RuntimeWarning,
                stacklevel=3,
            )

    @property
    def _eval_on(self) -> bool:
        return self.cfg.eval.interval is not None and bool(self.eval_items)

    def _save_due(self) -> bool:
        c = self.cfg.checkpoint
        last = self.rollout_id == self.cfg.batch.num_rollout
        return c.save_interval is not None and (self.rollout_id % c.save_interval == 0 or last)

    def _plan_memory(self):
        """The colocated memory plan of this process's trainer and engine (`rlbench.memory_plan`; None: not
        measured, offload defaults to on for CUDA)."""
        start = self.start_plan
        if start is None or start.choice is None:
            return memory_plan(self.backend, self.engine, self.cfg, self.device)
        return memory_plan(self.backend, self.engine, self.cfg, self.device, logit_share=start.logit_share,
                           gathered=start.sizes["gathered"])

    def _decide_offload(self) -> bool:
        """`cfg.offload` (the user's, or the start-up plan's decision), checked against the measured plan: a
        decision the plan made (the user left it open) that the measured sizes show unsafe turns offload on; a
        large gap between the start-up estimate and the measurement is printed. Without either plan: the
        measured decision, or on for CUDA."""
        cfg, plan, start = self.cfg, self.memory_plan, self.start_plan
        console = cfg.logging.console and self.device.type == "cuda" and plan is not None
        offload = cfg.offload if cfg.offload is not None else (
            plan.offload if plan is not None else self.device.type == "cuda")
        why = "" if cfg.offload is None else f" (cfg.offload={cfg.offload} decides)"
        if start is not None and start.choice is not None and plan is not None:
            gap = measured_gap(start, plan)
            if gap and console:
                print(f"[rlbench] memory plan check: {gap}", flush=True)
            if "turns" in start.decided:
                why = f" (the start-up plan chose offload {'on' if offload else 'off'})"
                if plan.offload and not offload:
                    offload, why = True, " (the start-up plan chose offload off; measured, that is unsafe: on)"
                    warnings.warn(f"memory plan: offload turned on after all: {plan.reason}", RuntimeWarning,
                                  stacklevel=3)
        if console:
            print(f"[rlbench] {plan.summary()}{why}", flush=True)
        return offload

    def _enter(self, phase: str) -> None:
        """Colocated offload: only the active side (engine KV cache or trainer state) holds device memory."""
        if phase == self._phase:
            return
        t0 = time.perf_counter()
        if self.offload and phase == "train":
            self.engine.sleep()
            self.backend.wake_up()
        elif self.offload:
            self.backend.sleep()
            self.engine.wake_up()
        self._offload_s += time.perf_counter() - t0
        self._phase = phase

    def _phase_peak(self, phase: str) -> dict[str, float]:
        """`perf/{phase}_peak_memory_gb`: the most device memory allocated since the previous phase's reading
        (GiB; CUDA only, else {}); the peak counter starts again from the current allocation."""
        if self.device.type != "cuda":
            return {}
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return {f"perf/{phase}_peak_memory_gb": peak}

    def _perf(self, batch: RolloutBatch, m: dict, step_time: float) -> dict[str, float]:
        tokens = sum(s.total_length for s in batch.samples)
        out = {"perf/step_time": step_time, "perf/tokens_per_sec": tokens / step_time}
        if self.offload:  # colocated turns: trainer state and engine memory moved between host and device
            out["perf/offload_time"] = self._offload_s
        compiled, self._compiled_s = self._compiled_s, compile_seconds()
        out["perf/compile_time"] = self._compiled_s - compiled  # this process's compiles since the last step
        if self.device.type == "cuda":  # the step's peak: the phases' peaks and what came after the last one
            phases = [v for k, v in m.items() if k.endswith("_peak_memory_gb")]
            out["perf/peak_memory_gb"] = max([torch.cuda.max_memory_allocated(self.device) / 2**30, *phases])
            peak = next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(self.device)), None)
            busy = m.get("perf/train_time", 0.0) + m.get("perf/log_probs_time", 0.0) + m.get("perf/ref_log_probs_time", 0.0)
            if peak and busy > 0:
                out["perf/mfu"] = train_flops(self.num_params, tokens, m) / (busy * peak)
        return to_floats(out)


def train_flops(num_params: int, tokens: int, m: dict) -> float:
    """Model FLOPs of a step's train phases: 6N per trained token (forward + backward), 2N per token of each
    log-prob forward that ran (`perf/log_probs_tokens`, `perf/ref_log_probs_tokens` from `RankStep`: with π_old
    from the first step's training forward, only the later optimizer steps' tokens are recomputed)."""
    forward_tokens = m.get("perf/log_probs_tokens", 0.0) + m.get("perf/ref_log_probs_tokens", 0.0)
    return num_params * (6.0 * tokens + 2.0 * forward_tokens)


@dataclass
class _InFlight:
    """A step() in progress: the state to roll back to, and how far it got."""

    snapshot: dict
    start: float
    metrics: dict
    batch: RolloutBatch | None = None
    progress: TrainProgress = field(default_factory=TrainProgress)
    stage: str | None = None  # the stage it is in (None: not started)
    eval_mark: int | None = None  # len(eval_history) before this step's eval


def _reset_peak_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def ref_update_due(interval: int | None, rollout_id: int) -> bool:
    """slime's `--ref-update-interval`: the reference model takes the actor's weights after training rollouts
    N-1, 2N-1, ... (every N completed rollouts); never when `interval` is None."""
    return interval is not None and (rollout_id + 1) % interval == 0

