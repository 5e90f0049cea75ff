"""The Trainer's own part of a checkpoint (the loop state: data position, RNG, history), found and read through
the backend's checkpoint protocol; the process RNG state it carries; seeding."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def point_backend_at(backend, path: str) -> None:
    """Checkpoints go under `path` (the backend's checkpoint root is a config field)."""
    os.makedirs(path, exist_ok=True)
    if backend.cfg.checkpoint_dir != path:
        import dataclasses

        backend.cfg = dataclasses.replace(backend.cfg, checkpoint_dir=path)


LOOP_STATE = "loop_state.pt"
"""The Trainer's file inside each checkpoint directory (`backend.save(extra=...)`): data position, RNG, history."""


def find_checkpoint(backend, path: str, rollout_id: int | None = None) -> tuple[int, dict]:
    """`(backend step, loop state)` of the latest committed checkpoint under `path` (None) or of the committed
    one holding `rollout_id`, read through the backend (`latest_step`, `committed_steps`, `committed_file`),
    which must point at `path`. Checkpoints of the previous layout (the Trainer's own `trainer_XXXXXXX.pt`
    beside the backend's checkpoints) load too."""
    legacy = {int(f[8:-3]): os.path.join(path, f) for f in os.listdir(path)
              if f.startswith("trainer_") and f.endswith(".pt") and f[8:-3].isdigit()}
    if rollout_id is None:
        step = backend.latest_step()
        if step is None:
            raise ValueError(f"{path!r} has no committed checkpoint; pass the directory given to save()")
        file = backend.committed_file(step, LOOP_STATE)
        if file is not None:
            return step, _read(file)
        for rid in sorted(legacy, reverse=True):  # previous layout: the newest trainer file of this backend step
            state = _read(legacy[rid])
            if state.get("backend_step") == step:
                return step, state
        raise ValueError(f"the latest checkpoint under {path!r} (step {step}) has no {LOOP_STATE} (written by "
                         "backend.save alone?); save with Trainer.save")
    for step in reversed(backend.committed_steps()):
        file = backend.committed_file(step, LOOP_STATE)
        if file is not None:
            state = _read(file)
            if state["rollout_id"] == rollout_id:
                return step, state
    if rollout_id in legacy:
        state = _read(legacy[rollout_id])
        return int(state["backend_step"]), state
    raise ValueError(f"{path!r} has no committed checkpoint of rollout {rollout_id}; "
                     "load(path) without rollout_id takes the latest")


def _read(file: str) -> dict:
    try:
        return torch.load(file, weights_only=False)
    except Exception as exc:
        raise ValueError(f"cannot read checkpoint file {file!r} ({type(exc).__name__}: {exc}); "
                         "load another checkpoint (rollout_id=...) or delete the file") from exc


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
