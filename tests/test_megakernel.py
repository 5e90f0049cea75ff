"""The batch-1 decode megakernel (`rlbench/engine/megakernel/`) against the engine's layer stack and float64.

On the CPU the kernel runs under Triton's interpreter (one program, so the grid barriers pass at once and
every task runs in order) in a subprocess, because the interpreter must be chosen before Triton is imported;
the GPU tests run it with one program per SM, barriers and merge tickets live.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mk_check import (
    CPU_CASES,
    case_name,
    compare_to_f64,
    compile_for_hopper,
    distinct_outputs,
    sync_outputs,
)

from rlbench.engine import MegakernelConfig, SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.models import build_model

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_gluon = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                 or importlib.util.find_spec("triton.experimental.gluon") is None,
                                 reason="needs triton with gluon")
cuda = torch.cuda.is_available()
# The interpreter subprocess takes ~2 min of a 2-core box; the megakernel is GPU-only (no CPU path uses it), so
# these run in the GPU suite (benchmarks/gpu_suite.sh mk), not in `make test`.
interpreted_mk = pytest.mark.interpreted


@pytest.fixture(scope="module")
def interpreted():
    """tests/mk_check.py's CPU cases, run once under TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("mk_check.py"))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(r, label):
    print(f"\n{label}: |mk - f64| max {r['mk_max']:.3e} mean {r['mk_mean']:.3e}; "
          f"|bf16 stack - f64| max {r['stack_max']:.3e} mean {r['stack_mean']:.3e}; "
          f"new-K err mk {r['k_err']:.3e} stack {r['k_err_stack']:.3e}")
    assert r["untouched"]  # only the new position of slot 0 is written
    # bf16 rounding at HF's points: the kernel's error is the bf16 stack's, not a multiple of it
    assert r["mk_mean"] <= 1.5 * r["stack_mean"]  # (truncating instead of rounding measured 3.8x)
    assert r["mk_max"] <= 3.0 * r["stack_max"]
    assert r["k_err"] <= 2.0 * r["k_err_stack"]


@interpreted_mk
@needs_triton
def test_interpreted_sample_head_equals_the_compiled_heads_math(interpreted):
    """The batch-1 head in two Triton kernels (norm, lm_head, Gumbel sampling, log-prob, state update) picks the
    tokens `greedy_tokens` / `sample_tokens` pick from HF's bf16 logits, with their log-probs (24 cases), and a
    token id in range from NaN hidden states (the engine then reports a stalled megakernel instead of crashing)."""
    r = interpreted["head"]
    assert r["mismatches"] == 0 and r["max_lp_diff"] < 1e-5 and r["nan_tokens_in_range"], r


@interpreted_mk
@needs_triton
def test_interpreted_finish_step_equals_the_torch_state_update(interpreted):
    """The step's state update in one Triton kernel (CUDA steps) == the five torch ops (CPU steps)."""
    assert interpreted["finish_step"]


@interpreted_mk
@needs_triton
@pytest.mark.parametrize("case", [case_name(*c) + sync for c in CPU_CASES for sync in ("", "/launch")])
def test_interpreted_megakernel_rounds_like_the_hf_layers(interpreted, case):
    """The grid-barrier kernel and (/launch) the per-stage kernels with their own attention merge."""
    _check(interpreted[case], case)


@needs_triton
@pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles, does not interpret")
@pytest.mark.parametrize("preset", ["qwen3-0.6b-shape", "qwen3-4b-shape"])
def test_stage_kernels_load_weights_before_the_pdl_wait_and_write_after_it(preset):
    """With PDL a stage's kernel starts while the previous one runs: only token-independent loads may come before
    its `griddepcontrol.wait`. Each stage's first weight chunk (or K/V block) is issued there; no store, atomic
    or activation read is (the merge, stage 5, has nothing to load early)."""
    for stage in range(6):
        r = compile_for_hopper(preset, stage=stage, num_warps=1 if stage == 5 else 8)
        print(f"\n{preset} stage {stage}: {r}")
        assert r["waits"] == 1 and r["writes_before_wait"] == 0, r
        assert r["vector_loads_before_wait"] >= (0 if stage == 5 else 8), r
        assert r["regs"] * r["threads"] <= 65536 and r["spill_bytes"] == 0, r


@interpreted_mk
@needs_triton
def test_interpreted_engine_samples_the_same_tokens(interpreted):
    """Seeded sampling through the engine: the megakernel path draws the layer-stack path's tokens."""
    (mk_tokens, mk_lp), (stack_tokens, stack_lp) = interpreted["engine"]["mk"], interpreted["engine"]["stack"]
    assert mk_tokens == stack_tokens and len(set(mk_tokens)) > 2
    assert max(abs(a - b) for a, b in zip(mk_lp, stack_lp)) < 0.02


@needs_triton
@pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles, does not interpret")
@pytest.mark.parametrize("preset", ["qwen3-0.6b-shape", "qwen3-4b-shape"])
def test_kernel_compiles_for_hopper_and_fits_one_program_per_sm(preset):
    """The persistent grid only completes if every program is resident: one per SM must fit the register file
    (65,536 32-bit registers on sm_90) and shared memory. Compiled for sm_90 here, without a GPU."""
    r = compile_for_hopper(preset)
    print(f"\n{preset}: {r}")
    assert r["regs"] * r["threads"] <= 65536 and r["shared"] <= 227 * 1024
    assert r["spill_bytes"] <= 2048  # a few spilled values, not spilled tiles
    # weights stream as 16-byte vectors: without the alignment hint on table pointers every weight load was 2 bytes
    # (544 of them; 2.6x slower on the H200, docs/LOG.md). The 2-byte loads left are the q/k gathers of rotate_half
    # and single activations (27 for the 0.6B shape).
    assert r["vector_loads"] >= 100 and r["two_byte_loads"] <= 40, r
    # each of a layer's 5 barrier waits polls with acquire loads (first poll + loop): without any acquire in the PTX
    # (relaxed polls, session 5) cp.async reads through L1 saw stale activations on the H200
    assert r["acquire_loads"] >= 10, r


def test_gluon_plan_takes_the_stages_whose_tile_fits_shared_memory(monkeypatch):
    """0.6B: every GEMV stage (rows per program a multiple of 8, tile + bf16 input <= GLUON_TILE_BYTES) and the
    attention stage; 4B: none; off on the CPU and under the grid-barrier sync."""
    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.megakernel import layout
    from rlbench.engine.megakernel.host import DecodeMegakernel

    def plan(preset):
        model = build_model(preset, meta=True, dtype=torch.bfloat16)
        return DecodeMegakernel(model, fuse_layers(model), 1536, torch.device("cpu"), programs=132)

    mk = plan("qwen3-0.6b-shape")
    assert mk.gluon_plan() == {0: (4096, 1024, 32, 4), 2: (1024, 2048, 8, 8), 3: (3072, 1024, 24, 4),
                               4: (1024, 3072, 8, 16)}
    assert plan("qwen3-4b-shape").gluon_plan() == {}
    mk.stage_sync = "pdl"
    assert not mk.gluon_gemv and mk.gluon_active() == {}  # no TMA on the CPU
    mk.gluon_gemv = True
    assert sorted(mk.gluon_active()) == [0, 2, 3, 4]
    assert mk.gluon_attention_active()  # with them, the Gluon attention stage (its carveout is theirs)
    with monkeypatch.context() as m:
        m.setattr(layout, "GLUON_ATTENTION", False)
        assert not mk.gluon_attention_active()
    four = plan("qwen3-4b-shape")
    four.stage_sync, four.gluon_gemv = "pdl", True
    assert not four.gluon_attention_active()  # no Gluon GEMV stage there: the Triton attention stage
    mk.stage_sync = "barrier"
    assert mk.gluon_active() == {} and not mk.gluon_attention_active()
    # tensor-core tiles in rows of 8 chunks of 64, held in two power-of-two buffers
    assert [mk.gluon_lo(st) for st in (0, 2, 3, 4)] == [64, 32, 64, 32]  # of 64, 32, 96 (64 + 32), 48 (32 + 16)


def test_mma_tile_split_takes_two_power_of_two_buffers():
    from rlbench.engine.megakernel.host import mma_tile_split

    assert [mma_tile_split(n) for n in (64, 96, 48, 24, 80, 112, 7)] == [64, 64, 32, 16, 64, None, None]


GLUON_PRESETS = ("qwen3-0.6b-shape", "qwen3-4b-shape")


@pytest.fixture(scope="module")
def gluon_compiles():
    """mk_check's Gluon compiles for sm_90 (the 0.6B shape's GEMV stages, each preset's attention stage), in one
    fresh process: Triton's interpreter, once it has run kernels in a process (tests/test_numerics_triton.py runs
    its kernels interpreted in the pytest process), leaves its patches of triton.language behind, and a Gluon
    compile in that process then fails ("Did you forget to add @triton.gluon.jit ?"): the result would depend
    on the test order."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); import mk_check as m; "
            "r = {f'stage{s}': m.compile_gluon_stage('qwen3-0.6b-shape', s) for s in (0, 2, 3, 4)}; "
            f"r.update({{p: m.compile_gluon_attention(p) for p in {GLUON_PRESETS!r}}}); print(json.dumps(r))")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(root), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("stage", [0, 2, 3, 4])
def test_gluon_stage_compiles_for_hopper_small_enough_to_share_an_sm(gluon_compiles, stage):
    """Each Gluon GEMV stage of the 0.6B shape, compiled offline for sm_90 as the megakernel launches it (on the
    tensor cores): only its norm weights are read and nothing is written before the PDL wait, one TMA copy per
    box, no spills, and few enough registers and shared memory that the next GEMV stage's program fits on the same
    SM (65,536 registers, 227 KB): the point of the design."""
    r = gluon_compiles[f"stage{stage}"]
    nxt = gluon_compiles[f"stage{ {0: 2, 2: 3, 3: 4, 4: 0}[stage]}"]
    assert r["waits"] == 1 and r["stores_before_wait"] == 0
    assert r["loads_before_wait"] == (8 if stage in (0, 3) else 0)  # the RMSNorm weights, [16, 64] bf16
    assert r["tma_copies"] == r["boxes"] and r["spill_bytes"] == 0
    assert r["regs"] * r["threads"] + nxt["regs"] * nxt["threads"] <= 65536
    assert r["shared"] + nxt["shared"] <= 227 * 1024


@needs_gluon
@pytest.mark.parametrize("preset", GLUON_PRESETS)
def test_gluon_attention_compiles_for_hopper_and_shares_an_sm_with_qkv(gluon_compiles, preset):
    """The Gluon attention stage compiled offline for sm_90 as the megakernel launches it (the 4B shape's KV group
    of 4 compiles too, though its step keeps the Triton stages): before the PDL wait it reads only the position,
    the q/k norm weights and the RoPE row (6 16-byte loads per thread) and starts cp.async copies of the cached
    K/V of its first two blocks (2 x 2 x [64, 128] bf16 in 16-byte copies: 32 per thread), nothing is written;
    after the wait the copies of a second task's blocks and of the ring; a bounded number of CTA barriers (the
    Triton stage had 19: q/k norms, the softmax of each block, operand conversions), 32 batched m16n8k16 mma per
    block (16 for the scores, 16 for p @ V; in the block loop and twice in the two-block step), and registers and
    shared memory that fit on an SM beside the QKV stage's program, which launched it."""
    r = gluon_compiles[preset]
    qkv = gluon_compiles["stage0"]
    assert r["loads_before_wait"] == 7 and r["stores_before_wait"] == 0
    assert r["copies_before_wait"] == 32 and r["copies"] == 80 and r["mma"] == 32 + 64
    assert r["barriers_after_wait"] <= 9
    assert r["spill_bytes"] <= 96
    assert r["regs"] * 128 + qkv["regs"] * qkv["threads"] <= 65536
    assert r["shared"] + qkv["shared"] <= 227 * 1024


def test_moved_weights_drop_the_batch1_graphs_that_hold_gluon_descriptors():
    """A CUDA graph keeps a Gluon stage's TMA descriptor (old addresses) as a kernel parameter: when `bind` finds
    that weights or cache moved, the batch-1 graphs go; other batches' graphs (no megakernel) stay."""
    from rlbench.engine.megakernel import BatchOneDecoder
    from rlbench.engine.runner import ModelRunner

    class Stub:
        moved, active = True, {0: ()}

        def bind(self, *_):
            return self.moved

        def gluon_active(self):
            return self.active

    runner = ModelRunner.__new__(ModelRunner)
    runner.layers, runner.cache = [], type("C", (), {"k": [], "v": []})()
    for moved, active, left in ((False, {0: ()}, 3), (True, {}, 3), (True, {0: ()}, 1)):
        runner.megakernel = BatchOneDecoder(Stub())
        runner.megakernel.layers.moved, runner.megakernel.layers.active = moved, active
        runner._graphs = {(1, 256, "sample"): 0, (1, 512, "greedy"): 0, (4, 256, "sample"): 0}
        runner.bind_megakernel()
        assert len(runner._graphs) == left and (4, 256, "sample") in runner._graphs


def test_released_weights_are_not_held_by_the_megakernel():
    """`sleep(release_weights=True)` must free the fused weights: the megakernel drops its references (layers and
    the Gluon stages' TMA descriptors) and binds afresh at the next step."""
    import gc
    import weakref

    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.kv_cache import CacheShape, KVCache
    from rlbench.engine.megakernel import BatchOneDecoder
    from rlbench.engine.megakernel.host import DecodeMegakernel
    from rlbench.engine.runner import ModelRunner

    model = build_model("tiny", dtype=torch.bfloat16)
    layers = fuse_layers(model)
    c = model.config
    cache = KVCache(CacheShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, 64), torch.bfloat16, "cpu")
    runner = ModelRunner.__new__(ModelRunner)
    runner.layers = layers
    runner.megakernel = BatchOneDecoder(DecodeMegakernel(model, layers, 64, torch.device("cpu")))
    mk = runner.megakernel.layers
    assert mk.bind(layers, cache.k, cache.v) and not mk.bind(layers, cache.k, cache.v)
    ref = weakref.ref(layers[0].qkv)
    del layers
    runner.release_weights()
    gc.collect()
    assert ref() is None  # the megakernel kept the fused layers (and so their storage) alive before unbind


def test_megakernel_config_takes_gluon_from_a_command_line():
    from rlbench.configs.engine import MegakernelConfig

    assert MegakernelConfig(gluon=0).gluon is False
    assert MegakernelConfig(gluon=1).gluon is True
    assert MegakernelConfig().gluon is None
    assert TorchEngineConfig(megakernel=False).megakernel == MegakernelConfig(enabled=False)


def test_bind_refuses_a_misaligned_weight():
    """The kernel declares table addresses 16-byte aligned; a view at an odd offset is named, not misread."""
    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.kv_cache import CacheShape, KVCache
    from rlbench.engine.megakernel.host import DecodeMegakernel

    model = build_model("tiny", dtype=torch.bfloat16)
    layers = fuse_layers(model)
    c = model.config
    cache = KVCache(CacheShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, 64), torch.bfloat16, "cpu")
    mk = DecodeMegakernel(model, layers, 64, torch.device("cpu"), programs=1)
    mk.bind(layers, cache.k, cache.v)  # aligned: fine
    w = layers[1].down
    layers[1].down = torch.empty(w.numel() + 1, dtype=w.dtype)[1:].view_as(w).copy_(w)  # 2 bytes off
    with pytest.raises(ValueError, match="layer 1's down tensor is not 16-byte aligned"):
        mk.bind(layers, cache.k, cache.v)


@interpreted_mk
@needs_triton
def test_interpreted_barrier_that_cannot_complete_times_out_into_an_error(interpreted):
    """Program 0 waits at a barrier program 1 never reaches (the interpreter runs them one after the other):
    the wait gives up after MAX_SPINS polls, later barriers pass, and check() raises instead of the step hanging."""
    assert "timed out at a grid barrier: not all 2 programs were resident" in interpreted["timeout"]


@interpreted_mk
@needs_triton
def test_engine_raises_after_the_first_window_of_a_stalled_megakernel(interpreted):
    """Each launch with a non-resident program stalls for MAX_SPINS polls: the engine must not launch it for the
    whole generate (16 tokens here) before saying so, but stop after its first window of 4 steps."""
    launches, err = interpreted["engine_timeout"]
    assert "timed out at a grid barrier" in err and launches == 4


def test_carveout_hint_that_cannot_be_set_warns_instead_of_failing_the_decode(monkeypatch):
    import ctypes

    from rlbench.engine.megakernel.host import set_carveout

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    with pytest.warns(UserWarning, match="could not set the shared-memory carveout"):
        set_carveout(1234, 0)


def test_unsupported_names_the_reason():
    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.megakernel.host import unsupported

    model = build_model("tiny", dtype=torch.float32)
    if not os.environ.get("TRITON_INTERPRET"):
        assert "not on CUDA" in unsupported(model, fuse_layers(model), torch.device("cpu"))
    assert "no fused layers" in unsupported(model, None, torch.device("cuda"))
    if importlib.util.find_spec("triton") is not None:
        assert "float32" in unsupported(model, fuse_layers(model), torch.device("cuda"))


@pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="the interpreter makes the CPU supported")
def test_asking_for_it_where_unsupported_warns_and_decodes_normally():
    model = build_model("tiny", dtype=torch.float32)
    with pytest.warns(UserWarning, match="megakernel=True has no effect: not on CUDA"):
        engine = TorchEngine(model, TorchEngineConfig(max_seq_len=64, num_slots=1, megakernel=True))
    assert engine.runner.megakernel is None
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert len(out.token_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA device")
@pytest.mark.parametrize("prompt_len,sync,gluon,attention", [
    (5, None, None, None), (300, None, None, None), (1024, None, None, None), (1400, None, None, None),
    (2100, None, None, None), (2500, None, None, None), (300, None, None, False), (1400, None, None, False),
    (300, None, False, None), (1400, None, False, None), (300, "barrier", None, None)])
def test_megakernel_06b_rounds_like_the_hf_layers(prompt_len, sync, gluon, attention):
    """qwen3-0.6b-shape with one program per SM, the device's default stage sync (PDL on an H100/H200, with the
    Gluon GEMV and attention stages by default there; attention=False: the Triton attention stage; gluon=False:
    every stage in Triton) and the grid-barrier kernel (barriers, merge tickets and the cache write live). On
    132 SMs, position 1400 gives attention tasks of 2 blocks, 2100 gives 136 tasks (4 programs run a second one)
    and 2500 tasks of 3 blocks (the Gluon stage's block ring refills a buffer); at 1024 the task holding the new
    token has no cached position (its block starts at 1024)."""
    r = compare_to_f64("qwen3-0.6b-shape", prompt_len, "cuda", max_seq_len=max(1536, (prompt_len // 64 + 2) * 64),
                       sync=sync, gluon=gluon, attention=attention)
    label = {False: " triton stages"}.get(gluon, "") + {False: " triton attention"}.get(attention, "")
    _check(r, f"0.6b @ {prompt_len} {sync or 'default'}{label}")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ GPU")
def test_gluon_gemv_stages_are_the_default_on_sm90():
    """On an H100/H200 the engine's megakernel runs all four GEMV stages of the 0.6B shape in Gluon, and its
    attention stage, none of the 4B shape's (their tiles exceed GLUON_TILE_BYTES), and megakernel gluon=False
    turns them off."""
    for preset, stages in (("qwen3-0.6b-shape", [0, 2, 3, 4]), ("qwen3-4b-shape", [])):
        engine = TorchEngine(build_model(preset, device="cuda", dtype=torch.bfloat16),
                             TorchEngineConfig(max_seq_len=256, num_slots=1, compile=False, cuda_graphs=False))
        mk = engine.runner.megakernel.layers
        assert sorted(mk.gluon_active()) == stages, preset
        assert mk.gluon_attention_active() == bool(stages), preset  # it needs their carveout
    engine = TorchEngine(build_model("qwen3-0.6b-shape", device="cuda", dtype=torch.bfloat16),
                         TorchEngineConfig(max_seq_len=256, num_slots=1, compile=False, cuda_graphs=False,
                                           megakernel=MegakernelConfig(gluon=False)))
    mk = engine.runner.megakernel.layers
    assert mk.gluon_active() == {} and not mk.gluon_attention_active()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA device")
def test_megakernel_4b_pipelined_tiles_round_like_the_hf_layers():
    """qwen3-4b-shape: every GEMV tile has 8-40 K chunks, so every stage runs the cp.async pipeline path."""
    _check(compare_to_f64("qwen3-4b-shape", 700, "cuda", max_seq_len=1536), "4b @ 700")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["qwen3-0.6b-shape", "qwen3-4b-shape"])
def test_megakernel_gives_the_same_bits_every_call(preset):
    """With relaxed barrier polls, the 4B shape's cp.async loads (through L1) read stale activations: its output
    changed from call to call (session 6). Every poll is an acquire now."""
    assert distinct_outputs(preset, 1024) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["qwen3-0.6b-shape", "qwen3-4b-shape"])
def test_stage_kernels_give_the_same_bits_with_and_without_pdl(preset):
    """The per-stage kernels with PDL against the same kernels in plain stream order: the same bits (hidden and
    new K/V), the same every call (a stage reading before its wait would vary). The grid-barrier kernel, whose
    merge differs in summation order, must be repeatable too."""
    seen = sync_outputs(preset, 1024, ("barrier", "pdl", "launch"), calls=4)
    assert {k: len(v) for k, v in seen.items()} == {"barrier": 1, "pdl": 1, "launch": 1}
    assert seen["pdl"] == seen["launch"]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA device")
@pytest.mark.parametrize("sync", ["barrier", "pdl"])
def test_megakernel_engine_greedy_matches_hf_up_to_near_ties(sync):
    """Batch-1 greedy through graphs + megakernel vs HF generate, 96 tokens from 4 prompts one at a time."""
    model = build_model("qwen3-0.6b-shape", device="cuda", dtype=torch.bfloat16)
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=512, num_slots=1, megakernel=MegakernelConfig(
                                                      enabled=True, sync=sync)))
    assert engine.runner.megakernel is not None and engine.runner.megakernel.layers.stage_sync == sync
    g = torch.Generator().manual_seed(0)
    worst, exact = 0.0, 0
    for n in (16, 40, 100, 200):
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=96))[0].token_ids
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            hf = model.generate(ids, do_sample=False, max_new_tokens=96, min_new_tokens=96, pad_token_id=0,
                                attention_mask=torch.ones_like(ids))[0, n:].tolist()
        if ours == hf:
            exact += 1
            continue
        d = next(i for i, (a, b) in enumerate(zip(ours, hf)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ours[: d + 1]], device="cuda")).logits[0, -2].float()
        worst = max(worst, abs(float(logits[hf[d]] - logits[ours[d]])))
        print(f"prompt {n}: diverges at {d}, logit gap {worst:.4f}")
    print(f"\nmegakernel greedy: {exact}/4 prompts identical to HF over 96 tokens; worst tie gap {worst:.4f}")
    assert engine.runner._graphs and worst < 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA device")
def test_megakernel_engine_survives_sleep_wake_and_a_weight_update():
    """Batch-1 greedy through graphs + the default megakernel (Gluon GEMV stages on sm_90+, whose TMA descriptors
    are built per weight address), then sleep with the weights released, wake up at new addresses, refill the
    weights: the same tokens as before."""
    model = build_model("qwen3-0.6b-shape", device="cuda", dtype=torch.bfloat16)
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=256, num_slots=1, compile=False))
    assert engine.runner.megakernel is not None
    state = [(k, v.clone()) for k, v in model.state_dict(keep_vars=False).items()]
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    before = engine.generate([[11, 22, 33, 44, 55]], params)[0].token_ids
    engine.sleep(release_weights=True)
    with pytest.warns(UserWarning, match="update_weights"):
        engine.wake_up()
    engine.update_weights([state], version=1)
    after = engine.generate([[11, 22, 33, 44, 55]], params)[0].token_ids
    print(f"\ngluon stages {sorted(engine.runner.megakernel.layers.gluon_active())}: {before[:8]} ... == "
          f"{after[:8]} ...")
    assert after == before
