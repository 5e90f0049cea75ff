"""Fixtures shared by several test files, the state every test starts from, and the reversed test order.

Every test starts from the process state this file found when pytest loaded it (`BASELINE`): torch's thread
count (OMP_NUM_THREADS or the core count), default dtype, grad mode, deterministic-algorithm and TF32 flags.
Whatever a test, a fixture or a test module's import changed is put back before the next test runs, so no
test passes because an earlier one left torch at one thread (or fp64, or deterministic). Module-scoped
fixtures may still set state for their own computation; the tests that use them run from the baseline too.
The reward registry and os.environ are put back at the end of each test module (module fixtures register
rewards and set variables for the whole module), and a default process group the module left is destroyed.

`--reverse-order` (or RLBENCH_TEST_ORDER=reverse) runs the collected modules in the opposite order, each
module's tests in their usual order (module fixtures are built once either way): `make test` runs the unit
suite this way, so a test that passes only after another one fails there (docs/ci_notes.md).
"""

from __future__ import annotations

import os

import pytest
import torch


def _torch_state() -> dict:
    return {
        "num_threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _set_torch_state(s: dict) -> None:
    if torch.get_num_threads() != s["num_threads"]:
        torch.set_num_threads(s["num_threads"])
    torch.set_default_dtype(s["default_dtype"])
    torch.set_grad_enabled(s["grad_enabled"])
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["deterministic_warn_only"])
    torch.set_float32_matmul_precision(s["float32_matmul_precision"])  # sets matmul_tf32 too: before it
    torch.backends.cuda.matmul.allow_tf32 = s["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = s["cudnn_benchmark"]


BASELINE = _torch_state()
"""torch's process-wide settings as pytest found them, before any test module was imported."""


@pytest.fixture(autouse=True)
def _baseline_torch_state():
    """Each test starts from `BASELINE` (whatever ran before it) and leaves it behind."""
    _set_torch_state(BASELINE)
    yield
    _set_torch_state(BASELINE)


@pytest.fixture(scope="module", autouse=True)
def _module_registries():
    """The reward registry and os.environ as they were before the module, put back after it; a default process
    group the module started (a Trainer's world of one) is destroyed after it."""
    import torch.distributed as dist

    from rlbench.rewards import REWARDS

    rewards, environ = dict(REWARDS), dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    REWARDS.clear()
    REWARDS.update(rewards)
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true", default=os.environ.get("RLBENCH_TEST_ORDER") == "reverse",
                     help="run the test modules in reversed order (each module's tests in their order); also "
                          "RLBENCH_TEST_ORDER=reverse")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--reverse-order"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    items[:] = [item for name in reversed(list(modules)) for item in modules[name]]


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (small-op tests are faster, and the 2-core CI box is shared)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(BASELINE["num_threads"])


@pytest.fixture
def no_tf32():
    """Plain fp32 matmuls (no TF32) for the test: GPU checks against float64 references need IEEE fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = BASELINE["matmul_tf32"]


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory):
    """The end-to-end tests' SFT warm start (tiny, arithmetic level 1), built once per session and shared by
    tests/test_e2e_grpo.py and tests/test_e2e_ppo.py (cached across sessions in $RLBENCH_TEST_CACHE when set)."""
    from rlbench.sft import SFTConfig, run_sft

    torch.set_num_threads(1)
    root = os.environ.get("RLBENCH_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    out = os.path.join(root, "sft-tiny-arith1")
    if not os.path.isfile(os.path.join(out, "config.json")):
        run_sft(SFTConfig(preset="tiny", task="arithmetic", task_kwargs={"level": 1}, out=out, batch_size=32,
                          eval_every=20, num_eval=32, max_steps=600, target_pass_at_1=0.3, num_threads=1))
    return out
