"""Configs of the embedded torch engine: `TorchEngineConfig` and its nested `MegakernelConfig`.

Plain dataclasses with no torch or kernel imports, so a run config validates without loading the engine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

DECODE_ATTENTION = ("auto", "split", "sdpa", "split_kv")
"""Decode attention names (`rlbench.engine.attention.decode_attention` maps them to implementations)."""
STAGE_SYNC = ("pdl", "barrier", "launch")
"""How the megakernel's stages wait for each other (`MegakernelConfig.sync`)."""
ENGINE_DTYPES = ("bf16", "fp16", "fp32")
"""`TorchEngineConfig.dtype` names (the backend's `param_dtype` names)."""
WEIGHT_FORMATS = ("fp8_e4m3", "mxfp4", "nvfp4")
"""`TorchEngineConfig.weight_format` names (`rlbench.engine.quantize`); None keeps the weights as sent."""


@dataclass
class MegakernelConfig:
    """The batch-1 decode megakernel (`rlbench.engine.megakernel`): every decoder layer as stage kernels that
    stream the weights. Used for batch-1 steps on CUDA with bf16 fused Qwen3/Qwen2/Llama layers without o/MLP
    biases; other batches, models and devices take the compiled path."""

    enabled: bool | None = None
    """None (default): on where supported and the stages chain by programmatic dependent launch (sm_90+:
    H100/H200/B200), silently off elsewhere; True: wherever supported (older GPUs get the grid-barrier kernel,
    which needs the GPU to itself), with a warning where not; False: off."""
    sync: str = "auto"
    """Stage sync: "pdl" (a kernel per stage, programmatic dependent launch; "auto" on sm_90+), "barrier" (one
    persistent kernel with grid barriers; "auto" elsewhere) or "launch" (a kernel per stage, the bits of "pdl")."""
    gluon: bool | None = None
    """The GEMV stages whose weight tile fits shared memory, and then the attention stage, as Gluon kernels.
    None: where available (sm_90+, per-stage sync); True: the same, warning where nothing runs in Gluon;
    False: the Triton stage kernels."""
    head: bool = True
    """Batch-1 greedy/sampling steps end in two Triton kernels (final norm, lm_head, sampling, state update)
    instead of the compiled head (top-k/top-p steps keep the compiled head)."""

    def __post_init__(self) -> None:
        for name in ("enabled", "gluon"):
            if getattr(self, name) is not None:
                setattr(self, name, bool(getattr(self, name)))  # 0 / 1 (a command line): off / on
        if self.sync not in ("auto", *STAGE_SYNC):
            raise ValueError(f"megakernel sync={self.sync!r} must be 'auto' or one of {STAGE_SYNC}")


@dataclass
class TorchEngineConfig:
    """Sizes and switches of the torch engine."""

    max_seq_len: int = 2048
    """Prompt + response tokens per sequence (rounded up to a multiple of 16)."""
    num_slots: int | None = None
    """Sequences decoded at once; None = 8 on CPU, or as many as `mem_fraction` allows on GPU."""
    mem_fraction: float = 0.5
    """GPU only: fraction of the free memory (after weights) given to the KV cache."""
    max_slots: int = 512
    """Upper bound on `num_slots` when sized from memory."""
    max_prefill_tokens: int = 16384
    """Padded tokens per prefill batch (at least one prompt is always admitted)."""
    steps_per_sync: int = 8
    """Decode steps between host checks of stop conditions (fewer syncs; a few wasted steps at the end)."""
    cuda_graphs: bool = True
    """Capture the decode step in CUDA graphs (GPU only; per batch/kv-length bucket)."""
    compile: bool = True
    """torch.compile the decode step (GPU only; one layer graph for all layers); falls back to eager if it fails."""
    shared_prefix: bool = True
    """The n > 1 samples of a prompt read its K/V from one copy (`KVCache.group_view`): per decode step the prompt
    is read once per group instead of once per sample. False gives every sample a copy (the slot layout)."""
    fused_weights: bool = True
    """Run the engine's own layer forward over fused QKV and gate/up weights (Qwen3/Qwen2/Llama; other models
    use the HF layers). False runs the HF modules' own matmuls, as the trainer does."""
    decode_attention: str = "auto"
    """Decode attention: "sdpa" (one SDPA call, parallel over batch x KV heads only), "split" (compiled only:
    fp32 reductions spread over kv_len), "split_kv" (CUDA, Triton: programs over chunks of kv_len too) or
    "auto": split_kv for the grouped layout on CUDA; otherwise split while batch x KV heads < 64, else sdpa
    (compiled), sdpa (eager). `rlbench.engine.attention.decode_attention`."""
    gemv_batch1: bool = True
    """Compiled: decode batch 1 in its own graph whose matmuls inductor lowers to GEMV reductions (one more
    layer compile); otherwise the smallest compiled batch bucket is 2."""
    megakernel: MegakernelConfig = field(default_factory=MegakernelConfig)
    """The batch-1 decode megakernel; a bool or None is short for `MegakernelConfig(enabled=...)`."""
    dtype: str | None = None
    """The engine's weights and compute dtype: "bf16", "fp16" or "fp32"; None: the trainer's compute dtype
    (`backend.param_dtype`). A lower precision than the trainer's is a train/rollout mismatch by design."""
    weight_format: str | None = None
    """How the engine stores the weights it receives, each matrix rounded and kept dequantized in `dtype` (1-D
    norms and biases as sent; `rlbench.engine.quantize`): None (as sent), "fp8_e4m3" (FP8 rollout, as slime/verl's
    "fp8 rollout, bf16 training": one scale per output row), "mxfp4" (OCP MXFP4: e2m1 in blocks of 32 with a
    power-of-two scale) or "nvfp4" (e2m1 in blocks of 16 with an e4m3 scale). Anything but None is a
    train/rollout mismatch by design; the 4-bit formats a large one."""
    batch_invariant: bool = False
    """Batch-invariant numerics (`rlbench.numerics`): a token's log-prob does not depend on the batch it was
    decoded in, and equals the trainer's recompute bit for bit when the trainer runs them too
    (`RunConfig.true_on_policy_mode` sets both). No megakernel; fused QKV / gate-up weights only where the
    batch-invariant GEMM gives stacked weights the separate GEMMs' columns (`numerics.columns_invariant`, else
    the HF layers); the layer compiled with eager's rounding (`rlbench.numerics.compile_options`) where
    `compile` is on; CUDA graphs stay on."""

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be >= 2")
        self.max_seq_len = 16 * math.ceil(self.max_seq_len / 16)
        if self.num_slots is not None and self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be >= 1 (or None to size from memory)")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction={self.mem_fraction} must be in (0, 1)")
        if self.steps_per_sync < 1:
            raise ValueError(f"steps_per_sync={self.steps_per_sync} must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} must be >= 1")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r} must be one of {DECODE_ATTENTION}")
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"engine dtype={self.dtype!r} must be None (the trainer's) or one of {ENGINE_DTYPES}")
        if self.weight_format is not None and self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"engine weight_format={self.weight_format!r} must be None (the weights as sent) or one "
                             f"of {WEIGHT_FORMATS}")
        if self.megakernel is None or isinstance(self.megakernel, (bool, int)):
            self.megakernel = MegakernelConfig(enabled=self.megakernel)
        elif isinstance(self.megakernel, dict):
            self.megakernel = MegakernelConfig(**self.megakernel)

    def on_device(self, is_cuda: bool) -> TorchEngineConfig:
        """This config as it runs on a CUDA (True) or CPU (False) device: compile and CUDA graphs only on CUDA;
        batch-invariant: no megakernel."""
        cfg = dataclasses.replace(self, compile=self.compile and is_cuda, cuda_graphs=self.cuda_graphs and is_cuda)
        if self.batch_invariant:
            cfg = dataclasses.replace(cfg, megakernel=MegakernelConfig(enabled=False))
        return cfg
