"""`%%gpu_only`: a notebook cell that runs on a CUDA machine and skips itself, with a visible note, elsewhere.

    %load_ext rlbench.viz.magics

    %%gpu_only trains 10 more steps of the Qwen3-0.6B shape
    controller.run(10)

Without CUDA the cell prints one line ("GPU-only cell skipped: no CUDA device here; on a GPU it trains ...")
and returns, so "Run All" in JupyterLab and nbval on a CPU go on past it. With CUDA the body runs as a cell
in the notebook's namespace: its last expression is the cell's output and its error propagates, so nbval on
the GPU machine fails on it.
"""

from __future__ import annotations

import ast
from typing import Any

import torch

SKIP_NOTE = "GPU-only cell skipped: no CUDA device here; on a GPU it {what}."


def cuda_available() -> bool:
    """Whether `%%gpu_only` cells run (a function so tests can stand in for the device)."""
    return torch.cuda.is_available()


def run_as_cell(source: str, namespace: dict, filename: str = "<gpu_only cell>") -> Any:
    """Executes `source` (plain Python) in `namespace`; returns the value of a trailing expression, else None."""
    tree = ast.parse(source, filename=filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - this is the notebook cell the user wrote
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)  # noqa: S307 - as above


def gpu_only(line: str, cell: str) -> Any:
    """The cell magic: runs `cell` when CUDA is present, else prints the skip note built from `line`."""
    what = line.strip() or "runs this cell"
    if not cuda_available():
        print(SKIP_NOTE.format(what=what))
        return None
    from IPython import get_ipython

    shell = get_ipython()
    source = shell.transform_cell(cell) if shell is not None else cell  # `!cmd` / `%magic` lines inside
    namespace = shell.user_ns if shell is not None else {}
    return run_as_cell(source, namespace)


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext rlbench.viz.magics` registers `%%gpu_only`."""
    ipython.register_magic_function(gpu_only, magic_kind="cell", magic_name="gpu_only")
