"""Mixture-of-experts layers of transformers' Qwen3-MoE and Mixtral, computed by rlbench: the routing and the
experts with pluggable matmuls, so the engine (static shapes, no host sync at decode) and the true on-policy mode
(`rlbench.numerics`: the batch-invariant GEMMs in the engine and the trainer alike) run the same math as HF.

The modules stay HF's: a sparse block calls its router (`gate`: `[N, D]` -> (logits `[N, E]`, weights `[N, k]`,
expert index `[N, k]`)) and its experts (`experts(x [N, D], index, weights) -> [N, D]`, fused weights
`gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`). `patch_moe(model, linear, silu)` re-points those two forwards
per instance; the block's own forward (and transformers' router-logit recording, which the load-balancing loss
reads) is unchanged.

Each token's output is its top-k expert outputs weighted and summed in the router's slot order, in float32, then
cast: per row, whatever else is in the batch. With a row-invariant `linear` (`rlbench.numerics.ops.linear`) the
two expert schedules below give the same bits:
- `DENSE_MAX_TOKENS` tokens or fewer (a decode step): every expert runs on every token, static shapes, no host
  sync (CUDA-graph capturable); E/k times the expert FLOPs of the routed tokens, on batches where reading the
  expert weights dominates anyway.
- more (prefill, training): the tokens are grouped by expert (one host sync for the group sizes) and each
  expert runs on its own tokens only.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DENSE_MAX_TOKENS = 256
"""At most this many tokens: every expert on every token (static shapes); above it, tokens grouped by expert."""

ROUTERS = {"Qwen3MoeTopKRouter": "qwen3", "MixtralTopKRouter": "mixtral"}
"""HF router classes `router_forward` reproduces: softmax in float32, top-k, renormalised (Qwen3: when
`norm_topk_prob`, then cast to the logits' dtype; Mixtral: always, kept in float32)."""

EXPERTS = ("Qwen3MoeExperts", "MixtralExperts")
"""HF expert classes `experts_forward` reproduces: SiLU-gated MLPs over `gate_up_proj` / `down_proj`, no bias."""


def is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter")


def is_experts(module: nn.Module) -> bool:
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and type(module).__name__.endswith("Experts")


def has_moe(model: nn.Module) -> bool:
    return any(is_experts(m) for m in model.modules())


def router_forward(router: nn.Module, x: torch.Tensor, linear: Callable = F.linear):
    """HF's router with `linear` for its GEMM: x `[N, D]` -> (logits `[N, E]`, weights `[N, k]`, index `[N, k]`)."""
    kind = ROUTERS[type(router).__name__]
    x = x.reshape(-1, router.weight.shape[1])
    logits = linear(x, router.weight, None)  # [N, E]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, index = torch.topk(probs, router.top_k, dim=-1)  # [N, k]
    if kind == "mixtral" or router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if kind == "qwen3":
        weights = weights.to(logits.dtype)
    return logits, weights, index


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, linear: Callable, silu: Callable):
    """One SiLU-gated expert: x `[M, D]`, gate_up `[2I, D]`, down `[D, I]` -> `[M, D]`."""
    gate, up = linear(x, gate_up, None).chunk(2, dim=-1)
    return linear(silu(gate) * up, down, None)


def _dense_pairs(experts: nn.Module, x, index, linear, silu) -> torch.Tensor:
    """Every expert on every token; each (token, slot) keeps its expert's row: `[N, k, D]`."""
    pairs = x.new_zeros(*index.shape, x.shape[-1])
    if linear is F.linear:  # two batched GEMMs over all experts
        h = torch.matmul(x, experts.gate_up_proj.transpose(1, 2))  # [E, N, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.matmul(silu(gate) * up, experts.down_proj.transpose(1, 2))  # [E, N, D]
        for e in range(y.shape[0]):
            pairs = torch.where((index == e)[..., None], y[e][:, None, :], pairs)
        return pairs
    for e in range(experts.gate_up_proj.shape[0]):
        y = _expert(x, experts.gate_up_proj[e], experts.down_proj[e], linear, silu)  # [N, D]
        pairs = torch.where((index == e)[..., None], y[:, None, :], pairs)
    return pairs


def _grouped_pairs(experts: nn.Module, x, index, linear, silu) -> torch.Tensor:
    """Each expert on its own tokens (grouped by a stable sort; one host sync for the sizes): `[N, k, D]`."""
    n, k = index.shape
    flat = index.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)
    sizes = torch.bincount(flat, minlength=experts.gate_up_proj.shape[0]).tolist()
    pairs = x.new_zeros(n * k, x.shape[-1])
    start = 0
    for e, size in enumerate(sizes):
        if size:
            rows = order[start : start + size]
            y = _expert(x[rows // k], experts.gate_up_proj[e], experts.down_proj[e], linear, silu)
            pairs = pairs.index_put((rows,), y)
            start += size
    return pairs.view(n, k, -1)


def experts_forward(experts: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                    linear: Callable = F.linear, silu: Callable = F.silu) -> torch.Tensor:
    """HF's experts: x `[N, D]`, index/weights `[N, k]` (the router's) -> `[N, D]` in x's dtype."""
    schedule = _dense_pairs if x.shape[0] <= DENSE_MAX_TOKENS else _grouped_pairs
    pairs = schedule(experts, x, index, linear, silu)  # [N, k, D]
    w = weights.float()
    out = pairs[:, 0].float() * w[:, :1]
    for j in range(1, index.shape[1]):  # the router's slot order, one add at a time: row-local rounding
        out = out + pairs[:, j].float() * w[:, j : j + 1]
    return out.to(x.dtype)


def patch_moe(model: nn.Module, linear: Callable = F.linear, silu: Callable = F.silu, *, strict: bool = True) -> int:
    """Re-point every MoE router and experts module of `model` to `router_forward` / `experts_forward` with these
    ops, in place; returns how many modules. A router or experts class not reproduced here raises when `strict`
    (the batch-invariant ops must cover every GEMM), else keeps HF's own forward (the engine's default path)."""
    if has_moe(model) and getattr(model.config, "hidden_act", "silu") != "silu":
        if strict:
            raise ValueError(f"rlbench's MoE experts compute hidden_act='silu'; the model has "
                             f"{model.config.hidden_act!r}")
        return 0
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if is_router(module) or is_experts(module):
            known = name in ROUTERS or (name in EXPERTS and not getattr(module, "has_bias", False))
            if not known:
                if strict:
                    raise ValueError(f"the MoE module {name} is not supported (rlbench computes the routers "
                                     f"{sorted(ROUTERS)} and the experts {list(EXPERTS)})")
                continue
            fn = router_forward if is_router(module) else experts_forward
            kwargs = {"linear": linear} if is_router(module) else {"linear": linear, "silu": silu}
            module.forward = functools.partial(fn, module, **kwargs)
            count += 1
    return count


def load_balancing_loss(model: nn.Module, router_logits: tuple[torch.Tensor, ...], real: torch.Tensor) -> torch.Tensor:
    """The model architecture's own router load-balancing loss (transformers' `load_balancing_loss_func` of its
    modeling module: E * sum_e (fraction of top-k slots routed to e) * (mean router probability of e)) over the
    tokens where `real` `[T]` is true (a pack's padding routes too, but is no data).

    Args:
        model: the HF MoE causal LM (FSDP-wrapped or not) that returned `router_logits` (`output_router_logits=True`).
        router_logits: one `[T, E]` per MoE layer.
    """
    hf = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")), None)
    fn = getattr(importlib.import_module(hf.__module__), "load_balancing_loss_func", None) if hf else None
    if fn is None or not hasattr(model, "num_experts"):
        raise ValueError(f"{type(model).__name__} has no router load-balancing loss (is it a transformers MoE "
                         "causal LM?); set moe_aux_loss_coef=0")
    return fn(router_logits, model.num_experts, model.num_experts_per_tok, real[None].to(router_logits[0].device))
