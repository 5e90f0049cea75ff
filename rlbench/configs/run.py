"""The run configuration: one small dataclass per component, composed by `RunConfig`.

Each component receives only its own config (`cfg.rollout`, `cfg.loss`, `cfg.backend`, ...).
`RunConfig.__post_init__` checks the rules that span components (batch-size arithmetic, the
reference model the KL needs, ...) and raises
`ValueError` naming the values and what to change. Presets (`rlbench.presets`) are functions
returning a `RunConfig`; the CLI (`rlbench.cli`) maps slime-named flags onto these fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlbench.configs.backend import PARAM_DTYPES, TrainConfig
from rlbench.configs.batch import BatchConfig
from rlbench.configs.checkpoint import CheckpointConfig
from rlbench.configs.checks import did_you_mean
from rlbench.configs.cluster import ClusterConfig, check_batch_layout, check_engine_layout
from rlbench.configs.critic import CriticConfig
from rlbench.configs.data import DataConfig, TaskConfig
from rlbench.configs.engine import TorchEngineConfig
from rlbench.configs.loss import LossConfig
from rlbench.configs.megatron import MegatronConfig
from rlbench.configs.metrics import LoggingConfig
from rlbench.configs.rollout import EvalConfig, RolloutConfig
from rlbench.configs.sglang import SGLangEngineConfig
from rlbench.configs.weights import WeightSyncConfig

ROLLOUT_ENGINES = ("torch", "sglang")
"""The values of `RunConfig.rollout_engine`."""
TRAIN_BACKENDS = ("fsdp", "megatron")
"""`RunConfig.train_backend` choices (`rlbench.orchestration.local.build_backend`)."""


@dataclass
class RunConfig:
    """One RL run: every component's config, plus the rules that tie them together."""

    data: DataConfig
    """Training prompts (slime's --prompt-data, --input-key, --label-key, ...)."""
    backend: TrainConfig = field(default_factory=TrainConfig)
    """The training backend's model, precision, optimizer and schedule (shared by both backends; the FSDP-only
    fields are refused by the megatron backend)."""
    train_backend: str = "fsdp"
    """Which backend trains: "fsdp" (FSDP2 on the HF model) or "megatron" (megatron-core GPTModel, `megatron`;
    extra rlbench[megatron]; docs/megatron.md)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """The megatron-core layout (TP, PP, SP, recompute, distributed optimizer), when train_backend="megatron"."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Advantages, policy loss, KL and entropy terms."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and rewards."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Batch sizes and the number of rollouts."""
    engine: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    """The embedded rollout engine (sequence length, slots, CUDA graphs, compile)."""
    rollout_engine: str = "torch"
    """Which rollout engine generates: "torch" (the embedded one, `engine`) or "sglang" (`sglang`; extra
    rlbench[sglang]; in this process with cluster.backend="local", or as disaggregated Ray actors of
    sglang.tp_size GPUs each: docs/distributed.md)."""
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    """The SGLang engine, when rollout_engine="sglang"."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer-to-engine weight sync."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    task: TaskConfig | None = None
    """Synthetic task to generate data for before the run (None: data.path already exists)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where the run executes: one process ("local") or Ray actors ("ray": GPUs, colocate, async; docs/distributed.md)."""
    offload: bool | None = None
    """Colocated: park the trainer state in host memory during rollout and free the engine's KV cache
    during training (None: decided at start from the measured sizes, `rlbench.memory_plan`; off on CPU)."""
    seed: int = 1234
    """Global seed (torch/numpy/python RNG at start)."""
    true_on_policy_mode: bool = False
    """Engine and trainer run the same batch-invariant numerics (`rlbench.numerics`), so the rollout log-probs
    equal the trainer's recompute bit for bit (`train/train_rollout_logprob_abs_diff == 0`). The one switch: it
    sets `engine.batch_invariant` and `backend.batch_invariant` (no flags of their own); docs/true_on_policy.md
    says what it costs."""

    def __post_init__(self) -> None:
        self._check_train_backend()
        self._check_rollout_engine()
        self._check_on_policy()
        self._check_batch()
        self._check_algorithm()
        if self.eval.interval is not None and self.eval.data_path is None and self.task is None:
            raise ValueError("eval.interval is set but there is no eval data; set eval.data_path or task")
        if self.data.max_prompt_length is not None and self.data.max_prompt_length + self.rollout.max_response_len > self.engine.max_seq_len:
            raise ValueError(
                f"max_prompt_length={self.data.max_prompt_length} + max_response_len={self.rollout.max_response_len} "
                f"exceeds engine.max_seq_len={self.engine.max_seq_len}; raise engine.max_seq_len"
            )
        if self.cluster.backend == "ray":
            check_batch_layout(self, self.cluster)  # global_batch_size must split over the DP ranks
            check_engine_layout(self, self.cluster)  # engine actors of engine_num_gpus GPUs; SGLang disaggregated
        elif self.backend.cp_size > 1:
            raise ValueError(
                f"context_parallel_size={self.backend.cp_size} needs {self.backend.cp_size} (x dp) trainer ranks, but "
                "cluster.backend='local' runs one process; set cluster.backend='ray' with actor_num_gpus_per_node a "
                "multiple of the CP size"
            )

    def _check_train_backend(self) -> None:
        if self.train_backend not in TRAIN_BACKENDS:
            raise ValueError(f"train_backend={self.train_backend!r}{did_you_mean(self.train_backend, TRAIN_BACKENDS)}; "
                             f"choose one of {list(TRAIN_BACKENDS)}")
        if self.train_backend != "megatron":
            return
        m = self.megatron
        if self.cluster.backend == "local" and m.tensor_model_parallel_size * m.pipeline_model_parallel_size > 1:
            raise ValueError(
                f"tensor_model_parallel_size={m.tensor_model_parallel_size} x pipeline_model_parallel_size="
                f"{m.pipeline_model_parallel_size} needs that many trainer processes, but cluster.backend='local' "
                "runs one; set cluster.backend='ray' (one trainer actor per GPU), drive MegatronBackend under "
                "torchrun (docs/megatron.md), or use TP = PP = 1")
        if self.true_on_policy_mode:
            raise ValueError("true_on_policy_mode runs rlbench's batch-invariant HF layers in the trainer; "
                             "use train_backend='fsdp'")

    def _check_rollout_engine(self) -> None:
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(f"rollout_engine={self.rollout_engine!r}{did_you_mean(self.rollout_engine, ROLLOUT_ENGINES)}; "
                             f"choose one of {list(ROLLOUT_ENGINES)}")
        if self.rollout_engine != "sglang":
            return
        if self.weights.verify and self.sglang.tp_size > 1:
            raise ValueError(f"weights.verify with sglang.tp_size={self.sglang.tp_size}: SGLang's get_weights_by_name "
                             "returns rank-local shards of the fused projections at TP > 1, so nothing can be compared; "
                             "turn weights.verify off (--no-check-weight-update-equal) or use sglang.tp_size=1")
        if self.true_on_policy_mode:
            raise ValueError("true_on_policy_mode makes the torch engine's log-probs equal the trainer's bit for bit; "
                             "SGLang's kernels are not rlbench's, so no such guarantee holds. Use rollout_engine='torch', "
                             "or sglang.rl_on_policy_target='fsdp' without true_on_policy_mode and watch "
                             "train/train_rollout_logprob_abs_diff")

    @property
    def engine_num_gpus(self) -> int:
        """GPUs one rollout engine runs on: 1 for the torch engine (no tensor parallelism), sglang.tp_size for
        SGLang. On Ray each engine actor reserves that many (`cluster.rollout_num_gpus_per_engine` must match)."""
        return self.sglang.tp_size if self.rollout_engine == "sglang" else 1

    def _check_on_policy(self) -> None:
        if not self.true_on_policy_mode:
            if self.backend.batch_invariant or self.engine.batch_invariant:
                raise ValueError(
                    f"backend.batch_invariant={self.backend.batch_invariant}, engine.batch_invariant="
                    f"{self.engine.batch_invariant} with true_on_policy_mode=False: in a run the two follow the mode "
                    "(one switch); set true_on_policy_mode=True (--true-on-policy-mode) or leave both False")
            return
        dtype = self.engine.dtype or self.backend.param_dtype
        weights = {torch_name: name for name, torch_name in PARAM_DTYPES.items()}.get(self.weights.dtype, dtype)
        if dtype != self.backend.param_dtype or weights != dtype or self.engine.weight_format is not None:
            raise ValueError(
                f"true_on_policy_mode needs the engine to compute in the trainer's dtype (backend.param_dtype="
                f"{self.backend.param_dtype!r}) on the weights as sent; got engine.dtype={self.engine.dtype!r}, "
                f"weights.dtype={self.weights.dtype!r}, engine.weight_format={self.engine.weight_format!r}: leave "
                "all three None")
        if self.backend.cp_size > 1:
            raise ValueError(
                f"true_on_policy_mode with context_parallel_size={self.backend.cp_size}: ring attention merges "
                "partial softmaxes in another order than the engine; use context_parallel_size=1")
        self.engine = dataclasses.replace(self.engine, batch_invariant=True)
        self.backend = dataclasses.replace(self.backend, batch_invariant=True)

    def _check_batch(self) -> None:
        r, b = self.rollout, self.batch
        total = r.rollout_batch_size * r.n_samples_per_prompt
        if total % b.global_batch_size:
            raise ValueError(
                f"rollout_batch_size={r.rollout_batch_size} x n_samples_per_prompt={r.n_samples_per_prompt} = {total} "
                f"samples is not a multiple of global_batch_size={b.global_batch_size}; change one of them"
            )
        if b.max_tokens_per_gpu is not None and b.max_tokens_per_gpu * self.backend.cp_size < r.max_response_len + 1:
            raise ValueError(
                f"max_tokens_per_gpu={b.max_tokens_per_gpu} cannot hold one sequence of max_response_len="
                f"{r.max_response_len} + prompt tokens; raise max_tokens_per_gpu"
            )
        self._check_cp_budget()

    def _check_cp_budget(self) -> None:
        """CP packs align every slot to 2*cp tokens (`RankStep.pack`): the smallest full sequence must still fit."""
        cp, tokens = self.backend.cp_size, self.batch.max_tokens_per_gpu
        if cp == 1 or tokens is None or not self.batch.use_dynamic_batch_size:
            return
        align = 2 * cp
        smallest = -(-(self.rollout.max_response_len + 1) // align) * align
        capacity = tokens * cp // align * align
        if smallest > capacity:
            raise ValueError(
                f"max_tokens_per_gpu={tokens} x context_parallel_size={cp} holds {capacity} tokens of slots aligned to "
                f"{align}, less than one sequence of max_response_len={self.rollout.max_response_len} + a prompt token "
                f"({smallest} aligned); raise max_tokens_per_gpu to at least {-(-smallest // cp)}"
            )

    def _check_algorithm(self) -> None:
        loss, r = self.loss, self.rollout
        if loss.needs_ref and self.backend.ref_model is None:
            raise ValueError(
                f"use_kl_loss={loss.use_kl_loss}/kl_coef={loss.kl_coef} need a reference model; "
                "set backend.ref_model (--ref-load) to the starting checkpoint"
            )
        if loss.entropy_coef > 0 and not self.backend.with_entropy:
            raise ValueError(f"entropy_coef={loss.entropy_coef} needs backend.with_entropy=True")
        group_estimators = ("grpo", "gspo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
        if loss.advantage_estimator in group_estimators and r.n_samples_per_prompt < 2:
            raise ValueError(
                f"advantage_estimator={loss.advantage_estimator!r} with n_samples_per_prompt=1 gives zero "
                "advantages (a group of one); use n_samples_per_prompt >= 2"
            )
        self._check_critic()

    def _check_critic(self) -> None:
        """`advantage_estimator="gae"` trains a critic (the default one unless `backend.critic` says otherwise, as
        slime's estimator implies `--critic-*`); a critic nothing reads is refused, and so is one on megatron."""
        estimator, critic = self.loss.advantage_estimator, self.backend.critic
        if self.loss.needs_critic and critic is None:
            self.backend = dataclasses.replace(self.backend, critic=CriticConfig())
        elif not self.loss.needs_critic and critic is not None:
            raise ValueError(f"backend.critic is set (--critic-*) but advantage_estimator={estimator!r} reads no "
                             "values; use advantage_estimator='gae' (PPO with a critic) or drop the critic")
        if self.backend.critic is not None and self.train_backend == "megatron":
            raise ValueError("a critic (--advantage-estimator gae, --critic-*) with --train-backend megatron: the "
                             "critic runs on the FSDP backend only; use --train-backend fsdp for PPO with a critic")

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps per rollout: rollout_batch_size x n_samples_per_prompt / global_batch_size."""
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt // self.batch.global_batch_size

    def replace(self, **sections) -> RunConfig:
        """A copy with some sections replaced, re-validated: `cfg.replace(batch=dataclasses.replace(cfg.batch, ...))`."""
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict:
        """Plain nested dict (for logging / wandb config / checkpoint metadata)."""
        return dataclasses.asdict(self)
