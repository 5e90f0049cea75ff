"""Where a run executes: `ClusterConfig` (one process, or Ray actors) and the GPU plan it implies.

Pure: no Ray import here, so configs validate (and plans can be inspected) on a machine without Ray.

    cluster = ClusterConfig(backend="ray", actor_num_gpus_per_node=2, colocate=True)
    plan = placement_plan(cluster)      # 2 bundles; trainer ranks and engines share them
    cluster = ClusterConfig(backend="ray", actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1)
    placement_plan(cluster).engine_bundles   # [1]: the engine gets its own bundle after the trainer's
    cluster = ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    placement_plan(cluster).bundle_gpus      # (1, 2, 2): two TP-2 engines, one 2-GPU bundle each
    weight_group_ranks([2, 2])               # ([1, 3], 5): engine e's broadcast ranks start at offsets[e]

Flag names mirror slime's (`--actor-num-nodes`, `--actor-num-gpus-per-node`, `--rollout-num-gpus`,
`--rollout-num-gpus-per-engine`, `--colocate`); see `docs/distributed.md`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("local", "ray")
"""Cluster backend names (`rlbench.orchestration.TRAINERS` maps each to the Trainer class that runs it)."""


@dataclass
class ClusterConfig:
    """How many devices the trainer and the rollout engines get, and how they share them."""

    backend: str = "local"
    """"local": trainer and engine in this process (one device). "ray": Ray actors, one trainer rank per GPU."""
    actor_num_nodes: int = 1
    """Nodes holding trainer ranks (slime's --actor-num-nodes)."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks (GPUs, or CPU slots on a CPU run) per node (--actor-num-gpus-per-node)."""
    rollout_num_gpus: int | None = None
    """GPUs for rollout engines when disaggregated (--rollout-num-gpus); colocated: = trainer GPUs."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per engine (--rollout-num-gpus-per-engine): the engine's own GPU count, `RunConfig.engine_num_gpus`
    (1 for the torch engine, which has no TP; sglang.tp_size for SGLang), checked by `check_engine_layout`."""
    colocate: bool = True
    """Trainer ranks and engines share bundles (fractional GPUs, sleep/wake_up between phases, CUDA IPC
    weight sync); False: engines get their own bundles (broadcast weight sync; async possible)."""
    async_rollout: bool = False
    """One-step off-policy: generate rollout r+1 while training on rollout r (disaggregated only)."""
    update_weights_interval: int = 1
    """Async: push weights every this many rollouts (slime's --update-weights-interval)."""
    timeout_s: float = 600.0
    """Every `ray.get` waits at most this long; a dead actor or a hung collective becomes a RuntimeError."""
    collective_timeout_s: float = 600.0
    """torch.distributed timeout of the trainer group and of the weight-broadcast group."""
    ray_address: str | None = None
    """Connect to this Ray cluster ("auto", "ip:port"); None: `$RAY_ADDRESS`, else start a local one."""
    num_cpus: int | None = None
    """Logical CPUs of a Ray cluster started here (None: Ray's default = the machine's cores)."""
    env_vars: dict = field(default_factory=dict)
    """Extra environment variables for every actor (slime's --train-env-vars)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"cluster backend={self.backend!r}; choose one of {sorted(BACKENDS)}")
        for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "update_weights_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}, collective_timeout_s={self.collective_timeout_s} must be > 0")
        self._check_layout()

    def _check_layout(self) -> None:
        if self.backend == "local":
            if self.world_size > 1 or not self.colocate or self.async_rollout or self.rollout_num_gpus_per_engine > 1:
                raise ValueError(
                    f"backend='local' runs one colocated process (got {self.world_size} trainer ranks, colocate="
                    f"{self.colocate}, async_rollout={self.async_rollout}, rollout_num_gpus_per_engine="
                    f"{self.rollout_num_gpus_per_engine}); set cluster.backend='ray' (SGLang's TP in one process: "
                    "sglang.tp_size)"
                )
            return
        if self.colocate and self.rollout_num_gpus not in (None, self.world_size):
            raise ValueError(
                f"colocate=True shares the {self.world_size} trainer GPUs with the engines, but rollout_num_gpus="
                f"{self.rollout_num_gpus}; leave rollout_num_gpus=None (or set colocate=False)"
            )
        if not self.colocate and not self.rollout_num_gpus:
            raise ValueError("colocate=False needs rollout_num_gpus >= 1 (GPUs for the engines, e.g. --rollout-num-gpus 1)")
        if not self.colocate and self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"rollout_num_gpus={self.rollout_num_gpus} is not a multiple of rollout_num_gpus_per_engine="
                f"{self.rollout_num_gpus_per_engine} (GPUs per engine); make it one"
            )
        if self.async_rollout and self.colocate:
            raise ValueError(
                "async_rollout=True overlaps generation with training, which needs separate devices; "
                "set colocate=False and rollout_num_gpus"
            )

    @property
    def world_size(self) -> int:
        """Trainer ranks (= trainer GPUs)."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        """Rollout engine actors (one per engine GPU group)."""
        gpus = self.world_size if self.colocate else self.rollout_num_gpus
        return gpus // self.rollout_num_gpus_per_engine


@dataclass(frozen=True)
class PlacementPlan:
    """Bundle indices (in node-major, GPU-minor order) for every actor of the run."""

    bundle_gpus: tuple[int, ...]
    """GPUs of each bundle (ordered position): 1 per trainer rank; a disaggregated engine's bundle holds all of
    its GPUs (an actor lives in one bundle, and an engine of TP size t is one actor on t GPUs)."""
    train_bundles: tuple[int, ...]
    """Bundle of trainer rank r (ordered position, not Ray's raw bundle index)."""
    engine_bundles: tuple[int, ...]
    """Bundle of engine e (colocated: the trainer's bundles; disaggregated: the ones after them)."""
    train_gpu_fraction: float
    """Fraction of a bundle's GPU (or CPU) one trainer actor requests."""
    engine_gpu_fraction: float
    """Fraction of its bundle's GPUs (and CPUs) one engine actor requests (disaggregated: all of them)."""

    @property
    def num_bundles(self) -> int:
        """Bundles in the placement group (one CPU slot stands in for each "GPU" on a CPU run)."""
        return len(self.bundle_gpus)


def placement_plan(cluster: ClusterConfig) -> PlacementPlan:
    """The bundles of `cluster` (slime's create_placement_groups): colocated, engine e shares the bundle of trainer
    rank e x GPUs per engine; disaggregated, engine e owns bundle world + e, of `rollout_num_gpus_per_engine` GPUs."""
    world = cluster.world_size
    per = cluster.rollout_num_gpus_per_engine
    if cluster.colocate:
        engines = tuple(range(0, world, per))
        return PlacementPlan((1,) * world, tuple(range(world)), engines, 0.4, 0.2)
    n = cluster.num_engines
    return PlacementPlan((1,) * world + (per,) * n, tuple(range(world)), tuple(range(world, world + n)),
                         0.4, 1.0)


def weight_group_ranks(engine_ranks: list[int]) -> tuple[list[int], int]:
    """The disaggregated weight-broadcast group: (first rank of each engine, world size). Trainer rank 0 is rank 0;
    engine e takes `engine_ranks[e]` ranks (its TP size: SGLang joins as rank_offset + tp_rank) after those of
    engines 0..e-1."""
    offsets = [1 + sum(engine_ranks[:e]) for e in range(len(engine_ranks))]
    return offsets, 1 + sum(engine_ranks)


def check_engine_layout(cfg, cluster: ClusterConfig) -> None:
    """ValueError naming the fix unless the rollout engine of `cfg` can run on `cluster`'s Ray layout: every engine
    actor gets exactly the engine's GPU count (`cfg.engine_num_gpus`), and SGLang runs disaggregated."""
    gpus, per = cfg.engine_num_gpus, cluster.rollout_num_gpus_per_engine
    if cfg.rollout_engine != "sglang" and per != 1:
        raise ValueError(f"rollout_num_gpus_per_engine={per}: the embedded torch engine has no tensor parallelism; "
                         "use 1 (one engine per GPU), or rollout_engine='sglang' with sglang.tp_size")
    if per != gpus:
        raise ValueError(f"sglang.tp_size={gpus} puts each SGLang engine on {gpus} GPUs, but "
                         f"rollout_num_gpus_per_engine={per}; set both to the same value "
                         f"(--sglang-tp-size {gpus} --rollout-num-gpus-per-engine {gpus})")
    if cfg.rollout_engine == "sglang" and cluster.colocate:
        raise ValueError(
            "rollout_engine='sglang' on Ray runs disaggregated only: colocated Ray engines load weights from CUDA IPC "
            "handles of the trainer's buffers, which SGLang would have to pass on to its own scheduler processes "
            "(not built), and its TP ranks would share the trainer's GPUs; set colocate=False with rollout_num_gpus "
            "(--no-colocate --rollout-num-gpus N), or cluster.backend='local' for SGLang colocated in one process"
        )


def model_parallel_size(cfg) -> tuple[int, str]:
    """Trainer ranks that hold the same samples, and what makes them (CP for FSDP; TP x PP for megatron)."""
    if cfg.train_backend == "megatron":
        m = cfg.megatron
        return (m.tensor_model_parallel_size * m.pipeline_model_parallel_size,
                f"tensor_model_parallel_size={m.tensor_model_parallel_size} x pipeline_model_parallel_size="
                f"{m.pipeline_model_parallel_size}")
    return cfg.backend.cp_size, f"cp_size={cfg.backend.cp_size} (--context-parallel-size)"


def check_batch_layout(cfg, cluster: ClusterConfig) -> int:
    """The DP size of the run; ValueError naming the fix when a global batch does not split evenly over it."""
    mp, what = model_parallel_size(cfg)
    if cluster.world_size % mp:
        raise ValueError(f"{cluster.world_size} trainer ranks are not divisible by {what}; "
                         "make actor_num_nodes x actor_num_gpus_per_node a multiple of it")
    dp = cluster.world_size // mp
    mbs = 1 if cfg.batch.use_dynamic_batch_size else cfg.batch.micro_batch_size
    if cfg.batch.global_batch_size % (dp * mbs):
        per_rank = f"dp_size={dp}" + (f" x micro_batch_size={mbs}" if mbs > 1 else "")
        raise ValueError(
            f"global_batch_size={cfg.batch.global_batch_size} must be divisible by {per_rank}; "
            "change global_batch_size or the number of trainer GPUs"
        )
    return dp

