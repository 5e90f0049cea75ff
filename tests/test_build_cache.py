"""Built once, reused: `rlbench.cache.build_once` loads only a finished build of the same recipe, and the tool-use
warm start (notebook 06) is cached by a key of its recipe."""

from __future__ import annotations

import json
import os

import pytest

from rlbench.cache import RECIPE_FILE, build_once, finished, recipe_key
from rlbench.models import load_model
from rlbench.rollout.multiturn.warm_start import ToolSFTConfig, cached_tool_warm_start, tool_sft_recipe


def _writer(calls: list):
    def build(tmp: str) -> None:
        calls.append(tmp)
        with open(os.path.join(tmp, "weights.txt"), "w") as f:
            f.write(f"build {len(calls)}")
    return build


def _read(out: str) -> str:
    with open(os.path.join(out, "weights.txt")) as f:
        return f.read()


def test_recipe_key_follows_every_value():
    a = {"steps": 400, "lr": 3e-3, "ids": [1, 2]}
    assert recipe_key(a) == recipe_key(dict(reversed(a.items())))  # key order does not matter
    assert recipe_key(a) != recipe_key(a | {"steps": 401})
    assert recipe_key(a) != recipe_key(a | {"ids": [2, 1]})
    assert len(recipe_key(a)) == 16 and int(recipe_key(a), 16) >= 0


def test_hit_builds_nothing_and_a_changed_recipe_is_another_build(tmp_path, capsys):
    calls, recipe = [], {"steps": 2}
    out = build_once(str(tmp_path / "m"), recipe, _writer(calls), what="thing")
    assert out == str(tmp_path / "m") and _read(out) == "build 1" and calls == [f"{out}.tmp-{os.getpid()}"]
    assert f"[rlbench] thing -> {out}" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / RECIPE_FILE).read_text()) == recipe
    assert sorted(os.listdir(tmp_path)) == ["m"]  # the temporary directory was renamed, nothing left beside it

    assert build_once(out, {"steps": 2}, _writer(calls)) == out and len(calls) == 1  # hit
    assert capsys.readouterr().out == ""
    assert not finished(out, {"steps": 3})  # the same directory does not count for another recipe
    build_once(out, {"steps": 3}, _writer(calls))
    assert len(calls) == 2 and _read(out) == "build 2" and finished(out, {"steps": 3})


def test_partial_entries_are_built_again_not_loaded(tmp_path):
    out, recipe = tmp_path / "m", {"steps": 2}
    out.mkdir()
    (out / "weights.txt").write_text("half")  # a copy cut short: no recipe file
    calls = []
    build_once(str(out), recipe, _writer(calls))
    assert len(calls) == 1 and _read(str(out)) == "build 1"

    (out / RECIPE_FILE).write_text('{"ste')  # a recipe file cut off mid-write
    build_once(str(out), recipe, _writer(calls))
    assert len(calls) == 2 and finished(str(out), recipe)


def test_an_interrupted_build_leaves_no_entry(tmp_path):
    out, recipe = str(tmp_path / "m"), {"steps": 2}

    def crash(tmp: str) -> None:
        with open(os.path.join(tmp, "weights.txt"), "w") as f:
            f.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_once(out, recipe, crash)
    assert not os.path.exists(out) and not finished(out, recipe)
    calls = []
    build_once(out, recipe, _writer(calls))  # the next call builds (and clears its own pid's leftover)
    assert len(calls) == 1 and _read(out) == "build 1" and sorted(os.listdir(tmp_path)) == ["m"]


TINY = dict(preset="tiny", level=1, num_train=32, batch_size=4, steps=2, lr=3e-3)


def test_tool_warm_start_is_cached_by_its_recipe(tmp_path, capsys):
    root = str(tmp_path)
    out = cached_tool_warm_start(ToolSFTConfig(**TINY), root=root)
    assert os.path.basename(out) == f"tool-sft-tiny-level1-{recipe_key(tool_sft_recipe(ToolSFTConfig(**TINY)))}"
    assert "tool-use SFT warm start (2 steps)" in capsys.readouterr().out
    weights = os.path.join(out, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    model = load_model(out)
    assert model.config.vocab_size == 128

    assert cached_tool_warm_start(ToolSFTConfig(**TINY), root=root) == out  # hit: nothing trained or written
    assert capsys.readouterr().out == "" and os.stat(weights).st_mtime_ns == stamp
    other = cached_tool_warm_start(ToolSFTConfig(**TINY | {"steps": 3}), root=root)  # miss: a changed recipe
    assert other != out and "(3 steps)" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in (out, other))

    os.remove(os.path.join(out, RECIPE_FILE))  # as if cut short: built again
    assert cached_tool_warm_start(ToolSFTConfig(**TINY), root=root) == out
    assert "tool-use SFT warm start" in capsys.readouterr().out and finished(out, tool_sft_recipe(ToolSFTConfig(**TINY)))


def test_tool_warm_start_cache_refuses_an_out(tmp_path):
    with pytest.raises(ValueError, match=r"picks its own directory; got out=.*leave it None"):
        cached_tool_warm_start(ToolSFTConfig(**TINY, out=str(tmp_path / "x")), root=str(tmp_path))
