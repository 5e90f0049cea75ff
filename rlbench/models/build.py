"""Build a Qwen3-architecture model from a preset, or load any local Hugging Face causal-LM directory."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from rlbench.models.presets import build_config


def build_model(
    preset_or_config: str | PretrainedConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    meta: bool = False,
    attn_implementation: str = "sdpa",
    **overrides,
) -> PreTrainedModel:
    """A randomly initialised causal LM.

    Args:
        preset_or_config: a preset name from `PRESETS` or a transformers config.
        device: where the parameters live (ignored when `meta`).
        dtype: parameter dtype.
        seed: torch seed for the initialisation (same seed -> same weights).
        meta: construct on the meta device (no memory; FSDP materialises shards later).
        attn_implementation: passed to transformers ("sdpa", "eager", "flex_attention", ...).
        overrides: config fields for a preset (e.g. `vocab_size=`).
    """
    if isinstance(preset_or_config, str):
        config = build_config(preset_or_config, **overrides)
    elif overrides:
        raise ValueError(
            f"overrides {sorted(overrides)} only apply to a preset name; set them on the config object instead"
        )
    else:
        config = copy.deepcopy(preset_or_config)  # never mutate the caller's config
    config._attn_implementation = attn_implementation
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    # Initialise directly on the target device: random init of a 0.6B model on the host CPU takes ~30 s.
    # The same seed gives the same weights on the same device type (CPU and CUDA generators differ).
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model


def load_model(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a local HF causal-LM directory (config.json + safetensors)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is not a Hugging Face model directory (no config.json); pass a local HF dir")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device)


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer saved beside a model (a standard fast tokenizer with a chat template)."""
    return AutoTokenizer.from_pretrained(path)


def save_pretrained(model: PreTrainedModel, tokenizer, path: str | os.PathLike) -> None:
    """Write a standard HF directory (safetensors) that `from_pretrained` loads.

    Tied embeddings are stored once (`lm_head.weight` is not written) and re-tied on load. A
    model vocabulary larger than the tokenizer is fine (as in Qwen's padded embedding); a smaller
    one raises.
    """
    vocab = model.config.get_text_config().vocab_size
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}; "
            "build the model with vocab_size=len(tokenizer)"
        )
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


@contextlib.contextmanager
def params_on_meta():
    """Inside, parameters are created on the meta device and buffers (rotary `inv_freq`, ...) on the CPU with their
    real values: a model of any size is built at once, and every copy of it computes its buffers the same way
    (on the CPU: a CUDA `pow` can round `inv_freq` differently, which moves RoPE, K/V and every log-prob)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A `params_on_meta` model on `device`: parameters allocated uninitialised (tied ones tied again), buffers
    keeping their values."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # meta -> device makes new Parameters: `lm_head` would no longer share the embedding
    restore_buffers(model, buffers, device)
    return model


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device | str) -> None:
    """Put saved buffer values (`{name: tensor}`, e.g. taken before `to_empty`) back into `model`, on `device`."""
    for full_name, value in buffers.items():
        owner, _, leaf = full_name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = value.to(device)
