"""benchmarks/gluon_stream.py (experimental, GPU benchmark) compiles for sm_90 here, without a GPU."""

from __future__ import annotations

import importlib.util
import inspect
import re
import statistics
import sys
import types
from pathlib import Path

import pytest

gluon = importlib.util.find_spec("triton.experimental.gluon") is not None
needs_gluon = pytest.mark.skipif(not gluon, reason="needs triton with gluon")
KS = dict(K_QKV=1024, K_O=2048, K_GU=1024, K_DN=3072)  # 0.6B
SHAPES = dict(N_QKV=4096, N_O=1024, N_GU=6144, N_DN=1024, R_QKV=32, R_O=8, R_GU=48, R_DN=8, **KS)


def _module():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gluon_stream

    return gluon_stream


def _compile(g, args, consts, kernel=None):
    """triton.compile of stream_layers (or `kernel`) for sm_90: `args` maps the runtime parameters to their
    signature types, `consts` the constexpr parameters to their values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = kernel or g.stream_layers
    names = list(inspect.signature(kernel.fn).parameters)
    assert set(names) == set(args) | set(consts)
    sig = args | {n: "constexpr" for n in consts}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=consts["NUM_WARPS"]))


def _build(mode, slots, timed=False):
    g = _module()
    names = list(inspect.signature(g.stream_layers.fn).parameters)
    desc = f"tensordesc<bf16[{g.BR.value}, {g.BK.value}],{g.box_layout()!r}>"
    args = {n: desc for n in names[:4]} | {n: "*fp32" for n in names[4:8]}
    args |= {"sync": "*i32", "stats": "*i64", "n_layers": "i32"}
    consts = dict(SHAPES, KMAX=max(KS.values()), SLOTS=slots, BARRIERS=True, MODE=mode, NUM_WARPS=4, TIMED=timed)
    return g, _compile(g, args, consts)


def _box_syncs(ptx):
    """bar.sync between consecutive consumer box waits (the producer's waits are followed by a TMA copy)."""
    seq = re.findall(r"bar\.sync|mbarrier\.try_wait|cp\.async\.bulk\.tensor", ptx)
    waits = [j for j, op in enumerate(seq) if op == "mbarrier.try_wait" and "cp.async.bulk.tensor" not in seq[j:j + 2]]
    return [seq[a:b].count("bar.sync") for a, b in zip(waits, waits[1:])]


@needs_gluon
@pytest.mark.parametrize("slots", [8, 48])
@pytest.mark.parametrize("mode", ["stream", "stream_thread", "gemv", "gemv_thread"])
def test_gluon_stream_compiles_for_hopper(mode, slots):
    import triton

    g, kernel = _build(mode, slots)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx and "atom.global.gpu.release" in ptx
    assert "%clock64" not in ptx and "%globaltimer" not in ptx  # the un-timed build reads no clock
    # a slot is released by one thread (mbarrier.arrive) or by every consumer thread (cp.async.mbarrier.arrive)
    assert ("cp.async.mbarrier.arrive.noinc" in ptx) == mode.endswith("_thread")
    # global loads (the boxes come by TMA): only the stage inputs x, each a whole [XR, BK] chunk
    loads = re.findall(r"tt\.load [^\n]*: tensor<([0-9x]+)x!tt\.ptr<f32>", ttgir)
    if mode.startswith("gemv"):
        # the ring plus the x buffer (KMAX fp32 values, rounded up to whole chunks)
        kmax = max(KS.values())
        assert kernel.metadata.shared >= slots * 4096 + g.x_bytes(kmax) >= slots * 4096 + kmax * 4
        # x is read from global memory once per stage and program, in XR-row chunks outside the box loops ...
        xr, bk = g.XR.value, g.BK.value
        assert loads == [f"{xr}x{bk}"] * sum(triton.cdiv(k // bk, xr) for k in KS.values())
        # ... and per box from shared memory, next to the box itself
        assert re.search(rf"ttg\.local_load [^\n]*: !ttg\.memdesc<{bk}xf32", ttgir)
        assert re.search(rf"ttg\.local_load [^\n]*: !ttg\.memdesc<{g.BR.value}x{bk}xbf16", ttgir)
        assert "ld.shared.v4" in ptx
    else:  # the consumer takes the boxes and touches neither them nor x
        assert kernel.metadata.shared >= slots * 4096
        assert loads == [] and "bf16" not in "".join(re.findall(r"ttg\.local_load [^\n]*", ttgir))


@needs_gluon
@pytest.mark.parametrize("mode", ["barrier_only", "barrier_load", "barrier_load_half"])
def test_barrier_modes_compile_for_hopper(mode):
    """The consumer only meets the grid barriers (acquire polls); barrier_load's producer streams the boxes
    meanwhile, reusing a slot once its previous box has landed; barrier_only's loads nothing."""
    _, kernel = _build(mode, 24)
    ptx = kernel.asm["ptx"]
    assert "atom.global.gpu.release" in ptx and "ld.global.gpu.acquire" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == mode.startswith("barrier_load")
    assert "ld.shared.v4" not in ptx


@needs_gluon
@pytest.mark.parametrize("mode", ["chase_only", "chase_load"])
def test_chase_modes_compile_for_hopper(mode):
    """In place of the grid barriers, CHASE dependent L2 loads (.cg, each address from the previous value); no
    barrier atomics; chase_load's producer streams the boxes meanwhile."""
    g, kernel = _build(mode, 24)
    ptx = kernel.asm["ptx"]
    assert "atom.global" not in ptx and "ld.global.gpu.acquire" not in ptx
    assert len(re.findall(r"ld\.global\.cg\.b32", ptx)) >= g.CHASE.value
    assert ("cp.async.bulk.tensor" in ptx) == (mode == "chase_load")


@needs_gluon
@pytest.mark.parametrize("work", ["stream", "gemv"])
def test_thread_release_needs_fewer_bar_syncs(work):
    """mbarrier.arrive (one thread) costs a partition-wide bar.sync before it and another after it, per box;
    every thread arriving on its own leaves one (before the wait for the next box)."""
    one = _box_syncs(_build(work, 24)[1].asm["ptx"])
    per_thread = _box_syncs(_build(f"{work}_thread", 24)[1].asm["ptx"])
    # typical box (stage boundaries, with their x loads and grid barriers, add a few more)
    assert statistics.median(per_thread) == 1 and statistics.median(one) == 2
    assert sum(per_thread) < sum(one)


@needs_gluon
@pytest.mark.parametrize("mode", ["stream", "gemv_thread"])
def test_timed_build_reads_clocks(mode):
    _, kernel = _build(mode, 24, timed=True)
    ptx = kernel.asm["ptx"]
    assert "%clock64" in ptx and "%globaltimer" in ptx
    assert ptx.count("st.global.b64") >= 1  # the stats row (int64)


@needs_gluon
def test_main_dry_run(monkeypatch, capsys):
    """main() as on the GPU, with CUDA faked: tensors on the CPU and each launch an sm_90 compile of its exact
    arguments."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    g = _module()
    real = g.stream_layers
    names = list(inspect.signature(real.fn).parameters)
    params = inspect.signature(real.fn).parameters
    compiled = []

    def launch(grid):
        assert grid == (132,)

        def run(*a, num_warps):
            args, consts = {}, {}
            for n, v in zip(names, a, strict=True):
                if "constexpr" in str(params[n].annotation):
                    consts[n] = v
                elif isinstance(v, TensorDescriptor):
                    args[n] = f"tensordesc<bf16[{', '.join(map(str, v.block_shape))}],{v.layout!r}>"
                elif isinstance(v, torch.Tensor):
                    args[n] = {torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}[v.dtype]
                else:
                    assert isinstance(v, int)
                    args[n] = "i32"
            assert num_warps == consts["NUM_WARPS"]
            compiled.append(_compile(g, args, consts, real))
            if consts["TIMED"]:  # plausible clocks for the stall table: 2 GHz
                stats = a[names.index("stats")]
                stats.copy_(torch.tensor([3e5, 9e5, 2e5, 4e5, 1e5, 1e6, 5e5, 60 * 28], dtype=torch.float64))

        return run

    class Event:
        def __init__(self, **_):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, _):
            return 0.25

    def on_cpu(fn):
        return lambda *a, device=None, **k: fn(*a, **k)

    monkeypatch.setattr(torch, "randn", on_cpu(torch.randn))
    monkeypatch.setattr(torch, "zeros", on_cpu(torch.zeros))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(g, "stream_layers", type("K", (), {"__getitem__": lambda self, grid: launch(grid)})())
    monkeypatch.setattr(sys, "argv", ["gluon_stream.py", "--slots", "48", "--modes", "gemv_thread", "--timed",
                                      "--iters", "2"])
    g.main()
    out = capsys.readouterr().out
    assert "FAILED" not in out, out
    assert len(compiled) == 2 * (1 + 2 + 2)  # barriers 0 and 1: a first launch, --iters timed ones, 2 TIMED
    assert out.count(" TIMED: ") == 2 and "clock 2.00 GHz" in out and "cons_grid_barrier 7.14/7.14" in out, out
    assert "cons_total 17.86/17.86" in out and "boxes/layer 60.0" in out, out
    assert "gemv_thread   slots  48 (192 KB) barriers 1:" in out, out
