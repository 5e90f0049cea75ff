"""A Hugging Face causal LM with a scalar head: one number per position (reward models, critics).

    model = ScalarHeadModel.from_pretrained("runs/rm", device="cpu")     # HF dir (+ head when saved with one)
    values = model(input_ids, position_ids=position_ids)                 # [B, T] fp32, one per position
    model.save_pretrained("runs/rm", tokenizer, meta={"kind": "reward"}) # HF dir + head + stamp

The head is `nn.Linear(hidden_size, 1)` over the decoder's last hidden state (after the final norm); the
lm-head is kept but never run, so the directory stays a loadable causal LM and an actor directory (no head file)
starts a scalar-head model with a zero head (every value 0 at first: a Bradley-Terry loss starts at log 2, a
critic at V = 0). Packed sequences work as in the trainer: one `[1, T]` row with `position_ids` restarting per
sequence and no attention mask (transformers builds the per-document causal mask; `use_cache=False`).

On-disk layout (`save_pretrained`):

    DIR/config.json, DIR/model.safetensors (or shards), tokenizer files   a standard HF causal-LM directory
    DIR/scalar_head.safetensors   {"weight": [1, hidden_size], "bias": [1]}, float32
    DIR/scalar_head.json          {"format": 1, "hidden_size": H, "version": "<16 hex>", ...caller's meta}

`version` is the first 16 hex digits of the SHA-256 of every `*.safetensors` file in the directory (sorted by
name, the head included), so two directories with the same weights carry the same version, and any change of a
weight changes it.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from rlbench.models.build import load_model, save_pretrained

HEAD_FILE = "scalar_head.safetensors"
"""The head's weights in a scalar-head directory."""
META_FILE = "scalar_head.json"
"""The head's stamp: format, hidden size, version, and what the writer added (`meta`)."""
FORMAT = 1


class ScalarHeadModel(nn.Module):
    """`backbone` (an HF causal LM) with `head = nn.Linear(hidden_size, 1)` over its last hidden state.

    Args:
        backbone: the causal LM; its decoder (`backbone.base_model`) runs, its lm-head does not.
        head: the scalar head; None makes a zero-initialised one in the backbone's dtype and device.
    """

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = hidden_size(backbone)
        if head is None:
            param = next(backbone.parameters())
            # built on meta and zeroed: no draw from the global RNG (building a model must not shift a run's seeds)
            head = nn.Linear(hidden, 1, device="meta", dtype=param.dtype).to_empty(device=param.device)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        if tuple(head.weight.shape) != (1, hidden):
            raise ValueError(f"scalar head weight has shape {tuple(head.weight.shape)}, the backbone's hidden size "
                             f"is {hidden}; the head must be nn.Linear({hidden}, 1)")
        self.head = head

    @property
    def config(self):
        """The backbone's HF config."""
        return self.backbone.config

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's last hidden state `[B, T, H]` (no lm-head, no KV cache)."""
        out = self.backbone.base_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                       use_cache=False)
        return out.last_hidden_state

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One value per position.

        Args:
            input_ids: `[B, T]` long (a pack: `[1, T]` with restarting `position_ids`).
            position_ids: `[B, T]` long, or None (0..T-1 per row).
            attention_mask: `[B, T]` padding mask, or None (packed / unpadded input).

        Returns:
            `[B, T]` float32: the head at every position (a sequence's score is the value at its last token).
        """
        hidden = self.hidden_states(input_ids, position_ids, attention_mask)  # [B, T, H]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()  # [B, T]

    def save_pretrained(self, path: str | os.PathLike, tokenizer=None, meta: dict | None = None) -> str:
        """Write the layout of the module docstring into `path`; returns the version written into the stamp."""
        path = os.fspath(path)
        save_pretrained(self.backbone, tokenizer, path)
        head = {"weight": self.head.weight.detach().float().cpu().contiguous(),
                "bias": self.head.bias.detach().float().cpu().contiguous()}
        save_file(head, os.path.join(path, HEAD_FILE))
        version = weights_version(path)
        stamp = dict(meta or {}) | {"format": FORMAT, "hidden_size": hidden_size(self.backbone), "version": version}
        with open(os.path.join(path, META_FILE), "w", encoding="utf-8") as f:
            json.dump(stamp, f, indent=1)
        return version

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                        require_head: bool = False) -> ScalarHeadModel:
        """Load an HF causal-LM directory, with its scalar head when `scalar_head.safetensors` is there.

        Args:
            path: a scalar-head directory, or any HF causal-LM directory (then the head starts at zero).
            device, dtype, attn_implementation: as `rlbench.models.load_model` (the head takes the same dtype).
            require_head: raise instead of starting a zero head when the directory has none (a reward model
                must have been trained).

        Raises:
            ValueError: no config.json; no head file with `require_head`; a head of the wrong shape.
        """
        path = os.fspath(path)
        has_head = os.path.isfile(os.path.join(path, HEAD_FILE))
        if require_head and not has_head:
            raise ValueError(f"{path!r} has no {HEAD_FILE}, so it holds no trained scalar head; give a directory "
                             "written by `rlbench rm` (ScalarHeadModel.save_pretrained)")
        backbone = load_model(path, device=device, dtype=dtype, attn_implementation=attn_implementation)
        model = cls(backbone)
        if has_head:
            state = load_file(os.path.join(path, HEAD_FILE))
            if set(state) != {"weight", "bias"} or tuple(state["weight"].shape) != tuple(model.head.weight.shape):
                raise ValueError(f"{os.path.join(path, HEAD_FILE)} holds {sorted((k, tuple(v.shape)) for k, v in state.items())}; "
                                 f"expected weight {tuple(model.head.weight.shape)} and bias (1,) for this backbone")
            with torch.no_grad():
                model.head.weight.copy_(state["weight"])
                model.head.bias.copy_(state["bias"])
        return model


def hidden_size(backbone: PreTrainedModel) -> int:
    """The width of the backbone's last hidden state."""
    config = backbone.config.get_text_config() if hasattr(backbone.config, "get_text_config") else backbone.config
    return int(config.hidden_size)


def read_stamp(path: str | os.PathLike) -> dict:
    """The `scalar_head.json` of a scalar-head directory (`{}` when it has none)."""
    file = os.path.join(os.fspath(path), META_FILE)
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
