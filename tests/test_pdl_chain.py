"""benchmarks/pdl_chain.py (GPU benchmark) compiles for sm_90 here, without a GPU: each mode loads what it says,
on the side of `griddepcontrol.wait` it says."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _ptx(mode: str, n: int = 2048, rows: int = 16, repl: int = 1) -> tuple[str, str]:
    """The PTX of one link, split at its PDL wait: (before, after)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import pdl_chain

    consts = dict(N=n, ROWS=rows, REPL=repl, PDL=True, WEIGHTS=mode in ("full", "no_act"),
                  ACT=mode in ("full", "no_weight"))
    names = list(inspect.signature(pdl_chain.link.fn).parameters)  # constexprs go by position
    sig = {"w_ptr": "*bf16", "x_in": "*bf16", "x_out": "*bf16"} | {k: "constexpr" for k in consts}
    src = ASTSource(fn=pdl_chain.link, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, launch_pdl=True)).asm["ptx"]
    before, wait, after = ptx.partition("griddepcontrol.wait")
    assert wait, "no PDL wait in the link"
    return before, after


def _loads(text: str) -> int:
    return len(re.findall(r"ld\.global\S*\.v4", text))


@needs_triton
@pytest.mark.skipif(bool(__import__("os").environ.get("TRITON_INTERPRET")), reason="compiles, does not interpret")
def test_links_load_weights_before_the_wait_and_the_activation_after_it():
    before, after = _ptx("full")
    assert _loads(before) == 16 and "st.global" not in before  # [16, 2048] bf16 over 256 threads: 16 x 16 B
    assert _loads(after) == 1  # the activation: 2048 bf16, 16 B per thread
    before, after = _ptx("no_act")
    assert _loads(before) == 16 and _loads(after) == 0
    before, after = _ptx("no_weight")
    assert _loads(before) == 0 and _loads(after) == 1
    before, after = _ptx("empty", repl=8)
    assert _loads(before) + _loads(after) == 0 and after.count("st.global") >= 8  # one store per replica
