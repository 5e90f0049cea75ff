"""Typed configuration of the megatron-core backend: its parallel layout and kernels.

The model, precision, optimizer, schedule, checkpoint and log-prob settings are the run's `TrainConfig`
(`RunConfig.backend`), shared by both backends so a comparison changes only the backend. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
CORE_ATTENTIONS = ("sdpa", "flex")
"""`MegatronConfig.attention`: "sdpa" (one SDPA call with a block-diagonal causal mask; CPU and CUDA) or "flex"
(flex_attention over the packs' document BlockMask, compiled; CUDA)."""


@dataclass
class MegatronConfig:
    """megatron-core's layout: tensor / pipeline / sequence parallel, recompute, the core attention kernel."""

    tensor_model_parallel_size: int = 1
    """TP ranks per model replica (Qwen3: must divide the KV heads and the vocabulary)"""
    pipeline_model_parallel_size: int = 1
    """PP stages (1F1B schedule); must divide the layer count"""
    sequence_parallel: bool = False
    """shard the norm/dropout activations over the TP ranks (needs TP > 1)"""
    recompute_granularity: str | None = None
    """activation recompute: None, "full" (whole layers) or "selective" (megatron's core-attention recompute)"""
    recompute_method: str | None = None
    """with "full": "uniform" (groups of `recompute_num_layers`) or "block" (the first `recompute_num_layers`)"""
    recompute_num_layers: int | None = None
    """layers per recompute group ("uniform") or recomputed layers per stage ("block"); None with "full": 1 / all"""
    use_distributed_optimizer: bool = False
    """ZeRO-1: shard the fp32 main params and Adam state over the data-parallel ranks"""
    attention: str | None = None
    """core attention kernel (`CORE_ATTENTIONS`); None: "flex" on CUDA, "sdpa" on CPU"""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1 (it shards activations "
                             "over the TP ranks); drop --sequence-parallel or raise --tensor-model-parallel-size")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r}; use one of "
                             f"{RECOMPUTE_GRANULARITIES}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={self.recompute_method!r}; use one of {RECOMPUTE_METHODS}")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ValueError(f"recompute_method={self.recompute_method!r} applies to recompute_granularity='full' "
                             f"only (got {self.recompute_granularity!r})")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must be >= 1")
        if self.attention is not None and self.attention not in CORE_ATTENTIONS:
            raise ValueError(f"megatron attention={self.attention!r}; use one of {CORE_ATTENTIONS}")

    def core_attention(self, device: str) -> str:
        """The core attention kernel on `device` (`attention`, or the device's default)."""
        name = self.attention or ("flex" if device == "cuda" else "sdpa")
        if name == "flex" and device != "cuda":
            raise ValueError("megatron attention='flex' needs device='cuda' (CPU flex has no backward); use 'sdpa'")
        return name
