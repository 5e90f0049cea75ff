"""The package map's import rules (docs/ARCHITECTURE.md): no circles, imports flow one way, configs on the
ground floor, no private names across files. Read from the source (every import, at module level or inside a
function), so a lazy import that closes a circle counts too."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "rlbench"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """rlbench modules `path` imports anywhere in its source (`from pkg import submodule` names the submodule)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "rlbench":
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "rlbench"}
    return {m for m in out if m != module}


GRAPH = {m: _imports(p, m) for m, p in MODULES.items()}


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def _is_config(module: str) -> bool:
    return _under(module, "rlbench.configs")


# (importer prefix, imported prefixes it must not reach, exceptions it may) — docs/ARCHITECTURE.md.
RULES = [
    ("rlbench.packing", ["rlbench"], ["rlbench.packing", "rlbench.types"]),
    ("rlbench.algorithms", ["rlbench"], ["rlbench.algorithms", "rlbench.configs"]),
    ("rlbench.types", ["rlbench"], []),
    ("rlbench.backends", ["rlbench.engine", "rlbench.rollout", "rlbench.trainer", "rlbench.orchestration"], []),
    # the two backends are siblings over the shared layer: each imports backends/* but never the other
    ("rlbench.backends.fsdp", ["rlbench.backends.megatron"], []),
    ("rlbench.backends.megatron", ["rlbench.backends.fsdp"], []),
    ("rlbench.engine", ["rlbench.backends", "rlbench.rollout", "rlbench.trainer", "rlbench.orchestration"], []),
    ("rlbench.rollout", ["rlbench.engine", "rlbench.backends", "rlbench.trainer", "rlbench.orchestration"],
     ["rlbench.engine.protocol"]),
    # reward models are trained and served over models/ and packing; the rollout manager gets one built
    ("rlbench.reward_model", ["rlbench.engine", "rlbench.backends", "rlbench.rollout", "rlbench.trainer",
                              "rlbench.orchestration"], []),
    ("rlbench.weights", ["rlbench.engine", "rlbench.backends", "rlbench.rollout", "rlbench.trainer"], []),
    ("rlbench.engine.megakernel.layout", ["rlbench"], []),
    ("rlbench.numerics", ["rlbench"], ["rlbench.numerics", "rlbench.models"]),
    ("rlbench.configs", ["rlbench"], ["rlbench.configs"]),
    # the loop takes built components and reaches checkpoints through the TrainBackend protocol
    ("rlbench.trainer", ["rlbench.orchestration", "rlbench.backends", "rlbench.engine"], []),
]
COMPOSERS = ("rlbench.trainer", "rlbench.orchestration", "rlbench.cli", "rlbench", "rlbench.experiments")
LIBRARY_USERS = ("rlbench.viz", "rlbench.experiments")
FRONT_ENDS = ("rlbench.cli",)  # `rlbench experiment NAME` dispatches to rlbench.experiments; nothing imports the CLI


def _violations() -> list[str]:
    bad = []
    for module, targets in GRAPH.items():
        for target in targets:
            for prefix, banned, allowed in RULES:
                if _under(module, prefix) and _under(target, *banned) and not _under(target, *allowed, prefix):
                    bad.append(f"{module} -> {target} (rule for {prefix})")
            if _under(target, "rlbench.trainer", "rlbench.orchestration") and not _under(module, *COMPOSERS) \
                    and not _is_config(target):
                bad.append(f"{module} -> {target} (only composition code imports the trainer / orchestration)")
            if _under(target, *LIBRARY_USERS) and not _under(module, *LIBRARY_USERS, *FRONT_ENDS):
                bad.append(f"{module} -> {target} (the library never imports viz / experiments)")
            if _under(target, *FRONT_ENDS) and not _under(module, *FRONT_ENDS):
                bad.append(f"{module} -> {target} (nothing imports the CLI front end)")
    return sorted(bad)


def test_imports_flow_one_way():
    assert _violations() == []


def test_the_rules_catch_a_forbidden_direction():
    GRAPH["rlbench.packing.pack"].add("rlbench.trainer")
    try:
        assert "rlbench.packing.pack -> rlbench.trainer (rule for rlbench.packing)" in _violations()
    finally:
        GRAPH["rlbench.packing.pack"].discard("rlbench.trainer")


def test_no_private_names_imported_across_files():
    bad = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlbench"):
                bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


HEAVY = ("rlbench.engine.torch_engine", "rlbench.engine.runner", "rlbench.engine.megakernel", "rlbench.rollout",
         "rlbench.backends.fsdp.actor", "rlbench.trainer", "rlbench.orchestration.local", "triton", "transformers")


@pytest.mark.parametrize("module", ["rlbench.configs", "rlbench.configs.engine"])
def test_a_config_imports_no_engine_or_cuda_code(module):
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert [m for m in loaded if _under(m, *HEAVY)] == []
    if module.startswith("rlbench.configs"):  # the ground floor: not even torch
        assert [m for m in loaded if _under(m, "torch", "numpy") or (_under(m, "rlbench") and not _is_config(m)
                                                                       and m != "rlbench")] == []
