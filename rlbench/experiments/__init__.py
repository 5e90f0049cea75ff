"""Experiments: configurations and studies built on the library (`rlbench experiment NAME ...`).

The dependency is one way: experiments import the library, the library never imports them.
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {"cp-oom": "rlbench.experiments.cp_oom", "fsdp-vs-megatron": "rlbench.experiments.fsdp_vs_megatron"}
"""`rlbench experiment` name -> the module whose `main(argv)` runs it."""


def run_experiment(argv: list[str]) -> int:
    """`rlbench experiment NAME [flags]`: run experiment NAME's `main(flags)`."""
    if not argv or argv[0] not in EXPERIMENTS:
        print(f"usage: rlbench experiment NAME [flags]; NAME is one of {sorted(EXPERIMENTS)}")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return importlib.import_module(EXPERIMENTS[argv[0]]).main(argv[1:])
