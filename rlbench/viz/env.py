"""Environment check for notebooks: devices, core versions, optional extras present or missing."""

from __future__ import annotations

import html
import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass, field

import torch

# import name -> (distribution name, what it enables)
OPTIONAL = {
    "anywidget": ("anywidget", "in-place plotly FigureWidget updates (else figures re-render)"),
    "ray": ("ray", "multi-GPU / multi-node orchestration"),
    "sglang": ("sglang", "SGLang rollout engine"),
    "flash_attn": ("flash-attn", "flash-attention kernels"),
    "ring_flash_attn": ("ring-flash-attn", "ring attention for context parallel"),
    "megatron.core": ("megatron-core", "Megatron backend"),
    "wandb": ("wandb", "Weights & Biases metric sink"),
    "tensorboard": ("tensorboard", "TensorBoard metric sink"),
    "pyarrow": ("pyarrow", "parquet prompt datasets"),
}
CORE = ("torch", "transformers", "tokenizers", "numpy", "plotly", "ipywidgets")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    root = name.split(".")[0]
    return importlib.util.find_spec(root) is not None and (root == name or importlib.util.find_spec(name) is not None)


@dataclass
class EnvironmentReport:
    """What this machine has: `devices` (name per device), `versions`, `extras` (import name -> version or None)."""

    python: str = field(default_factory=platform.python_version)
    devices: list[str] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)
    extras: dict[str, str | None] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return any(d.startswith("cuda") for d in self.devices)

    def _repr_html_(self) -> str:
        rows = [("python", self.python), ("devices", ", ".join(self.devices))]
        rows += [(k, v or "missing") for k, v in self.versions.items()]
        rows += [(f"extra: {k}", f"{v} ✓" if v else f"missing — {OPTIONAL[k][1]}") for k, v in self.extras.items()]
        body = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td>"
                       f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>" for k, v in rows)
        return f"<table class='rlbench-env'>{body}</table>"


def environment_report() -> EnvironmentReport:
    """Collects devices (cuda:i with its name, else cpu), core package versions and optional extras."""
    devices = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    devices.append(f"cpu ({torch.get_num_threads()} threads)")
    versions = {name: _version(name) for name in CORE}
    extras = {name: (_version(dist) or "present") if _has_module(name) else None
              for name, (dist, _) in OPTIONAL.items()}
    return EnvironmentReport(devices=devices, versions=versions, extras=extras)
