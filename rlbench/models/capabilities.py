"""What an architecture needs beyond the Qwen3/Llama decoder, read from its own HF config, and which parts of
rlbench compute it exactly: a model is either run as its HF modules compute it or refused when it is loaded,
with one line naming the feature and the option to change (docs/architectures.md has the table).

    feats = model_features(hf_config)                   # also a VLM config (text part under `text_config`)
    check_features(feats, TORCH_ENGINE, max_seq_len=2048)              # raises ValueError, one line
    check_features(feats, trainer("sdpa"), max_seq_len=None)

A consumer (`Consumer`) lists what it refuses: a feature it does not list it computes exactly (tested per
architecture in tests/test_architectures.py). Only transformers' config classes are read here: no model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` values of softmax-attention layers (anything else, e.g. "linear_attention", is a recurrent
or hybrid layer)."""


@dataclass(frozen=True)
class Features:
    """The architecture-specific parts of one model (all off for a plain Qwen3/Qwen2/Llama)."""

    model_type: str
    windows: tuple[int | None, ...] = ()
    """Per decoder layer: its sliding-window length (keys `(q - W, q]`), None for full attention."""
    attention_sinks: bool = False
    """Per-head sink logits in the attention softmax's denominator (gpt-oss `sinks`, passed as `s_aux`)."""
    attn_softcap: float | None = None
    """Attention-score soft-capping `c tanh(s / c)` (Gemma2 `attn_logit_softcapping`)."""
    final_softcap: float | None = None
    """Final-logit soft-capping (Gemma2/3 `final_logit_softcapping`)."""
    layer_rope: bool = False
    """RoPE tables per layer type (Gemma3: local and global `rope_parameters`)."""
    gemma_norm: bool = False
    """RMSNorm scaling by `(1 + w)` (Gemma)."""
    activation: str = "silu"
    """The MLP activation (`hidden_act`, Gemma's `hidden_activation`)."""
    moe: bool = False
    """Mixture-of-experts MLP layers (experts and a router)."""
    other_layers: tuple[str, ...] = ()
    """Layer types that are not softmax attention (Qwen3-Next's "linear_attention": Gated DeltaNet)."""
    vision: bool = False
    """A vision tower (a VLM config with `vision_config`)."""
    type_windows: dict = field(default_factory=dict)
    """With per-layer-type sliding windows (`config.layer_types` has "sliding_attention"): layer type -> its window
    or None (the masks a packed forward passes per type, `backends.attention.layer_type_masks`); else empty."""

    def binding_windows(self, max_seq_len: int | None) -> list[int]:
        """The distinct sliding windows that cut a sequence of `max_seq_len` tokens (None: any length, so every
        window binds). A window >= the longest sequence sees every earlier key: plain causal attention."""
        return sorted({w for w in self.windows if w is not None and (max_seq_len is None or w < max_seq_len)})


def _first(cfg, *names, default=None):
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def model_features(config) -> Features:
    """The `Features` of a transformers config (a causal LM's, or a VLM's whose text model is `text_config`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(text.num_hidden_layers)
    layer_types = list(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types[:n])
    else:  # Mistral, Phi3: one window for every layer when set
        windows = (window,) * n
    rope = getattr(text, "rope_parameters", None)
    experts = _first(text, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    return Features(
        model_type=str(getattr(config, "model_type", "")),
        windows=windows,
        attention_sinks=str(getattr(text, "model_type", "")) == "gpt_oss",
        attn_softcap=getattr(text, "attn_logit_softcapping", None),
        final_softcap=getattr(text, "final_logit_softcapping", None),
        layer_rope=isinstance(rope, dict) and bool(layer_types) and set(layer_types) <= set(rope),
        gemma_norm=str(getattr(text, "model_type", "")).startswith("gemma"),
        activation=str(_first(text, "hidden_activation", "hidden_act", default="silu")),
        moe=bool(experts),
        other_layers=tuple(sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})),
        vision=getattr(config, "vision_config", None) is not None,
        type_windows={t: window if t == "sliding_attention" else None for t in layer_types}
        if "sliding_attention" in layer_types else {},
    )


@dataclass(frozen=True)
class Consumer:
    """A part of rlbench that runs the model, and what it refuses: feature name -> the option to change."""

    name: str
    refuses: dict[str, str] = field(default_factory=dict)


MOE_COMPUTED = ("qwen3_moe", "mixtral")
"""MoE architectures whose routers and experts `rlbench.models.moe` computes (engine, batch-invariant ops,
load-balancing loss); the "moe" feature is any other MoE."""
SGLANG = "use --rollout-engine sglang"
ENGINE_NO_RECURRENT = f"the torch engine keeps no recurrent state per sequence yet; {SGLANG}"
SGLANG_NO_VISION = ("the SGLang adapter passes token ids only (no pixel values); use --rollout-engine torch for a "
                    "vision-language model")
NO_HYBRID_TRAINING = ("packed training would carry the recurrent state across samples; no rlbench trainer runs "
                      "these layers yet")

TORCH_ENGINE = Consumer("the torch engine", {"other_layers": ENGINE_NO_RECURRENT})
SGLANG_ENGINE = Consumer("the SGLang engine adapter", {"vision": SGLANG_NO_VISION})
MEGATRON = Consumer("the megatron backend", {
    name: "the megatron conversion maps the Qwen3/Qwen2/Llama decoder only; use --train-backend fsdp"
    for name in ("sliding_window", "attention_sinks", "attn_softcap", "final_softcap", "layer_rope", "gemma_norm",
                 "moe", "other_layers", "vision")})
BATCH_INVARIANT = "the batch-invariant ops (true on-policy mode) do not cover it; run without --true-on-policy-mode"
TRUE_ON_POLICY = Consumer("true on-policy mode", {
    name: BATCH_INVARIANT for name in ("sliding_window", "attention_sinks", "attn_softcap", "final_softcap",
                                       "layer_rope", "gemma_norm", "activation", "moe_uncomputed", "other_layers",
                                       "vision")})
TRUE_ON_POLICY_TRAINER = Consumer(TRUE_ON_POLICY.name,
                                  {k: v for k, v in TRUE_ON_POLICY.refuses.items() if k != "sliding_window"})
"""True on-policy mode as a trainer alone sees it: it does not know the run's longest sequence, so a window is
refused by the batch-invariant attention at the forward where it binds (`numerics.model`), and by the run's and the
engine's checks (`check_run`, the engine) at build time."""


def trainer(attention: str, cp_size: int = 1) -> Consumer:
    """The FSDP trainer's packed forward with `attention` (`TrainConfig.attention`) at context-parallel size
    `cp_size`. transformers builds the sliding-window masks of packed rows from their position ids (sdpa, eager,
    flex: `backends.attention`); sdpa has no soft-capping or sinks, flash attention no sinks, and the CP attention
    (`rlbench_cp`, ring-flash) none of the three."""
    eager = "use --attn-implementation eager" + (" (or flex_attention)" if attention.startswith("flash") else "")
    refuses = {"other_layers": NO_HYBRID_TRAINING}
    if cp_size > 1:
        cp = "the context-parallel attention has no windows, soft-capping or sinks; use --context-parallel-size 1"
        refuses |= {name: cp for name in ("sliding_window", "attn_softcap", "attention_sinks")}
        refuses["vision"] = ("the context-parallel slices carry no images (pixel values, M-RoPE positions); use "
                             "--context-parallel-size 1")
        return Consumer(f"the FSDP trainer (context_parallel_size={cp_size})", refuses)
    if attention == "sdpa":
        refuses |= {"attn_softcap": f"attn_implementation='sdpa' has no soft-capping; {eager}",
                    "attention_sinks": f"attn_implementation='sdpa' has no attention sinks; {eager}"}
    elif attention.startswith("flash_attention"):
        refuses |= {"attention_sinks": f"attn_implementation={attention!r} has no attention sinks; {eager}"}
    return Consumer(f"the FSDP trainer (attn_implementation={attention!r})", refuses)


def describe(feats: Features, name: str, max_seq_len: int | None) -> str:
    """The feature `name` of this model, in words."""
    if name == "sliding_window":
        windows = feats.binding_windows(max_seq_len)
        longest = f" < max_seq_len={max_seq_len}" if max_seq_len is not None else ""
        return f"sliding-window attention (window {', '.join(map(str, windows))}{longest})"
    return {
        "attention_sinks": "attention sinks (gpt-oss s_aux)",
        "attn_softcap": f"attention logit soft-capping ({feats.attn_softcap})",
        "final_softcap": f"final-logit soft-capping ({feats.final_softcap})",
        "layer_rope": "per-layer-type RoPE (local/global rope_parameters)",
        "gemma_norm": "Gemma (1 + w) RMSNorm",
        "activation": f"MLP activation {feats.activation!r}",
        "moe": "mixture-of-experts layers",
        "moe_uncomputed": f"mixture-of-experts layers (rlbench computes those of {', '.join(MOE_COMPUTED)} only)",
        "other_layers": f"layer types {list(feats.other_layers)} (hybrid linear attention)",
        "vision": "a vision tower (VLM)",
    }[name]


def present(feats: Features, max_seq_len: int | None) -> list[str]:
    """The feature names this model has (sliding windows only where they bind at `max_seq_len`)."""
    flags = {
        "sliding_window": bool(feats.binding_windows(max_seq_len)),
        "attention_sinks": feats.attention_sinks,
        "attn_softcap": feats.attn_softcap is not None,
        "final_softcap": feats.final_softcap is not None,
        "layer_rope": feats.layer_rope,
        "gemma_norm": feats.gemma_norm,
        "activation": feats.activation != "silu",
        "moe": feats.moe,
        "moe_uncomputed": feats.moe and feats.model_type not in MOE_COMPUTED,
        "other_layers": bool(feats.other_layers),
        "vision": feats.vision,
    }
    return [name for name, on in flags.items() if on]


def check_features(feats: Features, consumer: Consumer, max_seq_len: int | None) -> None:
    """Raise `ValueError` (one line: the model, the feature, the consumer, the option) for the first feature of
    `feats` that `consumer` refuses. `max_seq_len`: the longest sequence the consumer runs (None: unknown, every
    sliding window binds)."""
    for name in present(feats, max_seq_len):
        if name in consumer.refuses:
            raise ValueError(f"{feats.model_type} {describe(feats, name, max_seq_len)}: {consumer.name} does not "
                             f"implement it; {consumer.refuses[name]}")


def check_model(config, consumer: Consumer, max_seq_len: int | None) -> Features:
    """`check_features(model_features(config), ...)`; returns the features."""
    feats = model_features(config)
    check_features(feats, consumer, max_seq_len)
    return feats


def run_consumers(cfg) -> list[tuple[Consumer, int | None]]:
    """The consumers of a run config (`RunConfig`) with the longest sequence each runs."""
    n = cfg.engine.max_seq_len
    out = [(SGLANG_ENGINE if cfg.rollout_engine == "sglang" else TORCH_ENGINE, n),
           (MEGATRON if cfg.train_backend == "megatron" else trainer(cfg.backend.attention, cfg.backend.cp_size), n)]
    return out + ([(TRUE_ON_POLICY, n)] if cfg.true_on_policy_mode else [])


def check_run(cfg, config=None) -> Features:
    """Refuse (one line) a run config whose rollout engine, trainer or true on-policy mode does not implement a
    feature of its model (`config`: the model's HF config; None reads `cfg.backend.model`'s); returns the
    features."""
    if config is None:
        import os

        from transformers import AutoConfig

        from rlbench.models.presets import build_config

        model, overrides = cfg.backend.model, cfg.backend.model_overrides
        config = AutoConfig.from_pretrained(model) if os.path.isdir(model) else build_config(model, **overrides)
    feats = model_features(config)
    for consumer, max_seq_len in run_consumers(cfg):
        check_features(feats, consumer, max_seq_len)
    return feats
