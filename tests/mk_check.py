"""Checks of the batch-1 decode megakernel shared by tests/test_megakernel.py's CPU and GPU tests.

`python tests/mk_check.py` (with TRITON_INTERPRET=1 set before Triton is imported, which is why the CPU
tests run it in a subprocess) prints the CPU cases as one JSON line.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys

import torch

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.engine.kv_cache import CacheShape, KVCache
from rlbench.engine.megakernel import layout
from rlbench.engine.megakernel.host import DecodeMegakernel
from rlbench.engine.runner import ModelRunner
from rlbench.models import build_model

CPU_CASES = [("tiny", 63, None), ("tiny", 130, None), ("small", 64, None), ("tiny", 100, 12)]
"""(preset, position, tile_programs): split boundaries (63 -> 1 split of 64 positions, 64 -> 2, 130 -> 3); tiny
has 2 q heads per KV head; tiles cut for 12 programs give rows per task that are not powers of two (11 of a
16-row block for QKV, 6 of 8 for o_proj), run as 12 tasks by the one interpreted program. `small`'s tiles, cut for
the one program, are multi-chunk: o_proj 4 chunks (register double buffering), QKV 8, gate/up 16 and down 12
(the cp.async pipeline path, PIPELINE_MIN_CHUNKS)."""


def case_name(preset, prompt_len, tile_programs):
    return f"{preset}@{prompt_len}" + (f"/tiles{tile_programs}" if tile_programs else "")


@contextlib.contextmanager
def constants(**values):
    """`layout`'s constants set to `values` (None: left as they are) inside the block (`DecodeMegakernel` reads
    them at each call): to force a path the product's plan would not take, e.g. MAX_SPINS=64."""
    values = {k: v for k, v in values.items() if v is not None}
    saved = {k: getattr(layout, k) for k in values}
    try:
        for k, v in values.items():
            setattr(layout, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(layout, k, v)


def _runner(model, max_seq_len, device, dtype=torch.bfloat16, megakernel=True):
    c = model.config
    cache = KVCache(CacheShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 2, max_seq_len), dtype,
                    device)
    return ModelRunner(model, cache, TorchEngineConfig(compile=False, cuda_graphs=False, megakernel=megakernel))


@torch.inference_mode()
def compare_to_f64(preset, prompt_len, device, max_seq_len=256, tile_programs=None, sync=None, gluon=None,
                   attention=None):
    """One batch-1 decode step at position `prompt_len` three ways: the megakernel (its `stage_sync`, default
    the device's), the engine's bf16 layer stack (HF's ops) and float64 (same weights, same cached K/V). Returns
    errors vs float64 and cache checks. `gluon` / `attention`: set `gluon_gemv` / `layout.GLUON_ATTENTION` (None:
    the default)."""
    model = build_model(preset, device=device, dtype=torch.bfloat16, seed=0).eval()
    runner = _runner(model, max_seq_len, device)
    assert runner.megakernel is not None
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    runner.prefill([prompt.tolist()], [0])
    k0, v0 = [k.clone() for k in runner.cache.k], [v.clone() for v in runner.cache.v]
    pos, tok = torch.tensor([prompt_len], device=device), torch.tensor([7], device=device)
    hidden, cos, sin, index, mask = runner._prologue(tok, pos, runner.state.prefix_len[:1], max_seq_len, 1)
    h_stack = runner._layer_stack(hidden.clone(), cos, sin, pos, index, mask, max_seq_len, 1)
    k_stack = [k[0, :, prompt_len].clone() for k in runner.cache.k]
    for dst, src in zip((*runner.cache.k, *runner.cache.v), (*k0, *v0)):
        dst.copy_(src)
    mk = runner.megakernel.layers
    if tile_programs is not None:  # the tiling of a GPU with that many SMs, run by this device's grid
        mk = DecodeMegakernel(model, runner.layers, max_seq_len, torch.device(device), tile_programs=tile_programs)
    mk.stage_sync = sync or mk.stage_sync
    mk.gluon_gemv = mk.gluon_gemv if gluon is None else gluon
    mk.bind(runner.layers, runner.cache.k, runner.cache.v)
    with constants(GLUON_ATTENTION=attention):
        h_mk = mk(hidden.clone(), cos, sin, pos)

    m64 = copy.deepcopy(model).double()
    r64 = _runner(m64, max_seq_len, device, torch.float64, megakernel=False)
    for dst, src in zip((*r64.cache.k, *r64.cache.v), (*k0, *v0)):
        dst.copy_(src)
    h64, cos64, sin64, index, mask = r64._prologue(tok, pos, r64.state.prefix_len[:1], max_seq_len, 1)
    h64 = r64._layer_stack(h64, cos64, sin64, pos, index, mask, max_seq_len, 1)
    err = {name: (h.double() - h64).abs() for name, h in (("mk", h_mk), ("stack", h_stack))}
    err = {f"{name}_{stat}": float(getattr(e, stat)()) for name, e in err.items() for stat in ("max", "mean")}
    k_err = max(float((runner.cache.k[i][0, :, prompt_len].double() - r64.cache.k[i][0, :, prompt_len]).abs().max())
                for i in range(len(k0)))
    k_err_stack = max(float((k_stack[i].double() - r64.cache.k[i][0, :, prompt_len]).abs().max())
                      for i in range(len(k0)))
    untouched = all(torch.equal(a[0, :, :prompt_len], b[0, :, :prompt_len]) and
                    torch.equal(a[0, :, prompt_len + 1:], b[0, :, prompt_len + 1:])
                    for a, b in zip((*runner.cache.k, *runner.cache.v), (*k0, *v0)))
    return dict(err, k_err=k_err, k_err_stack=k_err_stack, untouched=untouched)


def distinct_outputs(preset, pos, device="cuda", calls=8, max_seq_len=1536) -> int:
    """How many different outputs (bit patterns) the megakernel, with the device's default stage sync, gives for
    one input over `calls` launches with random cached K/V: 1 unless some stage read data from before the barrier
    (or wait) that should order it."""
    (seen,) = sync_outputs(preset, pos, (None,), device, calls, max_seq_len).values()
    return len(seen)


@torch.inference_mode()
def sync_outputs(preset, pos, syncs, device="cuda", calls=4, max_seq_len=1536, tile_programs=None) -> dict:
    """One decode step at `pos` (random cached K/V) run `calls` times with each `DecodeMegakernel.stage_sync`
    (None: the device's default): {sync: the distinct bit patterns of (hidden out, every layer's new K/V row)}.
    Every sync must give one pattern; "pdl" and "launch" run the same kernels, so theirs must be equal."""
    model = build_model(preset, device=device, dtype=torch.bfloat16, seed=0).eval()
    runner = _runner(model, max_seq_len, device)
    gen = torch.Generator(device).manual_seed(0)
    for t in (*runner.cache.k, *runner.cache.v):
        t.normal_(0.0, 1.0, generator=gen)
    hidden = torch.randn(1, 1, model.config.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
    out = {}
    for sync in syncs:
        mk = DecodeMegakernel(model, runner.layers, max_seq_len, torch.device(device), tile_programs=tile_programs)
        mk.stage_sync = sync or mk.stage_sync
        mk.bind(runner.layers, runner.cache.k, runner.cache.v)
        cos = torch.ones(1, 1, mk.hd, device=device, dtype=torch.bfloat16)
        pos_t = torch.tensor([pos], device=device)
        seen = set()
        for _ in range(calls):
            h = mk(hidden.clone(), cos, torch.zeros_like(cos), pos_t)
            rows = [c[0, :, pos] for c in (*runner.cache.k, *runner.cache.v)]
            seen.add(b"".join(t.contiguous().view(torch.int16).cpu().numpy().tobytes() for t in (h, *rows)))
        mk.check()
        out[mk.stage_sync] = seen
    return out


def engine_samples(preset="tiny", max_new_tokens=8):
    """Seeded sampling at batch 1 with and without the megakernel: (token ids, log-probs) of each."""
    model = build_model(preset, dtype=torch.bfloat16, seed=0)
    prompts = [torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=3)
    runs = {}
    for mk in (False, True):
        engine = TorchEngine(model, TorchEngineConfig(max_seq_len=128, num_slots=2, megakernel=mk))
        assert (engine.runner.megakernel is not None) == mk
        g = engine.generate(prompts, sampling)[0]
        runs["mk" if mk else "stack"] = (g.token_ids, g.log_probs)
    return runs


def compile_for_hopper(preset: str, num_warps: int = 8, programs: int = 132, stage: int | None = None) -> dict:
    """Compile `decode_layers` (or, with `stage`, that stage's `decode_stage` kernel with PDL) for sm_90 without a
    GPU (Triton + its bundled ptxas) for a preset's shapes, as `DecodeMegakernel` would launch it on an H100/H200;
    returns registers per thread, spill bytes, how many global loads in the PTX are 16-byte vectors, how many read
    2 bytes and how many are acquires (barrier polls), and, for a stage kernel, the 16-byte loads and the stores
    or atomics that come before its `griddepcontrol.wait` in the PTX."""
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.megakernel.triton_stages import decode_layers, decode_stage

    model = build_model(preset, meta=True, dtype=torch.bfloat16)
    mk = DecodeMegakernel(model, fuse_layers(model), 1536, torch.device("cpu"), programs=programs)
    mk.bf16_dot = True  # as on a GPU
    c = model.config
    bf16 = torch.zeros(1, 1, c.hidden_size, dtype=torch.bfloat16)
    io = (bf16, bf16[..., : mk.hd], bf16[..., : mk.hd], torch.zeros(1, dtype=torch.long))
    fn = decode_layers if stage is None else decode_stage
    args, consts = mk.launch_args(*io) if stage is None else mk.stage_args(*io, layer=0)
    if stage is not None:
        consts.update(STAGE=stage, PDL=True)
    names = list(inspect.signature(fn.fn).parameters)
    dtypes = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32"}
    signature = {n: dtypes[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
                 for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in consts})
    # as the launcher specializes: tensors (16-byte aligned) and ints that are multiples of 16 get the hint
    aligned = [(i,) for i, a in enumerate(args) if isinstance(a, torch.Tensor) or (type(a) is int and a % 16 == 0)]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={i: [["tt.divisibility", 16]] for i in aligned})
    options = dict(num_warps=num_warps, launch_pdl=stage is not None)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx_text = kernel.asm["ptx"]
    regs, spills = _ptxas_usage(ptx_text, f"rlbench_mk_{preset}_{num_warps}"
                                + ("" if stage is None else f"_stage{stage}"))
    loads = re.findall(r"ld\.global\S*", ptx_text)
    out = dict(regs=regs, spill_bytes=spills, threads=32 * num_warps, shared=kernel.metadata.shared,
               vector_loads=sum(".v4." in x for x in loads), two_byte_loads=sum(x.endswith(".b16") for x in loads),
               acquire_loads=sum(".acquire." in x for x in loads))
    if stage is not None:
        before, wait, _ = ptx_text.partition("griddepcontrol.wait")
        out.update(waits=ptx_text.count("griddepcontrol.wait"),
                   vector_loads_before_wait=len(re.findall(r"ld\.global\S*\.v4\.", before)),
                   writes_before_wait=len(re.findall(r"\b(?:st\.global|atom\.|red\.)", before)) if wait else -1)
    return out


def _ptxas_usage(ptx_text: str, name: str) -> tuple[int, int]:
    """Assemble PTX for sm_90a with Triton's bundled ptxas (the file stays in /tmp/NAME.ptx for reading): the
    registers per thread and the spill-store bytes it reports."""
    import re
    import subprocess
    from pathlib import Path

    import triton

    ptx = Path(f"/tmp/{name}.ptx")
    ptx.write_text(ptx_text)
    ptxas = next(Path(triton.__file__).parent.glob("backends/nvidia/bin/ptxas*"))
    info = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", "/dev/null"],
                          capture_output=True, text=True, check=True).stderr
    return (int(re.search(r"Used (\d+) registers", info).group(1)),
            int(re.search(r"(\d+) bytes spill stores", info).group(1)))


def _compile_gluon(fn, args: dict, consts: dict, num_warps: int, name: str, aligned: tuple = ()) -> tuple:
    """Compile the Gluon kernel `fn` for sm_90 without a GPU: `args` its runtime arguments' types, `consts` its
    constexprs, `aligned` the arguments to specialize as 16-divisible (as the launcher does for tensors and
    ints that are). Returns the PTX, registers, spill bytes and shared memory."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(inspect.signature(fn.fn).parameters)
    src = GluonASTSource(fn=fn, signature=args | {c: "constexpr" for c in consts},
                         constexprs={(names.index(c),): v for c, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, launch_pdl=True))
    ptx_text = kernel.asm["ptx"]
    regs, spills = _ptxas_usage(ptx_text, name)
    return ptx_text, regs, spills, kernel.metadata.shared


def compile_gluon_stage(preset: str, stage: int, programs: int = 132) -> dict:
    """Compile `gluon_gemv.gemv_stage` for one GEMV stage of a preset for sm_90 without a GPU, with the options
    `DecodeMegakernel` launches it with; returns registers per thread, spills, shared memory, threads, the TMA
    copies, PDL waits, and the global loads and stores before the wait in the PTX."""
    import re

    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.megakernel import gluon_gemv as mk_gluon

    model = build_model(preset, meta=True, dtype=torch.bfloat16)
    mk = DecodeMegakernel(model, fuse_layers(model), 1536, torch.device("cpu"), programs=programs)
    n, k, r, kcp = mk.gluon_plan()[stage]
    consts = mk.gluon_stage_consts(stage)
    desc = (f"tensordesc<bf16[1, {mk_gluon.MMA_BOX_ROWS.value}, {mk_gluon.MMA_SLICES.value}, "
            f"{mk_gluon.MMA_CHUNK.value}],{mk_gluon.mma_box_layout()!r}>")
    args = dict(desc=desc, inp="*bf16", norm="*bf16", bias="*bf16", out="*bf16", eps="fp32")
    ptx_text, regs, spills, shared = _compile_gluon(
        mk_gluon.gemv_stage, args, consts, consts["WARPS"],
        f"rlbench_gluon_{preset}_stage{stage}")
    before = ptx_text.partition("griddepcontrol.wait")[0]
    block = mk_gluon.MMA_SLICES.value * mk_gluon.MMA_CHUNK.value  # a box: MMA_BOX_ROWS rows of a 512-wide K block
    return dict(regs=regs, spill_bytes=spills, shared=shared, threads=32 * consts["WARPS"],
                boxes=(r // mk_gluon.MMA_BOX_ROWS.value) * (k // block) * (2 if stage == 3 else 1),
                tma_copies=ptx_text.count("cp.async.bulk.tensor"), waits=ptx_text.count("griddepcontrol.wait"),
                loads_before_wait=len(re.findall(r"ld\.global", before)),
                stores_before_wait=len(re.findall(r"\b(?:st\.global|atom\.|red\.)", before)))


def compile_gluon_attention(preset: str, programs: int = 132) -> dict:
    """Compile `gluon_attend.attend_stage` for a preset for sm_90 without a GPU, as `DecodeMegakernel` launches it
    (pointers and 16-aligned ints specialized as the launcher does); returns registers, spills, shared memory, the
    CTA barriers before/after the PDL wait, the cp.async copies, mma instructions, and the global loads and stores
    before the wait in the PTX."""
    import re

    from rlbench.engine.fused import fuse_layers
    from rlbench.engine.megakernel import gluon_attend as mk_attend

    model = build_model(preset, meta=True, dtype=torch.bfloat16)
    mk = DecodeMegakernel(model, fuse_layers(model), 1536, torch.device("cpu"), programs=programs)
    ptrs = dict(qkv="*bf16", kc="*bf16", vc="*bf16", q_norm="*bf16", k_norm="*bf16", cos="*bf16", sin="*bf16",
                pos_ptr="*i64", part_acc="*fp32", part_m="*fp32", part_l="*fp32")
    args = ptrs | dict(eps="fp32", scale="fp32", head_stride="i32", max_splits="i32")
    consts = mk.gluon_attend_consts()
    ptx_text, regs, spills, shared = _compile_gluon(mk_attend.attend_stage, args, consts, mk_attend.WARPS.value,
                                                    f"rlbench_gluon_{preset}_attend", aligned=(*ptrs, "head_stride"))
    before, _, after = ptx_text.partition("griddepcontrol.wait")
    return dict(regs=regs, spill_bytes=spills, shared=shared, barriers_before_wait=before.count("bar.sync"),
                barriers_after_wait=after.count("bar.sync"), copies=ptx_text.count("cp.async.cg"),
                copies_before_wait=before.count("cp.async.cg"),
                mma=ptx_text.count("mma.sync"), loads_before_wait=len(re.findall(r"ld\.global", before)),
                stores_before_wait=len(re.findall(r"\b(?:st\.global|atom\.|red\.)", before)))


@torch.inference_mode()
def barrier_timeout() -> str:
    """Two programs under the interpreter, which runs program 0 to its end before program 1 starts: program 0's
    first barrier can never complete, as on a GPU whose programs are not all resident. Returns check()'s error."""
    model = build_model("tiny", dtype=torch.bfloat16, seed=0).eval()
    runner = _runner(model, 128, "cpu")
    mk = DecodeMegakernel(model, runner.layers, 128, torch.device("cpu"), programs=2)
    mk.bind(runner.layers, runner.cache.k, runner.cache.v)
    pos = torch.tensor([5])
    hidden, cos, sin, _, _ = runner._prologue(torch.tensor([3]), pos, runner.state.prefix_len[:1], 128, 1)
    with constants(MAX_SPINS=64):
        mk(hidden, cos, sin, pos)
    try:
        mk.check()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _interpreter_numpy_shim():
    """numpy >= 2.4 refuses int() of the 1-element arrays Triton's interpreter (3.6) keeps scalars in."""
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


@torch.inference_mode()
def engine_stops_at_first_window() -> tuple[int, str]:
    """An engine whose megakernel has a non-resident program (2 programs under the interpreter, as above): how
    many batch-1 launches ran before `generate` raised, and the error (the engine checks after every window of
    `steps_per_sync` steps, so a stalled kernel is not launched for the whole generate)."""
    model = build_model("tiny", dtype=torch.bfloat16, seed=0).eval()
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=128, num_slots=1, megakernel=True, steps_per_sync=4))
    runner = engine.runner
    mk = DecodeMegakernel(model, runner.layers, 128, torch.device("cpu"), programs=2)

    class Counted:  # the megakernel, counting its launches
        launches = 0

        def __call__(self, *args):
            self.launches += 1
            return mk(*args)

        def __getattr__(self, name):
            return getattr(mk, name)

    runner.megakernel.layers = counted = Counted()
    try:
        with constants(MAX_SPINS=64):
            engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    except RuntimeError as err:
        return counted.launches, str(err)
    return counted.launches, "no error"


def finish_step_matches_torch() -> bool:
    """`step.finish_step` (one Triton kernel, interpreted here) does what `_decode_eager`'s torch ops do:
    3 of 5 slots, one at the position limit."""
    from rlbench.engine.megakernel.step import finish_step
    from rlbench.engine.runner import SlotState

    def state():
        s = SlotState(5, 16, torch.device("cpu"))
        s.tokens.copy_(torch.tensor([4, 5, 6, 7, 8]))
        s.positions.copy_(torch.tensor([3, 9, 1, 2, 9]))
        s.steps.copy_(torch.tensor([0, 1, 2, 3, 4]))
        return s

    tok, lp = torch.tensor([11, 12, 13]), torch.tensor([-0.5, -1.5, -2.5])
    a, b = state(), state()
    finish_step(a, 3, tok, lp, 9)
    b.out_tokens[:3].copy_(tok)
    b.out_log_probs[:3].copy_(lp)
    b.tokens[:3].copy_(tok)
    b.positions[:3].add_(1).clamp_(max=9)
    b.steps[:3].add_(1)
    names = ("tokens", "positions", "steps", "out_tokens", "out_log_probs")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)


def head_matches_sampling() -> dict:
    """`head.SampleHead` (interpreted, 4 programs) against the compiled head's math on the CPU
    (`greedy_tokens` / `sample_tokens` of `lm_head(norm(hidden))` in bf16): a 1,000-token vocabulary (a partial
    last block), greedy and sampled rows, 24 (seed, step) pairs. Returns the mismatches and the largest log-prob
    difference."""
    from types import SimpleNamespace

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from rlbench.engine.megakernel.head import SampleHead
    from rlbench.engine.runner import SlotState
    from rlbench.engine.sampling import greedy_tokens, sample_tokens

    torch.manual_seed(0)
    d, v = 64, 1000
    lm_head = torch.nn.Linear(d, v, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(lm_head.weight, std=0.3)
    norm = Qwen3RMSNorm(d, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.2)
    head = SampleHead(SimpleNamespace(lm_head=lm_head), SimpleNamespace(norm=norm), torch.device("cpu"), programs=4)
    bad, worst = 0, 0.0
    for case in range(24):
        hidden = torch.randn(1, 1, d).to(torch.bfloat16)
        mode = "greedy" if case % 4 == 0 else "sample"
        temp = [0.0, 0.7, 1.0, 1.3][case % 4]
        st = SlotState(1, v, torch.device("cpu"))
        st.temperature.fill_(temp)
        st.seeds.fill_(1000 + case)
        st.steps.fill_(case * 7)
        st.positions.fill_(5)
        with torch.no_grad():
            logits = lm_head(norm(hidden[:, -1]))
            if mode == "greedy":
                tok, lp = greedy_tokens(logits)
            else:
                tok, lp = sample_tokens(logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps,
                                        st.vocab_hash, False)
        head(hidden, st, mode, 9)
        bad += int(st.out_tokens[0] != tok[0] or st.tokens[0] != tok[0] or st.positions[0] != 6 or st.steps[0] != case * 7 + 1)
        worst = max(worst, abs(float(st.out_log_probs[0] - lp[0])))
    nan_tokens = []  # NaN hidden states (a stalled megakernel's output): still token ids the engine can embed
    for mode in ("greedy", "sample"):
        st = SlotState(1, v, torch.device("cpu"))
        st.temperature.fill_(1.0)
        head(torch.full((1, 1, d), float("nan"), dtype=torch.bfloat16), st, mode, 9)
        nan_tokens.append(int(st.out_tokens[0]))
    return dict(mismatches=bad, max_lp_diff=worst, nan_tokens_in_range=all(0 <= t < v for t in nan_tokens))


if __name__ == "__main__":
    _interpreter_numpy_shim()
    out = {case_name(*c): compare_to_f64(p, n, "cpu", tile_programs=tp) for c in CPU_CASES for p, n, tp in [c]}
    # the per-stage kernels (one interpreted program: no PDL), their merge included
    out.update({case_name(*c) + "/launch": compare_to_f64(p, n, "cpu", tile_programs=tp, sync="launch")
                for c in CPU_CASES for p, n, tp in [c]})
    out["engine"] = engine_samples()
    out["timeout"] = barrier_timeout()
    out["engine_timeout"] = engine_stops_at_first_window()
    out["finish_step"] = finish_step_matches_torch()
    out["head"] = head_matches_sampling()
    json.dump(out, sys.stdout)
