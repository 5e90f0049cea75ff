"""The run configuration: one small dataclass per component, composed by `RunConfig`.

Each component receives only its own config (`cfg.rollout`, `cfg.loss`, `cfg.backend`, ...).
`RunConfig.__post_init__` checks the rules that span components (batch-size arithmetic, the
reference model the KL needs, ...) and raises
`ValueError` naming the values and what to change. Presets (`rlbench.presets`) are functions
returning a `RunConfig`; the CLI (`rlbench.cli`) maps slime-named flags onto these fields.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlbench.algorithms.config import LossConfig
from rlbench.backends.fsdp.config import PARAM_DTYPES, FSDPConfig, OptimConfig
from rlbench.backends.megatron.config import MegatronConfig
from rlbench.data.config import DataConfig
from rlbench.engine.config import TorchEngineConfig
from rlbench.orchestration.ray_config import ClusterConfig, check_batch_layout, check_engine_layout

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchConfig", "CheckpointConfig", "ClusterConfig", "DataConfig", "EvalConfig", "FSDPConfig",
    "LoggingConfig", "LossConfig", "OptimConfig", "RolloutConfig", "RunConfig", "SGLangEngineConfig", "TaskConfig",
    "TorchEngineConfig", "WeightSyncConfig",
]


REWARD_NAMES = ("math", "exact", "countdown")
"""The names in `rlbench.rewards.REWARDS` (checked there), so that a config checks `rm_type` without importing it."""


def check_rm_type(rm_type) -> None:
    """Check a reward name without importing anything: a registry name, or `"module.path:function"`."""
    if callable(rm_type):
        return
    if not isinstance(rm_type, str):
        raise ValueError(f"rm_type={rm_type!r} must be a registry name, 'module.path:function' or a callable")
    rewards = sys.modules.get("rlbench.rewards")  # once loaded, its registry (names registered at run time too)
    names = list(rewards.REWARDS) if rewards is not None else list(REWARD_NAMES)
    if rm_type in names:
        return
    if ":" not in rm_type:
        raise ValueError(
            f"unknown reward {rm_type!r} (rm_type){did_you_mean(rm_type, names)}; choose one of "
            f"{sorted(names)} or pass 'module.path:function'"
        )
    module_name, _, attr = rm_type.partition(":")
    if not (all(p.isidentifier() for p in module_name.split(".")) and attr.isidentifier()):
        raise ValueError(
            f"rm_type={rm_type!r} is not 'module.path:function' (e.g. 'my_pkg.rewards:score'); "
            f"or use a registry name: {sorted(names)}"
        )


def did_you_mean(name: str, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices`, or ''."""
    import difflib

    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


@dataclass
class TaskConfig:
    """A synthetic task whose train/eval jsonl files are generated before the run (if missing)."""

    name: str = "arithmetic"
    """Task name in `rlbench.data.tasks.TASKS` ("arithmetic" or "countdown")."""
    level: int | None = 1
    """Arithmetic difficulty level 1..4 (ignored by countdown)."""
    n_train: int = 20000
    """Rows drawn for training (held-out prompts are removed from them; = SFTConfig.num_train)."""
    n_eval: int = 128
    """Held-out prompts (= SFTConfig.num_eval: the same split as the SFT warm start)."""
    seed: int = 0
    """Generation seed (= SFTConfig.seed)."""
    out_dir: str = "runs/data"
    """Where the jsonl files are written."""

    def __post_init__(self) -> None:
        if self.name not in ("arithmetic", "countdown"):
            raise ValueError(f"task name={self.name!r}; use 'arithmetic' or 'countdown'")
        if self.n_train < 1 or self.n_eval < 1:
            raise ValueError(f"n_train={self.n_train}, n_eval={self.n_eval} must both be >= 1")

    def _stem(self) -> str:
        level = f"-l{self.level}" if self.name == "arithmetic" else ""
        return os.path.join(self.out_dir, f"{self.name}{level}-s{self.seed}")

    @property
    def train_path(self) -> str:
        return f"{self._stem()}-train{self.n_train}.jsonl"

    @property
    def eval_path(self) -> str:
        return f"{self._stem()}-eval{self.n_eval}.jsonl"


@dataclass
class RolloutConfig:
    """How prompts become scored samples: sampling, group size, dynamic sampling, truncation."""

    rollout_batch_size: int = 8
    """Prompts (groups) per rollout (slime's --rollout-batch-size)."""
    n_samples_per_prompt: int = 4
    """Responses sampled per prompt: the GRPO group size."""
    max_response_len: int = 32
    """Maximum new tokens per response (slime's --rollout-max-response-len)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs and entropy in training use the same one."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    rm_type: str = "math"
    """Reward function name in `rlbench.rewards.REWARDS` or "module:function" (per-row metadata wins).
    Checked when the config is built (names, with "did you mean"); the import is resolved when the Trainer starts."""
    reward_timeout: float | None = 30.0
    """Seconds one reward call may take before `RewardError` names the function and the sample (calls run
    in a daemon worker thread; a stuck call's thread is abandoned). None or 0: no limit, calls run inline."""
    reward_workers: int | None = None
    """Processes that score rewards while the engine generates: each sample goes to a worker as soon as it
    stops, and the rollout waits only for those still scoring at the end (`rlbench.rollout.reward_pool`).
    None: half the cores (at most 8) on a GPU run, 0 on a CPU run; 0: inline, after generation. Rewards a worker
    cannot import by name (registered at run time, `__main__:fn`) are scored inline either way."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage) and sample more prompts to refill."""
    over_sampling_batch_size: int | None = None
    """Prompts pulled per refill round when dynamic sampling (None: rollout_batch_size)."""
    max_sampling_rounds: int = 8
    """Give up refilling after this many generate rounds and keep the groups found so far."""
    mask_truncated: bool = False
    """Zero the loss mask of responses cut at max_response_len (they still count in normalisation)."""
    ignore_eos: bool = False
    """Never stop at the eos token: every response is max_response_len tokens (benchmarks: the same work per sample)."""
    seed: int = 0
    """Base sampling seed: rollout r, prompt i, sample j use a seed derived from (seed, r, i, j)."""

    def __post_init__(self) -> None:
        for name in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"rollout temperature={self.temperature} must be > 0 for RL (greedy has no log-probs)")
        obs = self.over_sampling_batch_size
        if obs is not None and obs < self.rollout_batch_size:
            raise ValueError(
                f"over_sampling_batch_size={obs} must be >= rollout_batch_size={self.rollout_batch_size} (or None)"
            )
        if self.dynamic_sampling and self.n_samples_per_prompt < 2:
            raise ValueError("dynamic_sampling needs n_samples_per_prompt >= 2 (a group of 1 always has equal rewards)")
        if self.reward_workers is not None and self.reward_workers < 0:
            raise ValueError(f"rollout.reward_workers={self.reward_workers} must be >= 0 (0: score inline; None: auto)")
        if self.reward_timeout is not None and self.reward_timeout < 0:
            raise ValueError(f"reward_timeout={self.reward_timeout} must be > 0 seconds (None or 0: no limit)")
        check_rm_type(self.rm_type)

    @property
    def prompts_per_round(self) -> int:
        """Prompts one generate round pulls: the over-sampling batch under dynamic sampling, else the rollout's."""
        return (self.over_sampling_batch_size or self.rollout_batch_size) if self.dynamic_sampling else self.rollout_batch_size


@dataclass
class BatchConfig:
    """Optimizer steps per rollout and micro-batching (slime's batch flags)."""

    global_batch_size: int = 32
    """Samples per optimizer step; rollout_batch_size x n_samples_per_prompt must be a multiple of it."""
    micro_batch_size: int = 1
    """Samples per micro-batch per DP rank (static mode; ignored with use_dynamic_batch_size)."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token budget (first-fit count, Karmarkar-Karp) instead of a fixed count."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one packed micro-batch (needed by use_dynamic_batch_size)."""
    balance_data: bool = False
    """Split samples over DP ranks by balanced token counts (Karmarkar-Karp) instead of round-robin."""
    num_rollout: int = 10
    """Rollouts (= RL steps) in the run."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "num_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch.{name}={getattr(self, name)} must be >= 1")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError("use_dynamic_batch_size=True needs max_tokens_per_gpu (e.g. --max-tokens-per-gpu 4096)")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu={self.max_tokens_per_gpu} must be >= 1")
        if not self.use_dynamic_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} must be divisible by micro_batch_size="
                f"{self.micro_batch_size}; change global_batch_size or micro_batch_size"
            )


@dataclass
class EvalConfig:
    """Held-out evaluation: mean reward and unbiased pass@k."""

    interval: int | None = None
    """Evaluate every this many rollouts (and before training); None: never."""
    data_path: str | None = None
    """Held-out prompts (.jsonl/.parquet, same keys as the training data); None: the task's eval split."""
    max_prompts: int | None = None
    """Use at most this many eval prompts (None: all)."""
    n_samples_per_prompt: int = 1
    """Samples per eval prompt (pass@k needs k <= this)."""
    temperature: float | None = None
    """Eval sampling temperature (None: the rollout temperature)."""
    max_response_len: int | None = None
    """Eval max new tokens (None: the rollout's)."""
    pass_k: tuple[int, ...] = (1,)
    """The k values reported as eval/pass@k."""
    skip_before_train: bool = False
    """Do not evaluate at rollout 0 before training."""
    seed: int = 12345
    """Eval sampling seed (fixed, so every eval sees the same random draws)."""

    def __post_init__(self) -> None:
        self.pass_k = tuple(self.pass_k)
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"eval interval={self.interval} must be >= 1 or None (off)")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"eval n_samples_per_prompt={self.n_samples_per_prompt} must be >= 1")
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples_per_prompt]
        if bad:
            raise ValueError(
                f"eval pass_k={self.pass_k} has k={bad} outside [1, n_samples_per_prompt={self.n_samples_per_prompt}]; "
                "raise n_samples_per_prompt or drop those k"
            )
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval temperature={self.temperature} must be >= 0 (0 = greedy)")


@dataclass
class CheckpointConfig:
    """Where and when to save; where to resume from."""

    save_dir: str | None = None
    """Directory for checkpoints (slime's --save); None: no periodic saves."""
    save_interval: int | None = None
    """Save every this many rollouts and at the last one (needs save_dir)."""
    load_dir: str | None = None
    """Resume from this trainer checkpoint directory (slime's --load)."""

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"save_interval={self.save_interval} must be >= 1 or None")
        if self.save_interval is not None and self.save_dir is None:
            raise ValueError(f"save_interval={self.save_interval} needs save_dir (--save DIR)")


WEIGHT_TRANSPORTS = ("in_process",)
"""Weight-sync transport names (`rlbench.weights.TRANSPORTS` maps them to classes)."""
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes weights may be cast to before sending (torch attribute names)."""


@dataclass
class SGLangEngineConfig:
    """The SGLang rollout engine (`rollout_engine="sglang"`): `sglang.Engine` arguments under SGLang's `ServerArgs`
    names, so the flags are slime's (`--sglang-mem-fraction-static`, ...). Needs `sglang>=0.5.23`."""

    model_path: str | None = None
    """HF model directory the engine loads (None: the trainer's model, backend.model; it must be a directory)."""
    tp_size: int = 1
    """Tensor-parallel GPUs of the engine (slime sets it from --rollout-num-gpus-per-engine)."""
    mem_fraction_static: float = 0.6
    """Fraction of GPU memory for the engine's weights + KV cache."""
    attention_backend: str | None = None
    """SGLang attention kernels ("fa3", "triton", "flashinfer", ...; None: SGLang picks for the GPU)."""
    enable_deterministic_inference: bool = True
    """SGLang's batch-invariant mode. SGLang honours a request's `sampling_seed` only with it on, and rlbench's
    rollouts are seeded, so it is on by default; off is faster but then seeded generate calls are refused
    (unless allow_unseeded)."""
    rl_on_policy_target: str | None = None
    """SGLang's true on-policy numerics for a trainer ("fsdp", its only choice; turns deterministic inference on).
    It matches an FSDP trainer running SGLang's batch-invariant kernels, not rlbench's: see docs/rollout.md."""
    allow_unseeded: bool = False
    """With deterministic inference off, sample anyway and ignore the per-sample seeds (warned once)."""
    enable_memory_saver: bool = True
    """Needed for sleep/wake_up (SGLang's release/resume_memory_occupation)."""
    random_seed: int = 0
    """Server seed (a request's sampling_seed overrides it in deterministic mode)."""
    extra: dict = field(default_factory=dict)
    """Any other `ServerArgs` field, passed to `sglang.Engine` unchanged (JSON on the command line)."""

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"sglang mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.tp_size < 1:
            raise ValueError(f"sglang tp_size={self.tp_size} must be >= 1")
        if self.rl_on_policy_target not in (None, "fsdp"):
            raise ValueError(f"sglang rl_on_policy_target={self.rl_on_policy_target!r}: SGLang 0.5.23 knows only "
                             "'fsdp' (or None)")
        named = sorted(set(self.extra) & {f.name for f in dataclasses.fields(self)})
        if named:
            raise ValueError(f"sglang extra sets {named}, which are fields of their own; set those fields instead")

    @property
    def deterministic(self) -> bool:
        """Whether SGLang runs its deterministic mode (rl_on_policy_target turns it on too)."""
        return self.enable_deterministic_inference or self.rl_on_policy_target is not None

    def engine_kwargs(self, model_path: str) -> dict:
        """Keyword arguments of `sglang.Engine(...)` for this config and model directory."""
        kwargs = dict(model_path=model_path, tp_size=self.tp_size, mem_fraction_static=self.mem_fraction_static,
                      enable_memory_saver=self.enable_memory_saver, random_seed=self.random_seed,
                      enable_deterministic_inference=self.deterministic)
        if self.attention_backend is not None:
            kwargs["attention_backend"] = self.attention_backend
        if self.rl_on_policy_target is not None:
            kwargs["rl_on_policy_target"] = self.rl_on_policy_target
        return kwargs | self.extra


ROLLOUT_ENGINES = ("torch", "sglang")
"""The values of `RunConfig.rollout_engine`."""
TRAIN_BACKENDS = ("fsdp", "megatron")
"""`RunConfig.train_backend` choices (`rlbench.orchestration.local.build_backend`)."""


@dataclass
class WeightSyncConfig:
    """How trainer weights reach the rollout engine."""

    transport: str = "in_process"
    """Transport name in `WEIGHT_TRANSPORTS` (only "in_process" for now)."""
    bucket_bytes: int = 512 << 20
    """Maximum bytes per bucket (slime's --update-weight-buffer-size, default 512 MiB)."""
    dtype: str | None = None
    """Cast weights to this dtype before sending ("bfloat16", "float16", "float32"; None: the engine's dtype)."""
    verify: bool = False
    """After each sync, compare per-tensor checksums of what was sent with the engine's weights."""

    def __post_init__(self) -> None:
        if self.transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"weight-sync transport={self.transport!r} is unknown; choose one of {sorted(WEIGHT_TRANSPORTS)}"
            )
        if self.bucket_bytes < 1 << 10:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is below 1 KiB; pass e.g. 512 << 20")
        if self.dtype is not None and self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight-sync dtype={self.dtype!r} must be None or one of {sorted(WEIGHT_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The `torch.dtype` of `dtype` (None: keep the storage dtype)."""
        if self.dtype is None:
            return None
        import torch

        return getattr(torch, self.dtype)


@dataclass
class LoggingConfig:
    """Where metrics go."""

    console: bool = True
    """Print one line per step with the main metrics."""
    jsonl_path: str | None = None
    """Append one JSON object per step to this file (None: off)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (needs the `tensorboard` package; None: off)."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs `wandb`; None: off)."""
    wandb_run_name: str | None = None
    """Run name for wandb (None: wandb picks one)."""
    console_keys: tuple[str, ...] = field(default_factory=tuple)
    """Extra metric keys the console line prints besides the defaults."""
    warn_skipped_steps: int = 3
    """Warn once this many optimizer steps in a row were skipped (non-finite loss or grad norm: the weights
    did not move); 0: never warn. `train/skipped` is on the console line whenever it is non-zero."""

    def __post_init__(self) -> None:
        if self.wandb_run_name is not None and self.wandb_project is None:
            raise ValueError("wandb_run_name is set but wandb_project is None; set wandb_project to log to wandb")
        if self.warn_skipped_steps < 0:
            raise ValueError(f"warn_skipped_steps={self.warn_skipped_steps} must be >= 0 (0 = never warn)")


@dataclass
class RunConfig:
    """One RL run: every component's config, plus the rules that tie them together."""

    data: DataConfig
    """Training prompts (slime's --prompt-data, --input-key, --label-key, ...)."""
    backend: FSDPConfig = field(default_factory=FSDPConfig)
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
    equal the trainer's recompute bit for bit (`train/train_rollout_logprob_abs_diff == 0`). Sets
    `engine.batch_invariant` and `backend.batch_invariant`; docs/true_on_policy.md says what it costs."""

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
            if self.backend.batch_invariant != self.engine.batch_invariant:
                warnings.warn(
                    f"backend.batch_invariant={self.backend.batch_invariant} but engine.batch_invariant="
                    f"{self.engine.batch_invariant}: rollout and trainer log-probs will differ; set "
                    "true_on_policy_mode=True (--true-on-policy-mode) to run both batch-invariant", stacklevel=3)
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
        if loss.kl_coef != 0:
            raise ValueError(
                f"kl_coef={loss.kl_coef} (KL reward shaping) is not wired into the Trainer yet; "
                "use use_kl_loss=True with kl_loss_coef instead"
            )
        if loss.advantage_estimator == "ppo":
            raise ValueError("advantage_estimator='ppo' needs a critic, which rlbench does not have yet; use 'grpo'")

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
