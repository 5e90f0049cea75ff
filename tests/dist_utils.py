"""Helpers shared by the multi-process tests (gloo process groups, a local Ray cluster)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "transformers",
           "transformers.models.qwen3.modeling_qwen3", "rlbench.backends.fsdp.actor", "rlbench.distributed",
           "rlbench.distributed.cp_attention", "rlbench.engine", "rlbench.models", "rlbench.packing", "pytest",
           "rlbench.backends.megatron.backend")  # megatron-core: ~10 s to import; skipped when not installed
"""What the fork server imports once, so that each gloo worker forked from it starts in ~0.1 s instead of the
~5 s of CPU a spawned interpreter spends importing torch, transformers and rlbench (7 of them in
test_cp_train.py alone)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a spawned process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs, join=True)` with the workers forked from one fork server
    per test session that has imported `PRELOAD` (and nothing else: no torch op, no thread pool, no process
    group), instead of fresh interpreters. Each worker still is a separate process that calls `fn(rank, *args)`,
    sets up its own process group and seeds, and a worker's exception is raised here as with spawn.

    The fork server's environment is the one it started with (the session's first call): workers get their
    settings from `args` or set them themselves (MASTER_ADDR, RANK, ...), never from a variable the test set.
    """
    import torch.multiprocessing as mp

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@contextlib.contextmanager
def megatron_world():
    """The block's world of one (made by the first backend's init) and megatron's groups, torn down at its end."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    try:
        yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def local_ray(stub_dir, num_cpus: int = 6):
    """A local Ray cluster for the duration of the block; yields the `ray` module.

    `import ray` pulls jsonschema -> rfc3987_syntax (a Jupyter dependency) whose grammar build costs seconds of
    CPU per process; a stub package in `stub_dir` on the actors' PYTHONPATH hides it (jsonschema then skips the
    'iri' format), which keeps actor start-up cheap on 2 cores.
    """
    import ray

    (stub_dir / "rfc3987_syntax").mkdir(exist_ok=True)
    (stub_dir / "rfc3987_syntax" / "__init__.py").write_text("raise ImportError('hidden by rlbench tests')\n")
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(stub_dir), old_path) if p)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
