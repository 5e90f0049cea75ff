"""The driver's view of a Ray run: placement group, trainer ranks, engines, weight-sync wiring, fan-out calls.

    cluster = RayCluster(cfg, ClusterConfig(backend="ray", actor_num_gpus_per_node=2))
    engine = cluster.engine_group()      # a RolloutEngine: generate() splits prompts over the engine actors
    backend = cluster.train_group()      # sleep / wake_up / save / load fanned out to every trainer rank
    sync = cluster.weight_group()        # push(version): the Trainer's weight sync
    cluster.sync_weights(version=1)      # trainer ranks -> engines (CUDA IPC or broadcast), timed
    cluster.shutdown()

Every wait goes through `gather` with `cluster.timeout_s`: a dead actor or a hung collective is a RuntimeError
naming the call and the actor, never a silent hang.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

from rlbench.backends.checkpoint import CommittedCheckpoints
from rlbench.configs.cluster import (
    ClusterConfig,
    check_engine_layout,
    placement_plan,
    weight_group_ranks,
)
from rlbench.orchestration.ray_placement import (
    NOSET_VISIBLE_DEVICES,
    create_placement,
    gather,
    import_ray,
    init_ray,
)
from rlbench.orchestration.ray_workers import EngineWorker, TrainWorker
from rlbench.weights import DTYPE_NAMES


class RayCluster:
    """Builds and owns every actor of a run (see the module docstring).

    Args:
        cfg: the RunConfig (shipped to every actor).
        cluster: devices and placement.
        tokenizer: the policy tokenizer (its pad id packs sequences; engines get a copy for stop strings).
    """

    def __init__(self, cfg, cluster: ClusterConfig, tokenizer) -> None:
        if cluster.backend != "ray":
            raise ValueError(f"RayCluster needs cluster.backend='ray', got {cluster.backend!r}")
        check_engine_layout(cfg, cluster)
        self.ray = import_ray()
        self.cfg, self.cluster = with_engine_weight_dtype(cfg), cluster
        init_ray(cluster)
        self.plan = placement_plan(cluster)
        self.placement = create_placement(self.plan, cfg.backend.device, cluster.timeout_s)
        self.trainers: list = []
        self.engines: list = []
        try:
            self._start_trainers(tokenizer.pad_token_id)
            self._start_engines(tokenizer)
            self._connect_weights()
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- start-up
    def _options(self, bundle: int, fraction: float, own_gpus_only: bool = False) -> dict:
        """Actor options pinning it to ordered bundle `bundle` with `fraction` of its GPUs (or CPU slots).

        `own_gpus_only`: the actor sees only the GPUs it reserved (Ray sets CUDA_VISIBLE_DEVICES), for an engine
        that places its own device processes on the visible GPUs (SGLang's TP ranks on devices 0..tp_size-1);
        every other actor sees all GPUs (`NOSET_VISIBLE_DEVICES`)."""
        amount = fraction * self.plan.bundle_gpus[bundle]
        opts = {"scheduling_strategy": self.placement.strategy(bundle), "max_concurrency": 1}
        if self.cfg.backend.device == "cuda":
            opts |= {"num_gpus": amount, "num_cpus": amount}
            if not own_gpus_only:
                opts["runtime_env"] = {"env_vars": dict(NOSET_VISIBLE_DEVICES)}
        else:
            opts |= {"num_cpus": amount}
        return opts

    def _start_trainers(self, pad_token_id: int) -> None:
        actor = self.ray.remote(TrainWorker)
        world, cwd = self.cluster.world_size, os.getcwd()
        self.trainers = [
            actor.options(**self._options(self.plan.train_bundles[r], self.plan.train_gpu_fraction)).remote(
                self.cfg, r, world, self.cluster, cwd
            )
            for r in range(world)
        ]
        addr, port = self.call_trainers("master_address", ranks=[0])[0]
        infos = self.call_trainers("init", addr, port, pad_token_id)
        self.num_params = int(infos[0]["num_params"])
        self.dp_ranks = [int(info["dp_rank"]) for info in infos]
        """Each trainer rank's DP rank: which shard of every batch it trains (CP / TP / PP peers share one)."""

    def _start_engines(self, tokenizer) -> None:
        actor = self.ray.remote(EngineWorker)
        cwd, own_gpus_only = os.getcwd(), self.cfg.rollout_engine == "sglang"  # SGLang starts its TP ranks itself
        self.engines = [
            actor.options(**self._options(b, self.plan.engine_gpu_fraction, own_gpus_only)).remote(
                self.cfg, e, self.cluster, cwd, tokenizer)
            for e, b in enumerate(self.plan.engine_bundles)
        ]
        self.call_engines("weight_version")  # wait until every engine is built

    def _connect_weights(self) -> None:
        """Colocated: rank r feeds the engine on its bundle. Disaggregated: rank 0 + every engine's TP ranks form a
        broadcast group (trainer rank 0 is its rank 0, engine e's ranks follow those of engines 0..e-1)."""
        if self.cluster.colocate:
            per = self.cluster.rollout_num_gpus_per_engine
            self._gather([t.connect_engines.remote([self.engines[r // per]]) for r, t in enumerate(self.trainers)],
                         "connect engines", self._trainer_names())
            return
        self._gather([self.trainers[0].connect_engines.remote(self.engines)], "connect engines", ["trainer rank 0"])
        host, port = self.call_trainers("master_address", ranks=[0])[0]
        sizes = self.call_engines("group_ranks")  # an engine takes one rank per TP rank
        placed = [self.plan.bundle_gpus[b] for b in self.plan.engine_bundles]
        if sizes != placed:
            raise RuntimeError(f"the engines take {sizes} weight-group ranks (their TP sizes) but were placed on "
                               f"{placed} GPUs; cluster.rollout_num_gpus_per_engine must equal the engine's GPU count")
        offsets, world = weight_group_ranks(sizes)
        refs = [self.trainers[0].init_weight_group.remote(host, port, world)]
        refs += [e.init_weight_group.remote(host, port, offsets[i], world) for i, e in enumerate(self.engines)]
        self._gather(refs, "weight-broadcast group rendezvous", ["trainer rank 0"] + self._engine_names())

    # ---------------------------------------------------------------- fan-out
    def _trainer_names(self, ranks: Sequence[int] | None = None) -> list[str]:
        return [f"trainer rank {r}" for r in (ranks if ranks is not None else range(len(self.trainers)))]

    def _engine_names(self) -> list[str]:
        return [f"engine {e}" for e in range(len(self.engines))]

    def _gather(self, refs, what: str, names: list[str]) -> list:
        return gather(refs, self.cluster.timeout_s, what, names)

    def call_trainers(self, method: str, *args, ranks: Sequence[int] | None = None) -> list:
        """`method(*args)` on every trainer rank (or `ranks`), results in rank order."""
        ranks = list(range(len(self.trainers))) if ranks is None else list(ranks)
        refs = [getattr(self.trainers[r], method).remote(*args) for r in ranks]
        return self._gather(refs, f"trainer.{method}", self._trainer_names(ranks))

    def call_engines(self, method: str, *args) -> list:
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        return self._gather(refs, f"engine.{method}", self._engine_names())

    def put_shards(self, shards: list) -> list:
        """One object-store ref per trainer rank (its `[step] -> samples`)."""
        return [self.ray.put(shard) for shard in shards]

    def call_trainers_with_shards(self, method: str, refs: list) -> list:
        """`method(shard)` on rank r with `refs[r]` (Ray resolves each ref inside its actor)."""
        calls = [getattr(t, method).remote(ref) for t, ref in zip(self.trainers, refs)]
        return self._gather(calls, f"trainer.{method}", self._trainer_names())

    # ---------------------------------------------------------------- weights
    def sync_weights(self, version: int, verify: bool | None = None) -> dict[str, float]:
        """Every trainer rank pushes its part; returns rank 0's `weights/*` plus the wall time and the version.

        `verify` overrides `cfg.weights.verify` for this sync (bit checksums compared on every engine).
        """
        start = time.perf_counter()
        per_rank = self.call_trainers("sync_weights", version, verify)
        metrics = dict(per_rank[0])
        for m in per_rank[1:]:  # colocated: every rank sends the full model to its own engine
            for k in ("weights/bytes", "weights/num_buckets", "weights/num_tensors"):
                metrics[k] += m.get(k, 0.0) if self.cluster.colocate else 0.0
        metrics["perf/update_weights_time"] = time.perf_counter() - start
        metrics["weights/version"] = float(version)
        return metrics

    # ---------------------------------------------------------------- protocol-shaped views
    def engine_group(self) -> EngineGroup:
        return EngineGroup(self)

    def train_group(self) -> TrainGroup:
        return TrainGroup(self)

    def weight_group(self) -> WeightGroup:
        return WeightGroup(self)

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group (safe to call twice)."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.trainers + self.engines:
            self.ray.kill(actor, no_restart=True)
        self.trainers, self.engines = [], []
        if getattr(self, "placement", None) is not None:
            remove_placement_group(self.placement.pg)
            self.placement = None


class EngineGroup:
    """A `RolloutEngine` over the engine actors: prompts are split into contiguous blocks, one per engine."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster = cluster

    @property
    def weight_version(self) -> int:
        """The lowest version any engine holds."""
        return min(self.cluster.call_engines("weight_version"))

    def generate(self, prompts, sampling, seeds=None):
        engines = self.cluster.engines
        bounds = _blocks(len(prompts), len(engines))
        refs, offsets = [], []
        for e, (lo, hi) in enumerate(bounds):
            if hi > lo:
                refs.append(engines[e].generate.remote(list(prompts[lo:hi]), sampling, None if seeds is None else list(seeds[lo:hi])))
                offsets.append((e, lo))
        results = self.cluster._gather(refs, "engine.generate", [f"engine {e}" for e, _ in offsets])
        out = []
        for (_, lo), gens in zip(offsets, results):
            for g in gens:
                g.prompt_index += lo
                out.append(g)
        return out

    def update_weights(self, buckets, version: int) -> None:
        raise RuntimeError("weights reach Ray engines from the trainer ranks; call RayCluster.sync_weights(version)")

    def sleep(self, release_weights: bool = False) -> None:
        self.cluster.call_engines("sleep")

    def wake_up(self) -> None:
        self.cluster.call_engines("wake_up")

    def flush_cache(self) -> None:
        self.cluster.call_engines("flush_cache")


class TrainGroup(CommittedCheckpoints):
    """The trainer ranks as one backend for the Trainer's sleep / wake_up / save / load (each fanned out); the
    checkpoints they commit are read on the driver (same filesystem)."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster = cluster
        self.cfg = cluster.cfg.backend  # `Trainer.save` points `cfg.checkpoint_dir` at the save path

    def sleep(self) -> dict:
        return max_merge(self.cluster.call_trainers("sleep"))

    def wake_up(self) -> dict:
        return max_merge(self.cluster.call_trainers("wake_up"))

    def update_ref(self) -> dict:
        return max_merge(self.cluster.call_trainers("update_ref"))

    def save(self, step: int | None = None, extra: dict | None = None) -> str:
        return self.cluster.call_trainers("save", self.cfg.checkpoint_dir, step, extra)[0]

    def load(self, step: int | None = None) -> int:
        return self.cluster.call_trainers("load", self.cfg.checkpoint_dir, step)[0]


class WeightGroup:
    """The Trainer's weight sync on Ray: every trainer rank pushes straight into the engine actors."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster = cluster

    def push(self, version: int) -> dict[str, float]:
        return self.cluster.sync_weights(version)


def with_engine_weight_dtype(cfg):
    """`cfg` with `weights.dtype` set to the dtype an SGLang engine holds its parameters in (what its broadcast
    receive takes: `SGLangEngine.weight_layout`), so every trainer rank casts to it before sending; ValueError
    when `weights.dtype` names another. The torch engine casts on load: `cfg` unchanged."""
    if cfg.rollout_engine != "sglang":
        return cfg
    from rlbench.engine.sglang_engine import check_model_dir, sglang_load_dtype
    from rlbench.orchestration.local import sglang_config

    sglang = sglang_config(cfg)
    check_model_dir(sglang.model_path)
    dtype = DTYPE_NAMES[sglang_load_dtype(sglang.model_path, str(sglang.extra.get("dtype", "auto")))]
    if cfg.weights.dtype is None:
        return cfg.replace(weights=dataclasses.replace(cfg.weights, dtype=dtype))
    if cfg.weights.dtype != dtype:
        raise ValueError(f"weights.dtype={cfg.weights.dtype!r}, but SGLang holds {sglang.model_path}'s parameters in "
                         f"{dtype} and receives broadcast weights only in that dtype; set weights.dtype={dtype!r} "
                         f"(--weights-dtype {dtype}) or leave it unset")
    return cfg


def _blocks(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous [lo, hi) blocks covering range(n), sizes differing by at most one."""
    base, extra = divmod(n, k)
    bounds, lo = [], 0
    for i in range(k):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def max_merge(dicts: list[dict]) -> dict:
    """Per key, the max over ranks (times and bytes of the slowest / largest rank)."""
    return {k: max(d[k] for d in dicts) for k in dicts[0]}
