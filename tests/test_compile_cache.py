"""`rlbench.compile_cache`: the on-disk compile caches default to the rlbench cache, a user's choice wins, and
`perf/compile_time` counts this process's compile seconds."""

from __future__ import annotations

import os

import torch

from rlbench.compile_cache import CACHE_ENV, compile_seconds, use_compile_cache


def test_cache_dirs_default_to_root_and_respect_the_environment(tmp_path, monkeypatch):
    for var in CACHE_ENV:
        monkeypatch.setenv(var, "unset")  # records the original, restored after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    got = use_compile_cache(str(tmp_path / "root"))
    assert got == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "root" / "inductor"),
                   "TRITON_CACHE_DIR": str(tmp_path / "mine")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "root" / "inductor")


def test_compile_seconds_grow_by_a_compile():
    before = compile_seconds()
    fn = torch.compile(lambda x: x * 3 + 1, backend="eager")
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 4.0))
    assert compile_seconds() > before
