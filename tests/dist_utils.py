"""Helpers shared by the multi-process tests (gloo process groups, a local Ray cluster)."""

from __future__ import annotations

import contextlib
import os
import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a spawned process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
