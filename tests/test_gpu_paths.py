"""The code that only runs on the GPU machine, checked against the current API on the CPU (the GPU suite runs
rarely, so its tests, scripts and notebook cells must be right before they get there):
- every GPU-only test module, its helper modules, every benchmark script and every notebook (the `%%gpu_only`
  cells included) passes the static API check of tests/api_check.py (imports exist, calls into rlbench bind);
- every command line of benchmarks/gpu_suite.sh parses with today's flags (tests/suite_check.py), and every
  GPU test module is run by one of its parts;
- the configs that the suite's benchmarks build on the GPU build and validate here.
Each checker is also shown to fail on the drift it is for (the TrainConfig keywords that moved to FSDPOptions).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from rlbench.rewards import REWARDS

sys.path.insert(0, str(Path(__file__).parent))
from api_check import check_file, check_source  # noqa: E402
from suite_check import check_command, suite_commands  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
GPU_TESTS = sorted(p for p in (ROOT / "tests").glob("test_*.py")
                   if re.search(r"mark\.gpu|cuda\.is_available", p.read_text()) and p.name != Path(__file__).name)
CHECKED = [*GPU_TESTS, ROOT / "tests" / "mk_check.py", ROOT / "tests" / "split_kv_check.py",
           *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]
COMMANDS = suite_commands(SUITE.read_text())


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_gpu_only_code_calls_the_current_api(path):
    assert check_file(path) == []


OLD_FSDP_GPU = '''
from rlbench.configs.backend import OptimConfig, TrainConfig

def _backend(env, **kw):
    cfg = TrainConfig(model="small", device="cuda", optim=OptimConfig(lr=1e-4), **kw)
    return cfg

def test_compiled_train_step(env):
    b = _backend(env, attn_implementation="flex_attention", compile=True, ref_model="small")
'''
"""tests/test_fsdp_gpu.py before e56f548 (its helper and one caller): the keywords went to TrainConfig."""


def test_api_check_catches_the_moved_fsdp_options():
    found = check_source(OLD_FSDP_GPU, "old.py")
    assert [re.search(r"forwards '(\w+)'", f).group(1) for f in found] == ["attn_implementation", "compile"]
    assert all(f.startswith("old.py:9: _backend() forwards") and "TrainConfig()" in f for f in found)
    fixed = OLD_FSDP_GPU.replace("cfg = TrainConfig(", "fsdp = {k: kw.pop(k) for k in ('attn_implementation', "
                                 "'compile') if k in kw}\n    cfg = TrainConfig(fsdp=FSDPOptions(**fsdp), ").replace(
        "import OptimConfig", "import FSDPOptions, OptimConfig")
    assert check_source(fixed, "fixed.py") == []
    assert check_source(fixed.replace("'compile'", "'compiled'"), "typo.py") == [
        "typo.py:6: FSDPOptions() has no parameter 'compiled'",
        "typo.py:10: _backend() forwards 'compile' to TrainConfig(), which has no such parameter (line 6)"]


@pytest.mark.parametrize("code, message", [
    ("from rlbench.configs import TrainConfig\nTrainConfig(compile=True)", "TrainConfig() has no parameter 'compile'"),
    ("from rlbench.backends.fsdp_actor import FSDPBackend", "No module named 'rlbench.backends.fsdp_actor'"),
    ("from rlbench.configs import TrainOptions", "rlbench.configs has no 'TrainOptions'"),
    ("import rlbench.presets as p\np.qwen3_gpu()", "rlbench.presets has no attribute 'qwen3_gpu'"),
    ("import dataclasses\nfrom rlbench import presets\ncfg = presets.qwen3_0p6b_gpu('m')\n"
     "dataclasses.replace(cfg.backend, gradient_checkpointing=True)",
     "replace() of a TrainConfig: no field 'gradient_checkpointing'"),
    ("from rlbench import presets\ncfg = presets.cpu_demo()\ncfg.backend.compile = True",
     "TrainConfig has no field or attribute 'compile'"),
    ("from rlbench import presets\npresets.cpu_demo().replace(trainer=None)", "replace() of a RunConfig: no field 'trainer'"),
    ("from rlbench.engine.protocol import SamplingParams\nSamplingParams(max_tokens=4)",
     "SamplingParams() has no parameter 'max_tokens'"),
    ("from rlbench.orchestration.local import LocalTrainer\ndef f(t: LocalTrainer):\n    t.step(3)",
     "LocalTrainer.step(): too many positional arguments"),
])
def test_api_check_catches_each_kind_of_drift(code, message):
    found = check_source(code, "x.py")
    assert len(found) == 1 and message in found[0], found


def test_api_check_reads_the_gpu_only_cells_of_a_notebook(tmp_path):
    cells = [{"cell_type": "code", "source": ["from rlbench.configs import TrainConfig"]},
             {"cell_type": "markdown", "source": ["On a GPU:"]},
             {"cell_type": "code", "source": ["%%gpu_only trains\n", "TrainConfig(gradient_checkpointing=True)"]}]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert check_file(path) == ["nb.ipynb cell 2 line 2: TrainConfig() has no parameter 'gradient_checkpointing'"]


@pytest.mark.parametrize("part, argv", COMMANDS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_gpu_suite_command_parses(part, argv):
    assert check_command(argv) == []


def test_gpu_suite_has_every_part_and_runs_every_gpu_test_module():
    parts = {p for p, _ in COMMANDS}
    header = SUITE.read_text().split("# Wheels")[0]
    described = set(re.findall(r"^#   (\w+) ", header, re.M))
    assert parts == described - {"notebooks"} and "gputests" in parts and "top" in parts
    run = {Path(a).name for _, argv in COMMANDS if argv[1:3] == ["-m", "pytest"] for a in argv if a.endswith(".py")}
    assert {p.name for p in GPU_TESTS if "mark.gpu" in p.read_text()} <= run


@pytest.mark.parametrize("line, problem", [
    ("python3 benchmarks/train.py --attn flex_attention --gradient-checkpointing", "unrecognized arguments"),
    ("python3 benchmarks/decode_profile.py --kv 256 --steps 300", "--steps 300 must be below every --kv"),
    ("python3 -m rlbench.cli train --preset qwen3_0p6b_gpu --compile-fsdp", "unknown flag --compile-fsdp"),
    ("python3 -m rlbench.cli bench e2e --steps 0", "measure at least 1 step"),
    ("python3 -m pytest -q -m gpu tests/test_e2e_gpu.py -k never_blocks", "-k never_blocks: no test"),
    ("python3 -m pytest -q -m gpu tests/test_algorithms_advantages.py", "has no test marked gpu"),
    ("python3 benchmarks/fsdp_gpu.py", "benchmarks/fsdp_gpu.py is missing"),
])
def test_suite_check_catches_stale_lines(line, problem):
    found = check_command(line.split())
    assert len(found) == 1 and problem in found[0], found


def _bench(name: str):
    from rlbench.experiments import load_benchmark

    return load_benchmark(f"benchmarks/{name}.py", f"gpu_paths_{name}")


def test_e2e_bench_configs_build_for_every_workload_and_variant(tmp_path, monkeypatch):
    e2e = _bench("e2e")
    monkeypatch.setitem(REWARDS, "bench_text", e2e.text_reward)  # run_rlbench registers it in its process
    for name, w in e2e.WORKLOADS.items():
        for variant in e2e.VARIANTS.values():
            if w.device == "cpu" and variant == "fast":  # flex_attention: refused on the CPU, by name
                with pytest.raises(ValueError, match="flex_attention' needs device='cuda'"):
                    e2e.rlbench_config(w, w.model, str(tmp_path / name / variant), 2, variant)
                continue
            cfg = e2e.rlbench_config(w, w.model, str(tmp_path / name / variant), 2, variant)
            assert (cfg.backend.device, cfg.backend.param_dtype, cfg.batch.num_rollout) == (w.device, w.dtype, 2)
            assert cfg.true_on_policy_mode == (variant == "true_on_policy")
            assert cfg.backend.fsdp.compile is (True if variant == "fast" else None)
            assert (cfg.backend.critic is not None) == (variant == "ppo")


def test_true_on_policy_bench_configs_build_for_every_mode(tmp_path, monkeypatch):
    bench = _bench("true_on_policy")
    monkeypatch.setitem(REWARDS, "bench_text", bench.text_reward)  # run() registers it in its process
    for ac in (False, True):
        monkeypatch.setattr(sys, "argv", ["true_on_policy.py", *(["--ac"] if ac else [])])
        args = bench.parse_args()
        assert isinstance(args, argparse.Namespace)
        for mode in bench.MODES:
            cfg = bench.build_config(args, "qwen3-0.6b-shape", mode, str(tmp_path))
            assert (cfg.backend.fsdp.gradient_checkpointing, cfg.backend.device) == (ac, "cuda")
            assert cfg.true_on_policy_mode == (mode != "default")


def test_megatron_gpu_configs_construct_both_backends():
    """tests/test_megatron_gpu.py's configs pass both constructors' checks (megatron refuses FSDP-only options)."""
    pytest.importorskip("megatron.core")
    import test_megatron_gpu as t

    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.backends.megatron import MegatronBackend

    for dtype, attn in t.CASES:
        cfg, megatron, fsdp_cfg = t.backend_configs(dtype, attn)
        assert MegatronBackend(cfg, megatron, temperature=0.8).cfg.fsdp.changed() == []
        assert FSDPBackend(fsdp_cfg, temperature=0.8).cfg.fsdp.attn_implementation in ("sdpa", "flex_attention")
