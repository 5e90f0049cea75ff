"""Hugging Face Qwen3 / Qwen2 / Llama weights <-> megatron-core GPTModel (local layer spec), with TP and PP splits.

Pure torch; nothing here imports megatron. The megatron-core layout (checked against 0.16.1):
- `linear_qkv` is group-major: for each kv group g, [q heads of g, k_g, v_g]. A contiguous TP chunk is whole groups.
- `linear_fc1` is cat([gate, up]); TP rank r holds cat([gate_r, up_r]), not a plain chunk of the full tensor.
- Column-parallel (dim 0): linear_qkv, linear_fc1, word_embeddings, output_layer. Row-parallel (dim 1):
  linear_proj, linear_fc2. Norms are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

_QK_NORM = {"qwen3": True, "qwen2": False, "llama": False}  # supported HF model_type -> has q/k norms
_LAYER, _HF_LAYER = "decoder.layers.{}.", "model.layers.{}."
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_QKV = tuple(f"self_attn.{p}_proj" for p in "qkv")
_QKV_NAMES = ("linear_qkv.weight", "linear_qkv.bias")
# megatron per-layer suffix -> HF per-layer suffixes (three for qkv, two for fc1)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": tuple(f"{p}.weight" for p in _QKV),
    "self_attention.linear_qkv.bias": tuple(f"{p}.bias" for p in _QKV),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
_GLOBAL_MAP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# last two name components -> TP split dim; anything known and absent here is replicated
_TP_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "word_embeddings.weight": 0,
           "output_layer.weight": 0, "linear_proj.weight": 1, "linear_fc2.weight": 1}


@dataclass(frozen=True)
class Layout:
    """The shapes the conversion needs."""

    num_layers: int  # transformer layers in the whole model
    hidden: int  # model width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (megatron's num_query_groups)
    head_dim: int  # per-head width (megatron's kv_channels)
    ffn: int  # MLP intermediate size
    vocab: int  # rows of the embedding / output layer
    tied: bool  # output layer shares the embedding (HF tie_word_embeddings)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    qkv_bias: bool  # q/k/v projections have a bias (Qwen2)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                             "fix the config so each kv group has the same number of query heads")

    @classmethod
    def from_hf_config(cls, cfg) -> Layout:
        """The layout of a transformers Qwen3Config / Qwen2Config / LlamaConfig."""
        if cfg.model_type not in _QK_NORM:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported; use one of {sorted(_QK_NORM)}")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("attention_bias/mlp_bias put a bias on o_proj or the MLP, which the megatron conversion "
                             "does not map (add_qkv_bias covers q/k/v only); use a config with both False")
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: only the SwiGLU MLP (silu) is mapped")
        heads = cfg.num_attention_heads
        return cls(num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   ffn=cfg.intermediate_size, vocab=cfg.vocab_size, tied=bool(cfg.tie_word_embeddings),
                   qk_norm=_QK_NORM[cfg.model_type], qkv_bias=cfg.model_type == "qwen2")


def split_name(name: str) -> tuple[int | None, str]:
    """`decoder.layers.{i}.rest` -> (i, rest); any other name -> (None, name)."""
    m = _LAYER_RE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def _layer_suffixes(layout: Layout) -> list[str]:
    qk_norms = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
    return [s for s in _LAYER_MAP if (layout.qk_norm or s not in qk_norms) and (layout.qkv_bias or "bias" not in s)]


def mcore_keys(layout: Layout) -> list[str]:
    """The full (unsharded, one-stage) megatron state-dict names."""
    layers = [_LAYER.format(i) + s for i in range(layout.num_layers) for s in _layer_suffixes(layout)]
    tail = [] if layout.tied else ["output_layer.weight"]
    return ["embedding.word_embeddings.weight", *layers, "decoder.final_layernorm.weight", *tail]


def _known(name: str) -> tuple[int | None, str]:
    layer, suffix = split_name(name)
    if suffix not in (_GLOBAL_MAP if layer is None else _LAYER_MAP):
        raise ValueError(f"unknown megatron parameter {name!r}; known: {sorted(_GLOBAL_MAP)} and decoder.layers.<i>."
                         f"<one of {sorted(_LAYER_MAP)}>")
    return layer, suffix


def _hf_names(name: str, layout: Layout, layer_offset: int = 0) -> tuple[str, ...]:
    layer, suffix = _known(name)
    if layer is None:
        return (_GLOBAL_MAP[name],)
    if not 0 <= layer + layer_offset < layout.num_layers:
        raise ValueError(f"{name!r} with layer_offset={layer_offset} is past num_layers={layout.num_layers}; "
                         "pass the stage's first global layer index as layer_offset")
    return tuple(_HF_LAYER.format(layer + layer_offset) + s for s in _LAYER_MAP[suffix])


def hf_keys(layout: Layout) -> list[str]:
    """The HF state-dict names (no `lm_head.weight` when tied)."""
    return [n for name in mcore_keys(layout) for n in _hf_names(name, layout)]


def _check_keys(got, expected, what: str) -> None:
    unknown, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    if unknown or missing:
        raise ValueError(f"{what} state dict does not match the Layout: unknown keys {unknown}, missing keys "
                         f"{missing}; check num_layers/tied/qk_norm/qkv_bias against the checkpoint")


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, layout: Layout) -> Tensor:
    # [n*hn, ...] -> [ng, heads_in_group*hn, ...]; per group [q_g, k_g, v_g]; back to [ng*(np/ng+2)*hn, ...]
    parts = [t.reshape(layout.num_kv_heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv: Tensor, layout: Layout) -> list[Tensor]:
    ng, hn = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // ng
    groups = qkv.reshape(ng, (per_group + 2) * hn, *qkv.shape[1:])
    return [t.reshape(-1, *qkv.shape[1:]) for t in groups.split([per_group * hn, hn, hn], dim=1)]


def hf_to_mcore(hf: dict[str, Tensor], layout: Layout) -> dict[str, Tensor]:
    """Full HF state dict -> full megatron state dict (unsharded). A tied `lm_head.weight` alias is accepted."""
    hf = dict(hf)
    if layout.tied and "lm_head.weight" in hf:
        lm_head = hf.pop("lm_head.weight")
        if "model.embed_tokens.weight" in hf and not torch.equal(lm_head, hf["model.embed_tokens.weight"]):
            raise ValueError("Layout is tied but lm_head.weight differs from model.embed_tokens.weight; "
                             "use Layout(tied=False) for this checkpoint")
    _check_keys(hf, hf_keys(layout), "HF")
    out = {}
    for name in mcore_keys(layout):
        parts = [hf[n] for n in _hf_names(name, layout)]
        if name.endswith(_QKV_NAMES):
            out[name] = _fuse_qkv(*parts, layout)
        else:
            out[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out


def mcore_param_to_hf(name: str, tensor_full: Tensor, layout: Layout, layer_offset: int = 0) -> list[tuple[str, Tensor]]:
    """One full (TP-gathered) megatron tensor with a stage-local name -> its HF (name, tensor) pairs.

    `layer_offset` is the stage's first global layer index. The last stage's tied `output_layer.weight`
    copy gives no pairs (HF has only `model.embed_tokens.weight`).
    """
    if name == "output_layer.weight" and layout.tied:
        return []
    hf_names = _hf_names(name, layout, layer_offset)
    if name.endswith(_QKV_NAMES):
        parts = _split_qkv(tensor_full, layout)
    elif name.endswith("linear_fc1.weight"):
        parts = tensor_full.chunk(2)
    else:
        parts = [tensor_full]
    return list(zip(hf_names, parts, strict=True))


def mcore_to_hf(mc: dict[str, Tensor], layout: Layout) -> dict[str, Tensor]:
    """Full megatron state dict -> full HF state dict (no `lm_head.weight` when tied)."""
    _check_keys(mc, mcore_keys(layout), "megatron")
    return {n: t for name, tensor in mc.items() for n, t in mcore_param_to_hf(name, tensor, layout)}


def tp_partition_dim(name: str) -> int | None:
    """The TP split dim of a megatron parameter: 0 column-parallel, 1 row-parallel, None replicated."""
    _known(name)
    return _TP_DIM.get(".".join(name.split(".")[-2:]))


def _check_tp(layout: Layout, tp_size: int) -> None:
    if layout.num_kv_heads % tp_size:
        raise ValueError(f"num_kv_heads={layout.num_kv_heads} is not divisible by tp_size={tp_size}; each TP rank "
                         "needs whole kv groups: use a tp_size that divides num_kv_heads")
    for what, n in (("vocab", layout.vocab), ("ffn", layout.ffn)):
        if n % tp_size:
            raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}; use a tp_size that divides it"
                             + (" or pad the vocabulary to a multiple of it" if what == "vocab" else ""))


def shard_tp_param(name: str, full: Tensor, layout: Layout, tp_size: int, tp_rank: int) -> Tensor:
    """This TP rank's local piece of one full megatron parameter (a view where possible)."""
    dim = tp_partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return full.chunk(tp_size, dim)[tp_rank]


def gather_tp_param(name: str, shards: list[Tensor], layout: Layout) -> Tensor:
    """One full megatron parameter from its TP shards, in rank order."""
    _check_tp(layout, len(shards))
    dim = tp_partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(shards, dim)


def shard_tp(mc: dict[str, Tensor], layout: Layout, tp_size: int, tp_rank: int) -> dict[str, Tensor]:
    """This TP rank's local tensors of a megatron state dict (the full model or one PP stage)."""
    _check_tp(layout, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside [0, tp_size={tp_size})")
    return {name: shard_tp_param(name, t, layout, tp_size, tp_rank) for name, t in mc.items()}


def gather_tp(shards: list[dict[str, Tensor]], layout: Layout) -> dict[str, Tensor]:
    """The full megatron state dict (or PP stage) from every TP rank's local state dict, in rank order."""
    for rank, shard in enumerate(shards[1:], start=1):
        _check_keys(shard, shards[0], f"TP rank {rank} (against rank 0)")
    return {name: gather_tp_param(name, [s[name] for s in shards], layout) for name in shards[0]}


def stage_layers(layout: Layout, pp_size: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """The global layer indices of each PP stage: even split, or `layers_per_stage` counts."""
    if layers_per_stage is None:
        if layout.num_layers % pp_size:
            raise ValueError(f"num_layers={layout.num_layers} is not divisible by pp_size={pp_size}; "
                             "pass layers_per_stage=[...] with one count per stage")
        layers_per_stage = [layout.num_layers // pp_size] * pp_size
    if len(layers_per_stage) != pp_size or sum(layers_per_stage) != layout.num_layers or min(layers_per_stage) < 0:
        raise ValueError(f"layers_per_stage={layers_per_stage} needs {pp_size} non-negative counts summing to "
                         f"num_layers={layout.num_layers}")
    starts = [sum(layers_per_stage[:i]) for i in range(pp_size)]
    return [range(s, s + n) for s, n in zip(starts, layers_per_stage, strict=True)]


def shard_pp(mc: dict[str, Tensor], layout: Layout, pp_size: int, pp_rank: int,
             layers_per_stage: list[int] | None = None) -> dict[str, Tensor]:
    """One PP stage of a (full or TP-local) megatron state dict, with stage-local layer numbering.

    Stage 0 holds the embedding, the last stage the final norm and output layer; with tied embeddings and
    pp_size > 1 the last stage's `output_layer.weight` is the embedding tensor itself (megatron keeps it synced).
    """
    _check_keys(mc, mcore_keys(layout), "megatron")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, pp_size={pp_size})")
    layers = stage_layers(layout, pp_size, layers_per_stage)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for name, t in mc.items():
        layer, suffix = split_name(name)
        if layer is not None:
            if layer in layers:
                out[_LAYER.format(layer - layers.start) + suffix] = t
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = t
            if last and layout.tied and pp_size > 1:
                out["output_layer.weight"] = t
        elif last:
            out[name] = t
    return out


def gather_pp(stages: list[dict[str, Tensor]], layout: Layout) -> dict[str, Tensor]:
    """The megatron state dict from every PP stage's state dict, in stage order (layer counts read from the keys)."""
    out, offset = {}, 0
    for rank, stage in enumerate(stages):
        count = 0
        for name, t in stage.items():
            layer, suffix = split_name(name)
            if layer is not None:
                name, count = _LAYER.format(layer + offset) + suffix, max(count, layer + 1)
            elif name == "output_layer.weight" and layout.tied and len(stages) > 1 and rank == len(stages) - 1:
                continue  # the last stage's copy of the tied embedding
            if name in out:
                raise ValueError(f"{name!r} appears on more than one PP stage; pass each stage's own state dict once")
            out[name] = t
        offset += count
    _check_keys(out, mcore_keys(layout), "gathered megatron")
    return out
