"""rlbench: a notebook-first workbench for RL post-training of language models.

    import rlbench
    trainer = rlbench.Trainer(rlbench.presets.cpu_demo())   # builds the parts, then the one-process Trainer
    trainer.step()
    trainer = rlbench.build_trainer(cfg)     # Trainer or RayTrainer, from cfg.cluster.backend

`rlbench.Trainer` is `rlbench.orchestration.local.LocalTrainer` (the loop itself, `rlbench.trainer.Trainer`, takes
built components). `import rlbench` stays light: `Trainer`, `build_trainer`, `RunConfig` and `presets` load on
first access.
"""

from __future__ import annotations

import importlib

__all__ = ["RunConfig", "Trainer", "build_trainer", "presets"]

_LAZY = {"Trainer": ("rlbench.orchestration.local", "LocalTrainer"), "RunConfig": ("rlbench.configs", "RunConfig"),
         "build_trainer": ("rlbench.orchestration", "build_trainer"), "presets": ("rlbench.presets", None)}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'rlbench' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
