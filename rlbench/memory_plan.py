"""The colocated memory plan as measured: what the trainer and the engine hold on the device once built, what a
training micro-batch needs on top, and whether the two must take turns (offload).

    plan = memory_plan(backend, engine, cfg, device)   # the Trainer does this once both sides are built
    print(plan.summary())                               # one line: sizes, the estimate, the decision and why
    plan.offload                                        # True: engine and trainer sleep/wake around each phase

The start-up plan (`rlbench.memory_start`) decides before anything is built, from the config; this one checks
it on real tensors. Measured: the trainer's state (parameter shards + optimizer state; with PPO the critic's
too, parked with the actor's: `backend.state_tensors()`), the engine's weights and KV cache (tensor bytes), and
the device's free memory now (both sides resident). Estimated: one training micro-batch — gradients (one fp32
copy of the parameter shards, allocated by the first backward), the activations backward keeps for `tokens`
tokens (per decoder layer, or one layer's worth plus every layer's input with activation checkpointing), and the
logits of the response rows with their gradient. Offload is off only when the free memory, less `RESERVE`,
covers the gradients plus `MARGIN` times the rest; otherwise it is on, the safe choice. On the CPU nothing is
offloaded (host memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GIB = 2**30
MARGIN = 1.25
"""A micro-batch's activations and logits are counted this many times (allocator fragmentation, temporaries)."""
RESERVE = 2 * GIB
"""Device memory no plan hands out: cuBLAS/NCCL workspaces, the engine's CUDA graph pools, compile autotuning."""


def tensor_bytes(tensors) -> int:
    """Bytes of the local data of `tensors` (DTensor shards: the local part)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def micro_batch_bytes(hf_config, tokens: int, *, checkpointing: bool, dtype_bytes: int = 2, checkpoint_every: int = 1,
                      logit_rows: int | None = None) -> dict[str, int]:
    """Estimated bytes backward keeps for one packed micro-batch of `tokens` tokens of a decoder-only model.

    Per layer and token, without checkpointing: the attention block's norm output, q / k / v, attention output
    and o_proj input plus two residual streams (6 h + 2 kv-width), and the MLP's gate, up, activation and
    down-projection input (4 intermediate); with checkpointing only each checkpointed layer's input (h) is kept
    (every `checkpoint_every`-th layer; the others keep their whole worth), plus one layer's worth during its
    recompute. Logits: the `[R, V]` output of the lm-head, which runs on the `logit_rows` positions that predict
    response tokens (None: all `tokens`), and its gradient.
    """
    if hasattr(hf_config, "get_text_config"):  # a VLM: its decoder (the vision tower is not counted)
        hf_config = hf_config.get_text_config()
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv_width = getattr(hf_config, "num_key_value_heads", heads) * head_dim
    layers = hf_config.num_hidden_layers
    per_layer = dtype_bytes * (6 * h + 2 * kv_width + 4 * hf_config.intermediate_size)
    if checkpointing:
        kept = -(-layers // checkpoint_every)  # layers 0, k, 2k, ... recompute
        activations = tokens * (kept * dtype_bytes * h + (layers - kept) * per_layer + per_layer)
    else:
        activations = tokens * layers * per_layer
    logits = 2 * (tokens if logit_rows is None else logit_rows) * hf_config.vocab_size * dtype_bytes
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
    gathered: int = 0
    """parameters FSDP keeps gathered while training (from the start-up plan's estimate; 0 without one)"""

    @property
    def micro_batch(self) -> int:
        return self.grads + self.activations + self.logits

    @property
    def need(self) -> int:
        """What training adds to the resident state: gradients, gathered parameters, MARGIN x the rest."""
        return self.grads + self.gathered + int(MARGIN * (self.activations + self.logits))

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


def memory_plan(backend, engine, cfg, device: torch.device, *, logit_share: float = 1.0,
                gathered: int = 0) -> MemoryPlan | None:
    """Measure both sides, estimate a micro-batch, decide offload (see the module docstring); None for an engine
    whose memory is not ours to measure (SGLang: its own `mem_fraction_static`). `logit_share` (response rows
    per token) and `gathered` come from the start-up plan (`rlbench.memory_start.StartPlan`) when there is one."""
    if not hasattr(engine, "cache") or not hasattr(engine, "model"):
        return None

    def here(tensors):  # with FSDP's CPU offload the shards live in host memory
        return [t for t in tensors if t.device.type == device.type]

    state = tensor_bytes(here(backend.state_tensors()))
    params = tensor_bytes(here(backend.model.parameters()))
    weights = tensor_bytes(engine.model.parameters())
    cache = engine.cache
    kv = tensor_bytes([*cache.k, *cache.v])
    tokens = largest_micro_batch(cfg)
    f = cfg.backend.fsdp
    ac = bool(f.gradient_checkpointing)
    est = micro_batch_bytes(backend.hf_config, tokens, checkpointing=ac, checkpoint_every=f.checkpoint_every,
                            logit_rows=round(tokens * logit_share))
    total = free = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    plan = MemoryPlan(device.type, total, free, state, weights, kv, cache.shape.num_slots, tokens, ac, params,
                      est["activations"], est["logits"], True, "", gathered)
    if device.type != "cuda":
        plan.offload, plan.reason = False, "host memory"
    elif free - RESERVE >= plan.need:
        plan.offload, plan.reason = False, (f"free memory less {RESERVE / GIB:.0f} GiB covers the gradients + "
                                            f"{MARGIN}x the micro-batch estimate")
    else:
        plan.reason = (f"free memory {free / GIB:.1f} GiB less {RESERVE / GIB:.0f} GiB < the gradients + {MARGIN}x "
                       "the micro-batch estimate: engine and trainer take turns (sleep/wake around each phase)")
    return plan
