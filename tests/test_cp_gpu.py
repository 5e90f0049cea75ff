"""CP attention's CUDA kernel path (compiled flex + `cp_block_mask`) on the GPU (`pytest -m gpu -s tests/test_cp_gpu.py`).

Every rank's computation is emulated in one process (`cp_attention_all_ranks`: each rank's zig-zag query chunk
against the real full K/V) and compared, forward and backward, with full document-causal attention in float64;
the emulated rank (`EmulatedCP`) runs the gather path; a small cp-oom sweep finds real OOM limits under a
memory cap. The errors are printed (`-s`) for docs/LOG.md.
"""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F

from rlbench.distributed.cp_attention import (
    EmulatedCP,
    cp_attention,
    cp_attention_all_ranks,
    cp_attention_info,
)
from rlbench.experiments import cp_oom
from rlbench.packing import cp_gather, cp_layout, cp_slice, pack_samples, pad_for_cp
from rlbench.types import Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32")]

H, N_KV, HD = 8, 2, 128
LENGTHS = [1000, 77, 1501, 300]  # not multiples of 2*cp; the padding adds a trailing pad slot
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |err| / max |ref| against float64: fp32 flex is IEEE fp32 (no TF32); bf16 against SDPA's own bf16 error
FP32_TOL = {"out": 1e-5, "grad": 1e-4}


def make_layout(cp: int, pad_multiple: int = 128):
    samples = [Sample(tokens=list(range(n)), response_length=n - 1) for n in LENGTHS]
    pack = pad_for_cp(pack_samples(samples), cp, pad_multiple=pad_multiple * cp)
    return pack, cp_layout(pack, cp)


def doc_causal(pack, device) -> torch.Tensor:
    cu = pack.cu_seqlens_with_pad.long()
    docs = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1]).to(device)
    T = docs.numel()
    return (docs[:, None] == docs[None]) & torch.ones(T, T, dtype=torch.bool, device=device).tril()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def inputs(T: int, dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, h, T, HD, device="cuda", generator=g).to(dtype).requires_grad_() for h in (H, N_KV, N_KV)]


def attend_and_grads(fn, q, k, v, w):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)  # [1, T, H, hd]
    grads = torch.autograd.grad((w.to(out.dtype) * out).sum(), (q, k, v))
    return out.detach(), grads


def sdpa(mask):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    return fn


def errors(pack, layout, dtype, seed=0):
    """(CP kernel path's errors, SDPA-in-dtype's errors) vs float64 full attention, for out, dq, dk, dv."""
    q, k, v = inputs(pack.num_tokens, dtype, seed)
    w = torch.randn(1, pack.num_tokens, H, HD, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    mask = doc_causal(pack, "cuda")
    ref = attend_and_grads(sdpa(mask), q.double(), k.double(), v.double(), w.double())
    got = attend_and_grads(lambda a, b, c: cp_attention_all_ranks(a, b, c, layout), q, k, v, w)
    base = attend_and_grads(sdpa(mask), q, k, v, w)

    def errs(x):
        return [rel(x[0], ref[0])] + [rel(g, r) for g, r in zip(x[1], ref[1])]

    return errs(got), errs(base)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_flex_cp_path_equals_full_attention(cp, dtype):
    pack, layout = make_layout(cp)
    got, base = errors(pack, layout, DTYPES[dtype])
    print(f"\n[cp-gpu] cp={cp} {dtype} T={pack.num_tokens}: CP flex err out/dq/dk/dv "
          + " ".join(f"{e:.1e}" for e in got) + " | SDPA " + " ".join(f"{e:.1e}" for e in base))
    if dtype == "fp32":
        assert got[0] <= FP32_TOL["out"] and max(got[1:]) <= FP32_TOL["grad"]
    else:  # as accurate as the dense SDPA kernel in bf16
        assert all(g <= 2 * b + 2e-3 for g, b in zip(got, base)), (got, base)
        assert got[0] <= 2e-2 and max(got[1:]) <= 5e-2


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cp,rank,chunk,recompute", [(2, 1, None, False), (4, 0, 1, True), (8, 5, None, True)])
def test_emulated_rank_runs_the_gather_path_on_cuda(cp, rank, chunk, recompute, dtype):
    """Every peer holding the same chunk makes the emulated gather the real one: the emulated rank equals its
    rows of `cp_attention_all_ranks`, and its K/V gradient the own-query part of the true one."""
    pack, layout = make_layout(cp)
    info = cp_attention_info(layout, rank, "cuda")
    q_full, k_full, v_full = inputs(pack.num_tokens, DTYPES[dtype], seed=cp + rank)
    k_loc, v_loc = (x[:, :, : info.local_tokens].detach().clone().requires_grad_() for x in (k_full, v_full))
    q_loc = cp_slice(q_full.detach(), layout, rank, dim=2).requires_grad_()
    out = cp_attention(q_loc, k_loc, v_loc, info, EmulatedCP(cp, rank), kv_head_chunk=chunk, recompute=recompute)
    w = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(out.dtype)
    gq, gk, gv = torch.autograd.grad((w * out).sum(), (q_loc, k_loc, v_loc))
    k_same, v_same = (cp_gather([x.detach()] * cp, layout, dim=2).requires_grad_() for x in (k_loc, v_loc))
    q_ref = q_full.detach().clone().requires_grad_()
    ref = cp_attention_all_ranks(q_ref, k_same, v_same, layout)[:, info.q_positions]
    rq, rk, rv = torch.autograd.grad((w * ref).sum(), (q_ref, k_same, v_same))
    tol = 1e-5 if dtype == "fp32" else 1e-2
    own = info.q_positions
    assert rel(out, ref) <= tol and rel(gq, rq[:, :, own]) <= tol
    assert rel(gk, rk[:, :, own]) <= tol and rel(gv, rv[:, :, own]) <= tol


def test_cp_oom_sweep_finds_real_limits_under_a_memory_cap(tmp_path):
    """qwen3-0.6b-shape under a 16 GiB cap: real OOMs, the emulated cp2 rank trains longer responses than cp1."""
    cap = 16.0
    cfg = cp_oom.CPOOMConfig(preset="qwen3-0.6b-shape", cps=(1, 2), acs=(True,), start_len=1024, max_len=65536,
                             resolution=512, memory_gib=cap, time_budget_s=100, out=str(tmp_path))
    cells = {c.cp: c for c in cp_oom.run_cp_oom(cfg)}
    for c in cells.values():
        print(f"\n[cp-gpu] sweep {c.label}: longest {c.longest}, OOM at {c.shortest_oom}, extrapolated "
              f"{c.extrapolated}, state {c.state_gib:.2f} GiB, {len(c.trials)} trials, {c.seconds:.0f} s")
        assert c.complete and 1024 <= c.longest < 65536 and c.shortest_oom == c.longest + 512
        works = [t for t in c.trials if t.works]
        assert all(t.peak_gib <= cap for t in works) and all(t.tokens_per_s_per_gpu > 0 for t in works)
        assert all(t.response_len > c.longest for t in c.trials if not t.works)
        assert abs(c.extrapolated - c.longest) <= 0.2 * c.longest  # peak memory is linear in the length
    assert cells[2].longest >= 1.6 * cells[1].longest
    rows = list(csv.DictReader(open(tmp_path / "cp_oom_cells.csv")))
    assert [r["cp"] for r in rows] == ["1", "2"]
    assert "| FSDP cp2 (emulated) |" in (tmp_path / "cp_oom.md").read_text()


@pytest.mark.parametrize("cp", [2, 4])
def test_flex_cp_path_with_partial_blocks(cp):
    """Rank token counts that are not multiples of the 128-token block (the kernel's bounds on the mask's
    captured position tensors); last, since an out-of-bounds read would poison the CUDA context."""
    pack, layout = make_layout(cp, pad_multiple=1)
    assert (pack.num_tokens // cp) % 128
    got, _ = errors(pack, layout, torch.float32, seed=cp)
    print(f"\n[cp-gpu] partial blocks cp={cp} T={pack.num_tokens}: " + " ".join(f"{e:.1e}" for e in got))
    assert got[0] <= FP32_TOL["out"] and max(got[1:]) <= FP32_TOL["grad"]
