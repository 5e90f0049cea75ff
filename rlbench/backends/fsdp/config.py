"""Typed configuration of the FSDP2 backend: model/sharding, optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlbench.backends.fsdp.attention import check_attn_implementation

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
class FSDPConfig:
    """The FSDP2 actor: which model, how it is sharded, computed and checkpointed."""

    model: str = "tiny"
    """a preset name (random init) or a local Hugging Face directory (safetensors)"""
    ref_model: str | None = None
    """reference model (preset or HF dir); None = no reference model"""
    ref_update_interval: int | None = None
    """every N rollouts copy the actor's weights into the reference model (shard to shard); None = never"""
    device: str = "cuda"
    """"cuda" or "cpu"""
    param_dtype: str = "bf16"
    """compute dtype of all-gathered params: "bf16", "fp16" or "fp32" (fp32 = no mixed precision)"""
    attn_implementation: str = "sdpa"
    """"sdpa", "eager", "flex_attention" (document BlockMask), "flash_attention_2/3" when installed"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer in backward (activation checkpointing)"""
    checkpoint_every: int = 1
    """with gradient_checkpointing: recompute every k-th decoder layer only (1 = all; 2 = half, less recompute)"""
    compile: bool = False
    """torch.compile each decoder layer (after checkpointing, before fully_shard)"""
    reshard_after_forward: bool = True
    """free gathered params after forward (ZeRO-3); False keeps them until backward (ZeRO-2-like)"""
    cpu_offload: bool = False
    """FSDP CPUOffloadPolicy on the actor: params/grads/optimizer on CPU, AdamW step on CPU"""
    seed: int = 1234
    """seed for random init and torch RNG"""
    temperature: float = 1.0
    """sampling temperature used for log-probs and entropy"""
    logprob_chunk_size: int = 512
    """rows of logits processed at once in the log-prob/entropy kernel"""
    with_entropy: bool = False
    """compute entropy in train() (needed when the loss has an entropy term)"""
    no_sync_accumulation: bool = True
    """reduce-scatter gradients only on the last micro-batch of a step (fp32 unsharded accumulation)"""
    cp_size: int = 1
    """context-parallel size (mesh is (dp, cp); FSDP shards over dp x cp)"""
    checkpoint_dir: str | None = None
    """where save()/load() write/read iter_XXXXXXX directories"""
    checkpoint_format: str = "sharded"
    """"sharded" (torch.distributed.checkpoint) or "full" (rank-0 torch.save of full state dicts)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimizer and LR schedule"""
    model_overrides: dict = field(default_factory=dict)
    """config overrides for a preset model (e.g. vocab_size)"""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; use 'cuda' or 'cpu'")
        if self.param_dtype not in _DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}; use one of {sorted(_DTYPES)}")
        check_attn_implementation(self.attn_implementation, self.device)
        if self.ref_update_interval is not None and self.ref_update_interval < 1:
            raise ValueError(f"ref_update_interval={self.ref_update_interval} must be >= 1 (None = never update)")
        if self.ref_update_interval is not None and self.ref_model is None:
            raise ValueError(f"ref_update_interval={self.ref_update_interval} needs a reference model; set ref_model (--ref-load)")
        if self.checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r}; use 'sharded' or 'full'")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if self.cp_size < 1:
            raise ValueError(f"cp_size={self.cp_size} must be >= 1")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be >= 1 (1 = every layer)")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size} must be >= 1")

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return _DTYPES[self.param_dtype]
