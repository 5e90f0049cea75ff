"""The training backends' settings: `TrainConfig` (what both backends share: model, precision, optimizer and
schedule, CP size, checkpoints), its FSDP-only part `FSDPOptions` (nested, refused by megatron when set), and
`OptimConfig`.

No torch import at module level: a run config validates without loading torch (`torch_param_dtype` imports it).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlbench.configs.critic import CriticConfig

if TYPE_CHECKING:
    import torch

PARAM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""`TrainConfig.param_dtype` name -> the torch dtype's name."""
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
"""Attention backends whose packed-sequence isolation is tested (`rlbench.backends.attention` builds the masks)."""
CP_ATTENTIONS = ("allgather", "ring_flash_llama3")
"""`FSDPOptions.cp_attention` kernels (`rlbench.distributed.cp_kernels`)."""


def check_attn_implementation(name: str, device: str) -> None:
    """Raise `ValueError` unless `name` is a backend whose packed-sequence isolation rlbench tests on `device`."""
    if "/" in name:
        raise ValueError(
            f"attn_implementation={name!r}: Hub kernels (e.g. 'kernels-community/flash-attn') are not supported, "
            "their packed-sequence isolation is untested here; use 'flash_attention_2' (pip install flash-attn) or 'sdpa'"
        )
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={name!r}; use one of {ATTN_IMPLEMENTATIONS}")
    if name.startswith("flash_attention") and device != "cuda":
        raise ValueError(f"attn_implementation={name!r} needs device='cuda'; use 'sdpa' or 'eager' on CPU")
    if name == "flex_attention" and device == "cpu":
        # torch 2.13 CPU flex (inductor C++ template) gave wrong packed logits (NaN / 0.17 off); see docs/fsdp.md
        raise ValueError("attn_implementation='flex_attention' needs device='cuda'; use 'sdpa' or 'eager' on CPU")


@dataclass
class OptimConfig:
    """AdamW and the LR schedule (one scheduler step per optimizer step)."""

    lr: float = 1e-6
    """peak learning rate"""
    min_lr: float = 0.0
    """floor reached at the end of the decay (linear / cosine)"""
    weight_decay: float = 0.0
    """decoupled AdamW weight decay"""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)"""
    eps: float = 1e-8
    """AdamW epsilon"""
    clip_grad: float = 1.0
    """max global grad norm (over all DTensor shards); 0 disables clipping but the norm is still reported"""
    lr_schedule: str = "constant"
    """"constant", "linear" or "cosine" decay after warmup"""
    warmup_steps: int = 0
    """linear warmup from warmup_init_lr to lr over this many optimizer steps"""
    warmup_init_lr: float = 0.0
    """learning rate at step 0 of the warmup"""
    decay_steps: int | None = None
    """optimizer steps over which lr decays to min_lr (after warmup); required by linear / cosine"""

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr_schedule={self.lr_schedule!r}; use 'constant', 'linear' or 'cosine'")
        if self.lr_schedule != "constant" and not self.decay_steps:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs decay_steps > 0 (got {self.decay_steps})")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr={self.min_lr} <= lr={self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad={self.clip_grad} must be >= 0 (0 disables clipping)")


@dataclass
class FSDPOptions:
    """Settings only the FSDP2 backend has (how the HF model is wrapped, sharded and computed); the megatron
    backend refuses any that differs from its default (it has its own: `MegatronConfig`)."""

    attn_implementation: str | None = None
    """"sdpa", "eager", "flex_attention" (document BlockMask), "flash_attention_2/3" when installed; None: the
    fast tested default, flex_attention on CUDA and sdpa on CPU (`TrainConfig.attention`)"""
    gradient_checkpointing: bool | None = None
    """recompute each decoder layer in backward (activation checkpointing); None: the run's start-up memory plan
    decides (`rlbench.memory_start`: on only when training does not fit without it; off for a backend built alone)"""
    checkpoint_every: int = 1
    """with gradient_checkpointing: recompute every k-th decoder layer only (1 = all; 2 = half, less recompute)"""
    compile: bool | None = None
    """torch.compile each decoder layer (after checkpointing, before fully_shard); None: on CUDA unless
    cp_size > 1 (`TrainConfig.compiled`); batch-invariant layers compile with eager's rounding
    (`numerics.compile_options`)"""
    reshard_after_forward: bool = True
    """free gathered params after forward (ZeRO-3); False keeps them until backward (ZeRO-2-like)"""
    cpu_offload: bool | None = None
    """FSDP CPUOffloadPolicy on the actor: params/grads/optimizer on CPU, AdamW step on CPU; None: the run's start-up
    memory plan decides (its last resort; off for a backend built alone)"""
    no_sync_accumulation: bool = True
    """reduce-scatter gradients only on the last micro-batch of a step (fp32 unsharded accumulation)"""
    cp_kv_head_chunk: int | None = None
    """CP attention all-gathers this many KV heads at a time (must divide the model's KV heads); None = all at once"""
    cp_recompute: bool = False
    """CP attention: backward re-gathers each head chunk's K/V instead of keeping every layer's gathered K/V"""
    cp_attention: str = "allgather"
    """CP attention kernel: "allgather" (rlbench_cp, zig-zag slices) or "ring_flash_llama3" (ring-flash-attn's
    llama3 varlen kernel, contiguous slices; CUDA, bf16/fp16, pip install flash-attn ring-flash-attn)"""
    checkpoint_format: str = "sharded"
    """"sharded" (torch.distributed.checkpoint) or "full" (rank-0 torch.save of full state dicts)"""
    moe_aux_loss_coef: float = 0.0
    """weight of an MoE model's router load-balancing loss (transformers' `load_balancing_loss_func` over the
    router logits of the training forward, real tokens only) added to the policy loss and logged as
    `train/moe_aux_loss`; 0 = off"""

    def __post_init__(self) -> None:
        if not self.moe_aux_loss_coef >= 0:
            raise ValueError(f"moe_aux_loss_coef={self.moe_aux_loss_coef} must be >= 0 (0 = no load-balancing loss)")
        if self.checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r}; use 'sharded' or 'full'")
        if self.cp_kv_head_chunk is not None and self.cp_kv_head_chunk < 1:
            raise ValueError(f"cp_kv_head_chunk={self.cp_kv_head_chunk} must be >= 1 (None = all KV heads at once)")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be >= 1 (1 = every layer)")
        if self.cp_attention not in CP_ATTENTIONS:
            raise ValueError(f"cp_attention={self.cp_attention!r}; use one of {CP_ATTENTIONS}")

    def changed(self) -> list[str]:
        """The fields set to something other than their default (what another backend must refuse)."""
        default = FSDPOptions()
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@dataclass
class TrainConfig:
    """A training backend (FSDP2 or megatron): which model, its precision, optimizer, layout and checkpoints."""

    model: str = "tiny"
    """a preset name (random init) or a local Hugging Face directory (safetensors)"""
    ref_model: str | None = None
    """reference model (preset or HF dir); None = no reference model"""
    ref_update_interval: int | None = None
    """every N rollouts copy the actor's weights into the reference model (shard to shard); None = never"""
    device: str = "cuda"
    """device of the parameters and the compute: "cuda" or "cpu"."""
    param_dtype: str = "bf16"
    """compute dtype of all-gathered params: "bf16", "fp16" or "fp32" (fp32 = no mixed precision)"""
    seed: int = 1234
    """seed for random init and torch RNG"""
    logprob_chunk_size: int = 256
    """rows of logits processed at once in the log-prob/entropy kernel (`algorithms.logprobs.DEFAULT_CHUNK_SIZE`)"""
    with_entropy: bool = False
    """compute entropy in train() (needed when the loss has an entropy term)"""
    cp_size: int = 1
    """context-parallel size (mesh is (dp, cp); FSDP shards over dp x cp); > 1 replaces the model's attention
    with the `fsdp.cp_attention` kernel (default `rlbench.distributed.cp_attention`: zig-zag slices, all-gathered K/V)"""
    checkpoint_dir: str | None = None
    """where save()/load() write/read iter_XXXXXXX directories"""
    batch_invariant: bool = False
    """batch-invariant forward numerics (`rlbench.numerics`), the engine's; set by `RunConfig.true_on_policy_mode`
    in a run (a backend built alone may set it)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimizer and LR schedule"""
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """the FSDP2 backend's own settings (refused by megatron when changed)"""
    model_overrides: dict = field(default_factory=dict)
    """config overrides for a preset model (e.g. vocab_size)"""
    freeze_vision: bool = True
    """a vision-language model's vision tower (its `visual` module) is not trained (no gradients, no optimizer state)"""
    freeze_modules: tuple[str, ...] = ()
    """parameter-name prefixes frozen as well (e.g. model.visual.merger or model.language_model.layers.0.)"""
    critic: CriticConfig | None = None
    """the PPO critic trained beside the actor (`advantage_estimator="gae"`); None = no critic"""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; use 'cuda' or 'cpu'")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}; use one of {sorted(PARAM_DTYPES)}")
        check_attn_implementation(self.attention, self.device)
        if self.ref_update_interval is not None and self.ref_update_interval < 1:
            raise ValueError(f"ref_update_interval={self.ref_update_interval} must be >= 1 (None = never update)")
        if self.ref_update_interval is not None and self.ref_model is None:
            raise ValueError(f"ref_update_interval={self.ref_update_interval} needs a reference model; set ref_model (--ref-load)")
        if self.cp_size < 1:
            raise ValueError(f"cp_size={self.cp_size} must be >= 1")
        f = self.fsdp
        if self.cp_size == 1 and (f.cp_kv_head_chunk is not None or f.cp_recompute):
            warnings.warn(f"cp_kv_head_chunk={f.cp_kv_head_chunk}, cp_recompute={f.cp_recompute} have no "
                          "effect with cp_size=1 (they schedule the CP attention)", UserWarning, stacklevel=3)
        self._check_cp_attention()
        if self.cp_size > 1 and self.batch_invariant:
            raise ValueError(f"cp_size={self.cp_size} with batch_invariant=True: CP attention (all-gathered K/V, "
                             "rlbench.distributed.cp_attention) is not the engine's batch-invariant kernel; use cp_size=1")
        if self.cp_size > 1 and self.attention.startswith("flash_attention"):
            raise ValueError(f"cp_size={self.cp_size} with attn_implementation={self.attention!r}: CP runs its "
                             "own attention (rlbench_cp: SDPA on CPU, flex on CUDA); use 'sdpa' or 'flex_attention'")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size} must be >= 1")
        if self.cp_size > 1 and f.moe_aux_loss_coef > 0:
            raise ValueError(f"moe_aux_loss_coef={f.moe_aux_loss_coef} with context_parallel_size={self.cp_size}: the "
                             "load-balancing loss has no CP path yet; use context_parallel_size=1")
        if self.critic is not None and self.cp_size > 1:
            raise ValueError(f"a critic (--critic-*) with context_parallel_size={self.cp_size}: the value head has no "
                             "CP path yet; use context_parallel_size=1 for PPO with a critic")
        if self.critic is not None:
            self.critic_optim  # noqa: B018 (validates the critic's schedule now, not at init)

    def _check_cp_attention(self) -> None:
        name, f = self.fsdp.cp_attention, self.fsdp
        if name == "allgather":
            return
        if self.cp_size == 1:
            warnings.warn(f"cp_attention={name!r} has no effect with cp_size=1", UserWarning, stacklevel=4)
        if self.device != "cuda":
            raise ValueError(f"cp_attention={name!r} needs device='cuda' (flash-attn has no CPU kernel); "
                             "use cp_attention='allgather'")
        if self.param_dtype == "fp32":
            raise ValueError(f"cp_attention={name!r} runs flash-attn, which takes bf16/fp16 only; set "
                             "param_dtype='bf16' or use cp_attention='allgather'")
        if f.cp_recompute:
            warnings.warn(f"cp_recompute has no effect with cp_attention={name!r} (its backward re-gathers K/V "
                          "by itself)", UserWarning, stacklevel=4)

    @property
    def critic_optim(self) -> OptimConfig:
        """The critic's optimizer and schedule: the actor's `optim` with `critic.lr` (None: the actor's) and
        `critic.lr_warmup_iters` (slime's `--critic-lr`, `--critic-lr-warmup-iters`); min_lr is capped at that lr."""
        if self.critic is None:
            raise ValueError("critic_optim: no critic configured (TrainConfig.critic is None)")
        lr = self.optim.lr if self.critic.lr is None else self.critic.lr
        return dataclasses.replace(self.optim, lr=lr, min_lr=min(self.optim.min_lr, lr),
                                   warmup_steps=self.critic.lr_warmup_iters)

    @property
    def attention(self) -> str:
        """The attention implementation the model is built with (`fsdp.attn_implementation`, or the device's default)."""
        if self.fsdp.attn_implementation is not None:
            return self.fsdp.attn_implementation
        return "flex_attention" if self.device == "cuda" else "sdpa"

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers are compiled (`fsdp.compile`, or on by default on CUDA where it is tested: not
        under CP)."""
        if self.fsdp.compile is not None:
            return self.fsdp.compile
        return self.device == "cuda" and self.cp_size == 1

    @property
    def torch_param_dtype(self) -> torch.dtype:
        """The `torch.dtype` of `param_dtype`."""
        import torch

        return getattr(torch, PARAM_DTYPES[self.param_dtype])
