"""Model presets: Qwen3 tiny/small for CPU work, the real Qwen3 shapes for the GPU, and Qwen3-MoE shapes
(`"model_type": "qwen3_moe"` in the entry: a `Qwen3MoeConfig`, every layer sparse)."""

from __future__ import annotations

import copy
import os

from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig

_QWEN3_COMMON = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)

# The CPU presets' vocab_size=128 is exactly `len(rlbench.data.build_tokenizer())` (char-level ASCII,
# Qwen special tokens, reserved tokens up to 128), so `build_model("small")` lines up with it.
PRESETS: dict[str, dict] = {
    # < 1 M parameters with a small vocabulary: unit tests on CPU.
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # A few M parameters: the CPU demo (SFT warm start, then GRPO in minutes).
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # The published Qwen3-0.6B hyper-parameters (random init): GPU memory/throughput work.
    "qwen3-0.6b-shape": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    # The published Qwen3-4B hyper-parameters (random init).
    "qwen3-4b-shape": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    # A Qwen3-MoE (Qwen3-30B-A3B's layout: 8 of E experts per token, renormalised) scaled to ~0.68 B parameters:
    # 12 layers of 64 experts (moe_intermediate 192) at hidden 1024, Qwen3-0.6B's attention and vocabulary;
    # 0.29 B active per token (0.16 B of it the tied embedding). Random init: engine and training throughput.
    "qwen3-moe-0.6b-shape": dict(
        model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, moe_intermediate_size=192,
        num_experts=64, num_experts_per_tok=8, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    # The same layout at CPU size (4 experts, 2 per token; the CPU tokenizer's vocabulary).
    "tiny-moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
}

_MOE_COMMON = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
CONFIG_CLASSES = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}


def build_config(preset: str, **overrides) -> PretrainedConfig:
    """A `Qwen3Config` (`Qwen3MoeConfig` for the MoE presets) for a preset name, with keyword overrides (e.g.
    `vocab_size=` of a tokenizer); a VLM preset (`rlbench.models.vlm.VLM_PRESETS`) gives its `Qwen2_5_VLConfig`
    (the overrides apply to its text config).

    Raises:
        ValueError: not a preset name (the message lists the known ones and says it is no directory either).
    """
    from rlbench.models.vlm import VLM_PRESETS, build_vlm_config

    if preset in VLM_PRESETS:
        return build_vlm_config(preset, **overrides)
    if preset not in PRESETS:
        raise ValueError(f"model {preset!r} is neither an existing directory (from {os.getcwd()}) nor a model "
                         f"preset; give a Hugging Face model directory or one of {sorted(PRESETS) + sorted(VLM_PRESETS)}")
    kwargs = copy.deepcopy(_QWEN3_COMMON) | copy.deepcopy(PRESETS[preset]) | overrides
    model_type = kwargs.pop("model_type", "qwen3")
    if model_type == "qwen3_moe":
        kwargs = _MOE_COMMON | kwargs
    return CONFIG_CLASSES[model_type](**kwargs)
