"""The user cache: what rlbench builds once and reuses (SFT warm starts, generated task data, compile caches).

    out = build_once(os.path.join(cache_dir(), f"tool-sft-{recipe_key(recipe)}"), recipe, build)

`build_once` names nothing itself: the caller puts a key of the recipe in the directory name, so a changed recipe
gets a new directory and an old one is never loaded for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable

RECIPE_FILE = "rlbench-recipe.json"
"""Written into a build's directory after the build returned: a directory without it (or with another recipe in
it) is unfinished and is built again."""


def cache_dir() -> str:
    """Where rlbench keeps what it builds once and reuses: $RLBENCH_CACHE, else $XDG_CACHE_HOME/rlbench,
    else ~/.cache/rlbench (read at call time)."""
    if os.environ.get("RLBENCH_CACHE"):
        return os.path.abspath(os.path.expanduser(os.environ["RLBENCH_CACHE"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlbench")


def recipe_key(recipe: dict) -> str:
    """16 hex digits of the SHA-256 of `recipe` as sorted JSON: equal recipes give equal keys, any changed value
    another key. The recipe must be JSON (str, numbers, bools, None, lists, dicts with str keys)."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def finished(out: str, recipe: dict) -> bool:
    """Whether `out` holds a finished build of `recipe` (its `RECIPE_FILE` reads back as `recipe`)."""
    try:
        with open(os.path.join(out, RECIPE_FILE)) as f:
            return json.load(f) == json.loads(json.dumps(recipe))  # compared as JSON: tuples read back as lists
    except (OSError, ValueError):  # missing, or cut off mid-write
        return False


def build_once(out: str, recipe: dict, build: Callable[[str], object], what: str = "build") -> str:
    """`out` when it holds a finished build of `recipe`; else `build(tmp)` into a fresh sibling directory, the
    recipe written beside its output, and the directory renamed to `out`. Returns `out`.

    An unfinished `out` (a copy cut short, a build of another version that wrote in place) is removed and built
    again, never loaded; an interrupted build leaves only its temporary sibling, which no later call reads. When
    another process finished `out` first, its build is kept and this one's is dropped. `what` names the build in
    the line printed before it starts.
    """
    if finished(out, recipe):
        return out
    print(f"[rlbench] {what} -> {out} (built once, then reused)", flush=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted build of a process with this pid
    os.makedirs(tmp)
    build(tmp)
    with open(os.path.join(tmp, RECIPE_FILE), "w") as f:
        json.dump(recipe, f, indent=1, sort_keys=True)
    if os.path.exists(out) and not finished(out, recipe):
        shutil.rmtree(out)
    try:
        os.replace(tmp, out)
    except OSError:  # `out` appeared meanwhile: another process's finished build
        if not finished(out, recipe):
            raise
        shutil.rmtree(tmp)
    return out
