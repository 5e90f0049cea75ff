"""Resuming with a changed config: the model must match the checkpoint, the new optimizer settings win.

`save_checkpoint` stores in `trainer_state.pt` the model's HF config dict (`model_config`), the model name /
overrides and the `OptimConfig` (`optim_config`). On load:

* `check_model_config` compares the checkpoint's model config with the model being loaded into, before
  torch.distributed.checkpoint reads a byte, and raises `ResumeError` naming every differing field
  (e.g. `num_hidden_layers: checkpoint 4, now 2`). `check_dcp_shapes` does the same from the DCP metadata
  for parameters (checkpoints without a stored config, or a change the config does not show).
* `apply_optim_config` is the rule for optimizer hyper-parameters: **the new config wins** for lr,
  min_lr, weight decay, betas, eps, clip_grad and the schedule (warmup / decay); AdamW moments and the
  step counters come from the checkpoint. The restored param groups and the scheduler's base lrs are set
  from the new `OptimConfig` and the lr of the current step is recomputed with the new schedule; one line
  lists what changed.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

IGNORED_MODEL_FIELDS = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "use_cache", "_commit_hash",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "_experts_implementation",
})
"""HF config keys that do not change the parameters or the function (dtype and kernels are TrainConfig's)."""


class ResumeError(ValueError):
    """The checkpoint cannot be loaded into this run's model; the checkpoint itself is untouched."""


def model_config_dict(model) -> dict | None:
    """The architecture fields of an HF model's config (None for a model without `.config`)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return {k: v for k, v in config.to_dict().items() if k not in IGNORED_MODEL_FIELDS}


def check_model_config(meta: dict, model, path: str) -> None:
    """Raise `ResumeError` naming each model field that differs between the checkpoint and `model`."""
    saved, now = meta.get("model_config"), model_config_dict(model)
    if saved is None or now is None:
        return  # an older checkpoint: check_dcp_shapes / DCP itself still catch shape changes
    saved = {k: v for k, v in saved.items() if k not in IGNORED_MODEL_FIELDS}
    diffs = [f"{k}: checkpoint {saved.get(k, '<unset>')!r}, now {now.get(k, '<unset>')!r}"
             for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]
    if diffs:
        origin = meta.get("model")
        was = f" (saved with model={origin!r}, model_overrides={meta.get('model_overrides') or {}})" if origin else ""
        raise ResumeError(
            f"cannot resume from {path}: the model differs from the checkpoint's{was} in "
            f"{len(diffs)} field{'s' * (len(diffs) != 1)}: " + "; ".join(diffs)
            + ". Resume with the checkpoint's model (backend.model / model_overrides, --model) or start a new "
            "run without --load; the checkpoint is unchanged"
        )


def check_dcp_shapes(dcp_dir: str, model_state: dict, path: str) -> None:
    """Compare the DCP metadata's parameter names/shapes with the model's state dict (before loading)."""
    import torch.distributed.checkpoint as dcp

    saved = {k.removeprefix("model."): tuple(v.size) for k, v in dcp.FileSystemReader(dcp_dir).read_metadata()
             .state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size")}
    now = {k: tuple(v.shape) for k, v in model_state.items() if hasattr(v, "shape")}
    extra, missing = sorted(saved.keys() - now.keys()), sorted(now.keys() - saved.keys())
    shapes = [f"{k}: checkpoint {list(saved[k])}, now {list(now[k])}" for k in sorted(saved.keys() & now.keys())
              if saved[k] != now[k]]
    problems = ([f"{len(extra)} parameters only in the checkpoint (e.g. {extra[:3]})"] if extra else []) + (
        [f"{len(missing)} parameters missing from it (e.g. {missing[:3]})"] if missing else []) + shapes[:5] + (
        [f"... {len(shapes) - 5} more shape differences"] if len(shapes) > 5 else [])
    if problems:
        raise ResumeError(
            f"cannot resume from {path}: its parameters do not match this model: " + "; ".join(problems)
            + ". Resume with the checkpoint's model or start a new run without --load; the checkpoint is unchanged"
        )


def apply_optim_config(optimizer, scheduler, saved: dict | None, new, *, path: str = "", announce: bool = True) -> list[str]:
    """The new `OptimConfig` wins: set lr / betas / weight decay / eps and the scheduler's base lrs from
    `new`, recompute the current lr with the new schedule; returns (and warns, once) the changed fields."""
    new_d = dataclasses.asdict(new)
    if saved is None:  # older checkpoint: read what the param groups hold
        g = optimizer.param_groups[0]
        saved = {"lr": g.get("initial_lr", g["lr"]), "betas": g["betas"], "weight_decay": g["weight_decay"], "eps": g["eps"]}
    changed = [f"{k} {_fmt(saved[k])} -> {_fmt(new_d[k])}" for k in new_d if k in saved and _norm(saved[k]) != _norm(new_d[k])]
    step = scheduler.last_epoch
    for group, lam in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(betas=tuple(new.betas), weight_decay=new.weight_decay, eps=new.eps, initial_lr=new.lr)
        group["lr"] = new.lr * lam(step)
    scheduler.base_lrs = [new.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    if changed and announce:
        where = f" from {os.path.basename(path)}" if path else ""
        warnings.warn(
            f"resume{where}: the new config wins for optim " + ", ".join(changed)
            + f" (the lr of step {step} is now {_fmt(optimizer.param_groups[0]['lr'])}; docs/training.md, 'Resuming')",
            UserWarning,
            stacklevel=3,
        )
    return changed


def _norm(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else repr(tuple(v) if isinstance(v, list) else v)
