"""benchmarks/gluon_stream.py (experimental, GPU benchmark) compiles for sm_90 here, without a GPU."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

gluon = importlib.util.find_spec("triton.experimental.gluon") is not None


@pytest.mark.skipif(not gluon, reason="needs triton with gluon")
@pytest.mark.parametrize("slots", [8, 48])
def test_gluon_stream_compiles_for_hopper(slots):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gluon_stream as g

    names = list(inspect.signature(g.stream_layers.fn).parameters)
    desc = f"tensordesc<bf16[{g.BR.value}, {g.BK.value}],{g.box_layout()!r}>"
    sig = {n: desc for n in names[:4]} | {n: "*fp32" for n in names[4:8]} | {"sync": "*i32", "n_layers": "i32"}
    consts = dict(N_QKV=4096, N_O=1024, N_GU=6144, N_DN=1024, R_QKV=32, R_O=8, R_GU=48, R_DN=8, K_QKV=1024,
                  K_O=2048, K_GU=1024, K_DN=3072, SLOTS=slots, BARRIERS=True, NUM_WARPS=4)
    sig |= {n: "constexpr" for n in consts}
    src = GluonASTSource(fn=g.stream_layers, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared >= slots * 4096  # the ring
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx and "atom.global.gpu.release" in ptx
