"""Experiments: configurations and studies built on the library (`rlbench experiment NAME ...`).

The dependency is one way: experiments import the library, the library never imports them. Studies that are not
part of the package live in the source checkout's `benchmarks/` and are run from there (`load_benchmark`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = {"cp-oom": "rlbench.experiments.cp_oom", "fsdp-vs-megatron": "benchmarks/fsdp_vs_megatron.py",
               "rlhf": "rlbench.experiments.rlhf"}
"""`rlbench experiment` name -> what runs it (its `main(argv)`): a module of the package, or a script of the source
checkout (a path relative to the repository root)."""


def load_benchmark(relpath: str, name: str | None = None) -> ModuleType:
    """The script `relpath` (e.g. "benchmarks/e2e.py") of this source checkout, imported as module `name` (default:
    its file stem; a module of that name already imported from the same file is reused).

    Raises:
        SystemExit: the file is missing (rlbench was installed without its source checkout).
    """
    path = Path(__file__).resolve().parents[2] / relpath
    if not path.is_file():
        raise SystemExit(f"this command runs {relpath} of a source checkout, and {path} is missing; "
                         "run it from a clone of the repository (pip install -e .)")
    name = name or path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_experiment(argv: list[str]) -> int:
    """`rlbench experiment NAME [flags]`: run experiment NAME's `main(flags)`."""
    if not argv or argv[0] not in EXPERIMENTS:
        print(f"usage: rlbench experiment NAME [flags]; NAME is one of {sorted(EXPERIMENTS)}")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    target = EXPERIMENTS[argv[0]]
    module = load_benchmark(target) if target.endswith(".py") else importlib.import_module(target)
    return module.main(argv[1:])
