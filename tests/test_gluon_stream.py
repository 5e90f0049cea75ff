"""benchmarks/gluon_stream.py (experimental, GPU benchmark) compiles for sm_90 here, without a GPU."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

gluon = importlib.util.find_spec("triton.experimental.gluon") is not None


@pytest.mark.skipif(not gluon, reason="needs triton with gluon")
@pytest.mark.parametrize("slots", [8, 48])
@pytest.mark.parametrize("mode", ["stream", "gemv"])
def test_gluon_stream_compiles_for_hopper(mode, slots):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gluon_stream as g

    names = list(inspect.signature(g.stream_layers.fn).parameters)
    desc = f"tensordesc<bf16[{g.BR.value}, {g.BK.value}],{g.box_layout()!r}>"
    sig = {n: desc for n in names[:4]} | {n: "*fp32" for n in names[4:8]} | {"sync": "*i32", "n_layers": "i32"}
    ks = dict(K_QKV=1024, K_O=2048, K_GU=1024, K_DN=3072)  # 0.6B
    kmax = max(ks.values())
    consts = dict(N_QKV=4096, N_O=1024, N_GU=6144, N_DN=1024, R_QKV=32, R_O=8, R_GU=48, R_DN=8, **ks, KMAX=kmax,
                  SLOTS=slots, BARRIERS=True, MODE=mode, NUM_WARPS=4)
    assert set(names) == set(sig) | set(consts)
    sig |= {n: "constexpr" for n in consts}
    src = GluonASTSource(fn=g.stream_layers, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx and "atom.global.gpu.release" in ptx
    # global loads (the boxes come by TMA): only the stage inputs x, each a whole [XR, BK] chunk
    loads = re.findall(r"tt\.load [^\n]*: tensor<([0-9x]+)x!tt\.ptr<f32>", ttgir)
    if mode == "gemv":
        # the ring plus the x buffer (KMAX fp32 values, rounded up to whole chunks)
        assert kernel.metadata.shared >= slots * 4096 + g.x_bytes(kmax) >= slots * 4096 + kmax * 4
        # x is read from global memory once per stage and program, in XR-row chunks outside the box loops ...
        xr, bk = g.XR.value, g.BK.value
        assert loads == [f"{xr}x{bk}"] * sum(triton.cdiv(k // bk, xr) for k in ks.values())
        # ... and per box from shared memory, next to the box itself
        assert re.search(rf"ttg\.local_load [^\n]*: !ttg\.memdesc<{bk}xf32", ttgir)
        assert re.search(rf"ttg\.local_load [^\n]*: !ttg\.memdesc<{g.BR.value}x{bk}xbf16", ttgir)
        assert "ld.shared.v4" in ptx
    else:  # the consumer takes the boxes and touches neither them nor x
        assert kernel.metadata.shared >= slots * 4096
        assert loads == [] and "bf16" not in "".join(re.findall(r"ttg\.local_load [^\n]*", ttgir))
