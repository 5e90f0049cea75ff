"""Notebook hygiene: committed without outputs, title first, GPU cells behind `%%gpu_only`; the strip tool itself;
the `%%gpu_only` magic on both paths (no CUDA: a note and a skip; CUDA: the body runs, its error propagates)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("strip_notebooks", ROOT / "tools" / "strip_notebooks.py")
strip_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(strip_notebooks)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_committed_clean(path):
    assert strip_notebooks.is_clean(path), f"run: python tools/strip_notebooks.py {path.relative_to(ROOT)}"
    nb = json.loads(path.read_text())
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# ")
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "".join(code[0]["source"]).startswith("%load_ext rlbench.viz.magics\n"), "load the magic in cell 1"
    for cell in code:
        src, tags = "".join(cell["source"]), cell["metadata"].get("tags", [])
        # JupyterLab's Run All ignores nbval tags: a skip must be the cell's own doing, not a tag's
        assert "nbval-skip" not in tags and "skip-execution" not in tags, f"skip tag on: {src[:80]}"
        assert "assert torch.cuda.is_available()" not in src, f"a bare GPU assert (use %%gpu_only): {src[:80]}"
        assert ("gpu" in tags) == src.startswith("%%gpu_only "), f"gpu tag iff %%gpu_only: {src[:80]}"


def test_strip_removes_outputs_and_keeps_tags(tmp_path):
    nb = {"cells": [{"cell_type": "code", "source": "1+1", "execution_count": 3,
                     "metadata": {"tags": ["nbval-skip"], "execution": {"x": 1}},
                     "outputs": [{"output_type": "execute_result", "data": {"text/plain": "2"}}]},
                    {"cell_type": "markdown", "source": "# t", "metadata": {}}],
          "metadata": {"widgets": {"state": {}}, "kernelspec": {"name": "python3"}}, "nbformat": 4,
          "nbformat_minor": 5}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(nb))
    assert not strip_notebooks.is_clean(path)
    assert strip_notebooks.main(["--check", str(path)]) == 1
    assert strip_notebooks.main([str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["cells"][0]["outputs"] == [] and out["cells"][0]["execution_count"] is None
    assert out["cells"][0]["metadata"] == {"tags": ["nbval-skip"]}
    assert out["metadata"] == {"kernelspec": {"name": "python3"}}
    assert strip_notebooks.is_clean(path) and strip_notebooks.main(["--check", str(path)]) == 0


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    assert ip.run_cell("%load_ext rlbench.viz.magics").success
    yield ip
    InteractiveShell.clear_instance()


def test_gpu_only_without_cuda_prints_the_note_and_runs_nothing(shell, monkeypatch, capsys):
    from rlbench.viz import magics

    monkeypatch.setattr(magics, "cuda_available", lambda: False)
    result = shell.run_cell("%%gpu_only trains ten steps\nran = True\n1 / 0")
    assert result.success and result.result is None and "ran" not in shell.user_ns
    assert capsys.readouterr().out == "GPU-only cell skipped: no CUDA device here; on a GPU it trains ten steps.\n"


def test_gpu_only_with_cuda_runs_the_body_as_a_cell(shell, monkeypatch):
    from rlbench.viz import magics

    monkeypatch.setattr(magics, "cuda_available", lambda: True)
    shell.user_ns["base"] = 40
    result = shell.run_cell("%%gpu_only adds\nimport math\nx = base + 2\nmath.sqrt(x - 6)")
    assert result.success and result.result == 6.0 and shell.user_ns["x"] == 42 and "math" in shell.user_ns
    assert shell.run_cell("%%gpu_only assigns\ny = 1").result is None and shell.user_ns["y"] == 1
    failed = shell.run_cell("%%gpu_only fails\nz = 1\nraise KeyError('boom')")
    assert not failed.success and isinstance(failed.error_in_exec, KeyError) and shell.user_ns["z"] == 1
