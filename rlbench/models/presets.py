"""Qwen3-architecture model presets: tiny/small for CPU work, the real Qwen3 shapes for the GPU."""

from __future__ import annotations

import copy
import os

from transformers import Qwen3Config

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
}


def build_config(preset: str, **overrides) -> Qwen3Config:
    """A `Qwen3Config` for a preset name, with keyword overrides (e.g. `vocab_size=` of a tokenizer); a VLM preset
    (`rlbench.models.vlm.VLM_PRESETS`) gives its `Qwen2_5_VLConfig` (the overrides apply to its text config).

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
    return Qwen3Config(**kwargs)
