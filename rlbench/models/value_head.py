"""Value models: an HF decoder with a scalar head, one number per position (the PPO critic and the reward model).

    model = load_value_model("runs/sft")                       # a causal-LM dir: its decoder + a zero head
    values = token_values(model, input_ids, position_ids)      # [B, T] fp32, one value per position
    version = save_value_model(model, tokenizer, "runs/rm", {"kind": "reward"})
    model = load_value_model("runs/rm", require_head=True)     # a value-model dir (`rlbench rm` or a critic)

The model is transformers' `*ForTokenClassification` with one label and no dropout (`value_config`): the decoder
and `score = Linear(hidden, 1)` over its last hidden state (after the final norm), no LM head; the layout of verl's
critic and reward models. `rlbench rm` writes it, the FSDP critic (`build_sharded_model(value_head=True)`) trains
and exports it, so `--critic-load` takes a reward model and `--reward-model` a critic export, and
`AutoModelForTokenClassification.from_pretrained(DIR)` loads either.

Initialisation (one rule for both): a head not loaded from a directory (a causal-LM directory or a preset) starts
at zero, weight and bias (`zero_head_`). Every value is 0 at first (a critic's V = 0, a Bradley-Terry loss of log 2),
no random draw is made, so the start is the same for any seed and world size. The first step's gradient reaches
only the head (the backbone's gradient flows through the head's weight); from the second step on both move.

Packed input works as in the trainer: one `[1, T]` row with `position_ids` restarting per sequence and no attention
mask (transformers builds the per-document causal mask; `use_cache=False`).

On-disk layout (`save_value_model`):

    DIR/config.json          architectures [<Arch>ForTokenClassification], num_labels 1, classifier_dropout 0.0
    DIR/model*.safetensors   the decoder (`model.*`) and the head (`score.weight` [1, H], `score.bias` [1])
    DIR/tokenizer files      when saved with one (a reward model must have them: it scores text)
    DIR/version.json         {"format": 2, "version": "<16 hex>", "kind": "reward" | "critic", ...writer's meta}

The stamp is a file beside the weights, not fields of config.json: transformers carries a config's extra fields
through every load and save, so a model trained further from this directory would keep a stale stamp. `version` is
the first 16 hex digits of the SHA-256 of every `*.safetensors` file in the directory (sorted by name), so two
directories with the same weights carry the same version and any changed weight changes it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, PretrainedConfig, PreTrainedModel

from rlbench.models.build import save_pretrained
from rlbench.models.presets import build_config

VALUE_HEAD = "score"
"""The head's parameter prefix (transformers' `*ForTokenClassification`)."""
STAMP_FILE = "version.json"
"""The version stamp beside the weights: format, version, kind and what the writer added."""
FORMAT = 2


def value_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a causal-LM (or value-model) config made a value model's: one label, no classifier dropout (it
    would make values random in train mode)."""
    config = copy.deepcopy(config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    config.use_cache = False
    return config


@torch.no_grad()
def zero_head_(model: torch.nn.Module) -> None:
    """The initialisation rule of the module docstring: the `score` head's weight and bias to 0 (plain or sharded
    parameters)."""
    for name, param in model.named_parameters():
        if name.startswith(f"{VALUE_HEAD}."):
            param.zero_()


def value_dir_problem(path: str | os.PathLike) -> str | None:
    """None when `path` is a value-model directory (config.json of a token-classification model with one label),
    else what it is instead (for an error message)."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isdir(os.fspath(path)):
        return "is no directory"
    if not os.path.isfile(file):
        return "has no config.json"
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)  # transformers' rule
    if not any(a.endswith("ForTokenClassification") for a in archs):
        return (f"holds {archs or 'a model without architectures'}, not a value model (a ForTokenClassification "
                "with one label): it has no trained head")
    if labels != 1:
        return f"holds {archs} with {labels} labels, not a value model (one label: a scalar head)"
    return None


def build_value_model(preset: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      seed: int = 0, attn_implementation: str = "sdpa", **overrides) -> PreTrainedModel:
    """A preset's value model: the decoder initialised as `rlbench.models.build_model` does (torch seeded with
    `seed`, the caller's RNG state kept), the head at zero."""
    config = value_config(build_config(preset, **overrides))
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_config(config, dtype=dtype,
                                                            attn_implementation=attn_implementation)
    zero_head_(model)
    return model


def load_value_model(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                     require_head: bool = False) -> PreTrainedModel:
    """Load a value-model directory, or a causal-LM directory's decoder with a zero head.

    Args:
        path: a local HF directory.
        device, dtype, attn_implementation: as `rlbench.models.load_model`.
        require_head: raise instead of starting a zero head when the directory is no value model (a reward model
            must have been trained).

    Raises:
        ValueError: no config.json; no value model with `require_head`.
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is not a Hugging Face model directory (no config.json); pass a local HF dir")
    problem = value_dir_problem(path)
    if require_head and problem:
        raise ValueError(f"{path!r} {problem}; give a directory written by `rlbench rm` or a critic's export_hf")
    config = value_config(AutoConfig.from_pretrained(path))
    # transformers initialises weights absent from the files with the global RNG: keep the caller's seeds
    with torch.random.fork_rng(devices=[]):
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.startswith(f"{VALUE_HEAD}.")]
    if missing:
        raise ValueError(f"{path!r} lacks tensors {sorted(missing)[:5]} (of {len(missing)}); is it a decoder of the "
                         "same architecture?")
    if info["missing_keys"]:  # a causal LM's directory: the head starts at zero
        zero_head_(model)
    model = model.to(device)
    if torch.device(device).type == "cpu":
        # the loaded tensors are views of the memory-mapped file, at offsets that need not be aligned: own copies
        # (aligned like any allocation) give the same kernels, so the same bits, as a model built in memory
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
    return model


def token_values(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor:
    """`[B, T]` float32: the head at every position (a sequence's score is the value at its last token).

    Args:
        model: a value model (plain or FSDP-wrapped).
        input_ids: `[B, T]` long (a pack: `[1, T]` with restarting `position_ids`).
        position_ids: `[B, T]` long, or None (0..T-1 per row).
        kwargs: further forward arguments (`attention_mask` for padded rows; the trainer's packed-attention inputs).
    """
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).logits  # [B, T, 1]
    return out[..., 0].float()


def save_value_model(model: PreTrainedModel, tokenizer, path: str | os.PathLike, meta: dict | None = None) -> str:
    """Write the layout of the module docstring into `path`; returns the version written into the stamp."""
    save_pretrained(model, tokenizer, path)
    return write_stamp(path, meta)


def write_stamp(path: str | os.PathLike, meta: dict | None = None) -> str:
    """Hash the directory's weights into `version.json` (with `meta`); returns the version."""
    version = weights_version(path)
    stamp = dict(meta or {}) | {"format": FORMAT, "version": version}
    with open(os.path.join(os.fspath(path), STAMP_FILE), "w", encoding="utf-8") as f:
        json.dump(stamp, f, indent=1)
    return version


def read_stamp(path: str | os.PathLike) -> dict:
    """The `version.json` of a value-model directory (`{}` when it has none)."""
    file = os.path.join(os.fspath(path), STAMP_FILE)
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def weights_version(path: str | os.PathLike) -> str:
    """16 hex digits of the SHA-256 over every `*.safetensors` file in `path`, by sorted name (name and bytes)."""
    path = os.fspath(path)
    digest = hashlib.sha256()
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        digest.update(name.encode())
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]
