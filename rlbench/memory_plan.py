"""The colocated memory plan: what the trainer and the engine hold on the device, what a training micro-batch
needs on top, and whether the two must take turns (offload) — decided from the measured sizes, printed at start.

    plan = memory_plan(backend, engine, cfg, device)   # the Trainer does this when cfg.offload is None
    print(plan.summary())                               # one line: sizes, the estimate, the decision and why
    plan.offload                                        # True: engine and trainer sleep/wake around each phase

Measured: the trainer's state (parameter shards + optimizer state; with PPO the critic's too, parked with the
actor's: `backend.state_tensors()`), the engine's weights and KV cache (tensor
bytes), and the device's free memory now (both sides resident). Estimated: one training micro-batch —
gradients (one fp32 copy of the parameter shards, allocated by the first backward), the activations backward
keeps for `tokens` tokens (per decoder layer, or one layer's worth plus every layer's input with activation
checkpointing), and the full-vocabulary logits with their gradient. Offload is off only when the free memory
covers that estimate with a margin; otherwise (and whenever the estimate cannot be made) it is on, the safe
choice. On the CPU nothing is offloaded (host memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GIB = 2**30
MARGIN = 1.25
"""Free memory must cover the micro-batch estimate times this (allocator fragmentation, CUDA graphs, workspace)."""


def tensor_bytes(tensors) -> int:
    """Bytes of the local data of `tensors` (DTensor shards: the local part)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def micro_batch_bytes(hf_config, tokens: int, *, checkpointing: bool, dtype_bytes: int = 2) -> dict[str, int]:
    """Estimated bytes backward keeps for one packed micro-batch of `tokens` tokens of a decoder-only model.

    Per layer and token, without checkpointing: the attention block's norm output, q / k / v, attention output
    and o_proj input plus two residual streams (6 h + 2 kv-width), and the MLP's gate, up, activation and
    down-projection input (4 intermediate); with checkpointing only each layer's input (h) is kept, plus one
    layer's worth during its recompute. Logits: the `[T, V]` model output and its gradient.
    """
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv_width = getattr(hf_config, "num_key_value_heads", heads) * head_dim
    layers = hf_config.num_hidden_layers
    per_layer = dtype_bytes * (6 * h + 2 * kv_width + 4 * hf_config.intermediate_size)
    if checkpointing:
        activations = tokens * (layers * dtype_bytes * h + per_layer)
    else:
        activations = tokens * layers * per_layer
    logits = 2 * tokens * hf_config.vocab_size * dtype_bytes
    return {"activations": activations, "logits": logits}


@dataclass
class MemoryPlan:
    device: str
    total: int | None
    """device memory (bytes; None on the CPU)"""
    free: int | None
    """free now, with the trainer state and the engine resident"""
    trainer_state: int
    engine_weights: int
    kv_cache: int
    kv_slots: int
    tokens: int
    """tokens of the largest training micro-batch the estimate is for"""
    checkpointing: bool
    grads: int
    activations: int
    logits: int
    offload: bool
    reason: str

    @property
    def micro_batch(self) -> int:
        return self.grads + self.activations + self.logits

    def metrics(self) -> dict[str, float]:
        """`memory/plan_*` floats (GiB) for the metric sinks."""
        out = {f"memory/plan_{k}_gb": v / GIB for k, v in asdict(self).items()
               if isinstance(v, int) and not isinstance(v, bool) and k not in ("kv_slots", "tokens")}
        return out | {"memory/plan_offload": float(self.offload)}

    def summary(self) -> str:
        def g(x):
            return "?" if x is None else f"{x / GIB:.1f} GiB"

        head = f"memory plan ({self.device}" + (f", {g(self.total)})" if self.total is not None else ")")
        return (f"{head}: trainer state {g(self.trainer_state)}, engine weights {g(self.engine_weights)}, KV cache "
                f"{g(self.kv_cache)} ({self.kv_slots} slots), free {g(self.free)}; a training micro-batch of "
                f"{self.tokens} tokens ({'AC' if self.checkpointing else 'no AC'}) needs ~{g(self.micro_batch)} "
                f"(grads {g(self.grads)}, activations {g(self.activations)}, logits {g(self.logits)}) -> offload "
                f"{'on' if self.offload else 'off'}: {self.reason}")


def largest_micro_batch(cfg) -> int:
    """Tokens of the largest training micro-batch `cfg` allows (the dynamic budget, or the fixed size's worst)."""
    b = cfg.batch
    if b.use_dynamic_batch_size:
        return b.max_tokens_per_gpu * cfg.backend.cp_size
    return b.micro_batch_size * cfg.engine.max_seq_len


def memory_plan(backend, engine, cfg, device: torch.device) -> MemoryPlan | None:
    """Measure both sides, estimate a micro-batch, decide offload (see the module docstring); None for an engine
    whose memory is not ours to measure (SGLang: its own `mem_fraction_static`)."""
    if not hasattr(engine, "cache") or not hasattr(engine, "model"):
        return None
    state = tensor_bytes(backend.state_tensors())
    params = tensor_bytes(backend.model.parameters())
    weights = tensor_bytes(engine.model.parameters())
    cache = engine.cache
    kv = tensor_bytes([*cache.k, *cache.v])
    tokens = largest_micro_batch(cfg)
    ac = bool(cfg.backend.fsdp.gradient_checkpointing)
    est = micro_batch_bytes(backend.hf_config, tokens, checkpointing=ac)
    total = free = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    plan = MemoryPlan(device.type, total, free, state, weights, kv, cache.shape.num_slots, tokens, ac, params,
                      est["activations"], est["logits"], True, "")
    if device.type != "cuda":
        plan.offload, plan.reason = False, "host memory"
    elif free >= MARGIN * plan.micro_batch:
        plan.offload, plan.reason = False, f"free memory covers {MARGIN}x the micro-batch estimate"
    else:
        plan.reason = (f"free memory {free / GIB:.1f} GiB < {MARGIN}x the micro-batch estimate: engine and trainer "
                       "take turns (sleep/wake around each phase)")
    return plan
