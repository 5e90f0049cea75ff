"""How the parts are put together: `local` (one process, trainer and engine colocated) or `ray` (actors).

    trainer = rlbench.build_trainer(cfg)     # the Trainer class of cfg.cluster.backend, built

Light on import: the trainer classes load when asked for.
"""

from __future__ import annotations

from collections.abc import Callable


def _local_trainer() -> type:
    from rlbench.orchestration.local import LocalTrainer

    return LocalTrainer


def _ray_trainer() -> type:
    from rlbench.orchestration.ray_trainer import RayTrainer

    return RayTrainer


TRAINERS: dict[str, Callable[[], type]] = {"local": _local_trainer, "ray": _ray_trainer}
"""Cluster backend name (`rlbench.configs.cluster.BACKENDS`) -> a loader of the Trainer class that runs it."""


def trainer_class(backend: str) -> type:
    """The Trainer class of a cluster backend (its module is imported here, not before)."""
    if backend not in TRAINERS:
        raise ValueError(f"cluster backend={backend!r}; choose one of {sorted(TRAINERS)}")
    return TRAINERS[backend]()


def build_trainer(cfg, **kwargs):
    """The trainer for `cfg`: `LocalTrainer` (= `rlbench.Trainer`) when `cfg.cluster.backend == "local"`,
    `RayTrainer` for "ray" (same API); each builds its components.

    Args:
        cfg: the RunConfig.
        kwargs: passed to the class (`components=`, `sinks=`; `cluster=` for Ray).
    """
    return trainer_class(cfg.cluster.backend)(cfg, **kwargs)
