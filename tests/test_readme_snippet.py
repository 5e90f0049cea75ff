"""The README's first Python block, run as a new user would: a fresh process in an empty directory, with an
empty cache. The one deviation: the demo's SFT warm start is built with 2 steps instead of 100 first (the
README's `cpu_demo()` builds the full one, about 40 s on 2 cores), so the block then finds it in the cache."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from rlbench import presets

ROOT = pathlib.Path(__file__).resolve().parents[1]

PRELUDE = """
import torch
torch.set_num_threads(1)
from rlbench import presets
presets.demo_warm_start(max_steps=2)
"""
REPORT = """
import json, os
print("REPORT " + json.dumps({"keys": sorted(trainer.history[-1]), "evals": len(trainer.eval_history),
                              "jsonl": trainer.cfg.logging.jsonl_path, "model": trainer.cfg.backend.model,
                              "cwd": sorted(os.listdir("."))}))
"""


def readme_snippet() -> str:
    """The first ```python block of README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    return text[start:text.index("```", start)]


def test_readme_snippet_runs_in_an_empty_directory(tmp_path):
    snippet = readme_snippet()
    assert "rlbench.Trainer(rlbench.presets.cpu_demo())" in snippet and "trainer.step()" in snippet
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    env = dict(os.environ, RLBENCH_CACHE=str(cache), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PRELUDE + snippet + REPORT], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[rlbench] SFT warm start -> {cache / presets.DEMO_SFT_NAME}" in proc.stdout
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    assert report["model"] == str(cache / presets.DEMO_SFT_NAME)
    assert (cache / presets.DEMO_SFT_NAME / "config.json").is_file()
    assert report["cwd"] == ["runs"]  # the run's metrics, nothing else, in the user's directory
    assert report["jsonl"].startswith(os.path.join("runs", "demo-"))
    assert (work / report["jsonl"]).is_file()
    keys = report["keys"]
    assert {"rollout/raw_reward", "perf/step_time"} <= set(keys) and any(k.startswith("train/") for k in keys)
    assert report["evals"] == 1  # the pre-training eval, in trainer.eval_history
