"""Qwen2.5-VL model presets (random weights) and the pieces a VLM needs around the model: the class that builds it,
the tokenizer's image token ids, the image processor of a preset or a directory.

    config = build_vlm_config("tiny-vl")               # Qwen2_5_VLConfig, text part under text_config
    model = auto_model_class(config).from_config(config)   # Qwen2_5_VLForConditionalGeneration

The presets' image token ids are the char-level tokenizer's (`build_tokenizer(vision=True)`), so a preset runs with
that tokenizer; a real Qwen2.5-VL directory brings its own tokenizer, ids and `preprocessor_config.json`.
"""

from __future__ import annotations

import copy

import torch

from rlbench.data.tokenizer import VISION_TOKENS, build_tokenizer
from rlbench.types import ImageInputs

VLM_PRESETS: dict[str, dict] = {
    # A tiny VLM for CPU tests and the synthetic image task: 28 x 28 images are 4 tokens (patch 7, 2 x 2 merge).
    "tiny-vl": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=7,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=28, fullatt_block_indexes=[1]),
        tie_word_embeddings=True, max_side=56,
    ),
    # The published Qwen2.5-VL-3B shapes (random init): the GPU run. 224 x 224 images are 64 tokens.
    "qwen2.5-vl-3b-shape": dict(
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        tie_word_embeddings=True, max_side=224,
    ),
}
"""Qwen2.5-VL presets: text and vision config kwargs, tied embeddings, and the image side the processor resizes to."""


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The Qwen2.5-VL config's token-id fields from a tokenizer holding `VISION_TOKENS`."""
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    return dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), ids))


def build_vlm_config(preset: str, **text_overrides):
    """The `Qwen2_5_VLConfig` of a preset (`text_overrides` go to the text config, e.g. `vocab_size=`)."""
    from transformers import Qwen2_5_VLConfig

    spec = copy.deepcopy(VLM_PRESETS[preset])
    text = spec["text"] | text_overrides
    tokenizer = build_tokenizer(text["vocab_size"], vision=True)
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return Qwen2_5_VLConfig(text_config=text | special, vision_config=spec["vision"],
                            tie_word_embeddings=spec["tie_word_embeddings"], **vision_token_ids(tokenizer))


def is_vlm_config(config) -> bool:
    """A vision-language config (a `vision_config`): built with `AutoModelForImageTextToText`."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """transformers' auto class of a config: `AutoModelForImageTextToText` for a VLM, else `AutoModelForCausalLM`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM


def preset_processor(preset: str, tokenizer):
    """The `VisionProcessor` of a VLM preset: the Qwen2-VL image processor at the preset's patch size."""
    from rlbench.data.images import VisionProcessor, tiny_image_processor

    spec = VLM_PRESETS[preset]
    vision = spec["vision"]
    return VisionProcessor(tiny_image_processor(vision["patch_size"], vision["spatial_merge_size"], spec["max_side"]),
                           tokenizer)


def load_processor(model: str, tokenizer):
    """The `VisionProcessor` of a model directory (its `preprocessor_config.json`) or of a VLM preset name; None for
    a text-only model (prompt rows with images are then refused)."""
    import os

    if os.path.isdir(model):
        from rlbench.data.images import VisionProcessor

        return VisionProcessor.load(model, tokenizer)
    return preset_processor(model, tokenizer) if model in VLM_PRESETS else None


def is_mrope(model: torch.nn.Module) -> bool:
    """Whether `model` is a VLM whose decoder takes M-RoPE positions (it has the HF `get_rope_index`)."""
    return hasattr(getattr(model, "model", None), "get_rope_index")


def image_token_id(model: torch.nn.Module) -> int:
    return int(model.config.image_token_id)


def mrope_positions(model, ids: torch.Tensor, images: ImageInputs | None) -> tuple[torch.Tensor, int]:
    """`(positions [3, L], rope_delta)` of one prompt `ids` `[L]` (device tensor), from the model's `get_rope_index`;
    a prompt without images has `arange(L)` in every row and offset 0."""
    n = ids.shape[0]
    if images is None:
        return torch.arange(n, device=ids.device).expand(3, n), 0
    types = (ids == image_token_id(model)).int()[None]  # [1, L]: 1 on image tokens (mm_token_type_ids)
    pos, delta = model.model.get_rope_index(ids[None], mm_token_type_ids=types,
                                            image_grid_thw=images.image_grid_thw.to(ids.device))
    return pos[:, 0], int(delta.reshape(-1)[0])
