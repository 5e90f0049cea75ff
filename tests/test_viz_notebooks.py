"""Notebook hygiene: committed without outputs, title first, GPU cells tagged; the strip tool itself."""

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
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and 'GPU-only cell' in src:
            assert "nbval-skip" in cell["metadata"].get("tags", []), f"GPU-only cell without nbval-skip: {src[:80]}"


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
