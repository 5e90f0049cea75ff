"""torch.compile across runs: inductor's and Triton's on-disk caches in the rlbench cache, and the seconds a
process spent compiling (`perf/compile_time`).

A cold compile of the engine's decode step and the trainer's layers costs tens of seconds on a GPU; with the
caches on disk a later run (another process, another day) reloads the generated kernels and only re-traces.
"""

from __future__ import annotations

import os

CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
"""Environment variables of the caches -> their sub-directory of `<rlbench cache>/compile`."""


def use_compile_cache(root: str | None = None) -> dict[str, str]:
    """Point the caches at `root` (default `cache.cache_dir()/compile`) unless the environment already names
    them; returns {variable: directory in use}. Call before the first compile (the variables are read then)."""
    if root is None:
        from rlbench.cache import cache_dir

        root = os.path.join(cache_dir(), "compile")
    for var, sub in CACHE_ENV.items():
        os.environ.setdefault(var, os.path.join(root, sub))
    return {var: os.environ[var] for var in CACHE_ENV}


def compile_seconds() -> float:
    """Seconds torch.compile (dynamo and its backend) has spent in this process so far."""
    import torch._dynamo.utils

    return float(sum(torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", [])))
