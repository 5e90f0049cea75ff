"""Model construction and loading (Hugging Face format end to end)."""

from rlbench.models.build import build_model, load_model, load_tokenizer, save_pretrained
from rlbench.models.presets import PRESETS, build_config

__all__ = ["PRESETS", "build_config", "build_model", "load_model", "load_tokenizer", "save_pretrained"]
