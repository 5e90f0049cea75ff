"""One process standing in for CP ranks (CPU): `cp_attention_all_ranks` (every rank's query chunk against the
real full K/V) equals full attention; `EmulatedCP`'s gather has a real gather's sizes and an own-slice backward;
the cp-oom length search finds a planted limit, and the experiment writes its tables (tiny model, planted OOMs)."""

from __future__ import annotations

import csv
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from rlbench.distributed.cp_attention import (
    EmulatedCP,
    all_gather_kv,
    cp_attention,
    cp_attention_all_ranks,
    cp_attention_info,
)
from rlbench.experiments import cp_oom, cp_oom_search
from rlbench.packing import cp_gather, cp_layout, cp_local_response, cp_slice, pack_samples, pad_for_cp
from rlbench.types import Sample

LENGTHS = [37, 5, 64, 21]  # not multiples of 2*cp: alignment pads; pad_multiple below adds a trailing pad slot
H, N_KV, HD = 4, 2, 16


def make_layout(cp: int):
    samples = [Sample(tokens=list(range(n)), response_length=n - 1) for n in LENGTHS]
    pack = pad_for_cp(pack_samples(samples), cp, pad_multiple=48)
    return pack, cp_layout(pack, cp)


def doc_causal(pack) -> torch.Tensor:
    """`[T, T]` bool: same slot (explicit boundaries, the trailing pad its own slot) and causal."""
    cu = pack.cu_seqlens_with_pad.long()
    docs = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    return (docs[:, None] == docs[None]) & torch.ones(len(docs), len(docs), dtype=torch.bool).tril()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def qkv(T: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, HD, generator=g, dtype=dtype).requires_grad_() for h in (H, N_KV, N_KV)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_all_ranks_equal_full_attention(cp, one_thread):
    pack, layout = make_layout(cp)
    q, k, v = qkv(pack.num_tokens, cp)
    out = cp_attention_all_ranks(q, k, v, layout)  # [1, T, H, hd]
    grads = torch.autograd.grad((out * torch.sin(out)).sum(), (q, k, v))
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=doc_causal(pack), enable_gqa=True).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * torch.sin(ref)).sum(), (q2, k2, v2))
    assert out.shape == (1, pack.num_tokens, H, HD)
    assert rel(out, ref) <= 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) <= 1e-5


def test_emulated_gather_has_a_real_gathers_sizes_and_an_own_slice_backward():
    x = torch.randn(6, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    for size, rank in [(2, 0), (2, 1), (4, 3), (8, 5)]:
        out = all_gather_kv(x, EmulatedCP(size, rank))
        assert out.shape == (size * 6, 2, 8) and out.dtype == torch.bfloat16
        assert out.untyped_storage().nbytes() == size * x.untyped_storage().nbytes()  # a buffer of its own
        assert all(torch.equal(chunk, x) for chunk in out.detach().chunk(size))
        upstream = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape).to(torch.bfloat16)
        (grad,) = torch.autograd.grad(out, x, upstream)
        assert torch.equal(grad, upstream[rank * 6 : (rank + 1) * 6])  # the own rows, what reduce-scatter sizes
    assert all_gather_kv(x, EmulatedCP(1, 0)) is x


@pytest.mark.parametrize("cp,rank,chunk,recompute", [(2, 0, None, False), (2, 1, 1, True), (4, 2, None, False),
                                                     (4, 3, 1, True)])
def test_emulated_rank_is_the_real_rank_when_every_peer_holds_the_same_chunk(cp, rank, chunk, recompute, one_thread):
    """With the pack's K/V built so that every rank holds the same chunk, the emulated gather IS the real one:
    the emulated rank's output equals its rows of `cp_attention_all_ranks`, and its K/V gradient equals the part
    of the true gradient of its own rows that its own queries contribute."""
    pack, layout = make_layout(cp)
    info = cp_attention_info(layout, rank)
    q_full, k_loc, v_loc = qkv(pack.num_tokens, 10 + rank)
    k_loc, v_loc = (x[:, :, : info.local_tokens].detach().clone().requires_grad_() for x in (k_loc, v_loc))
    q_loc = cp_slice(q_full.detach(), layout, rank, dim=2).requires_grad_()
    out = cp_attention(q_loc, k_loc, v_loc, info, EmulatedCP(cp, rank), kv_head_chunk=chunk, recompute=recompute)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    gq, gk, gv = torch.autograd.grad((w * out).sum(), (q_loc, k_loc, v_loc))

    k_full, v_full = (cp_gather([x.detach()] * cp, layout, dim=2).requires_grad_() for x in (k_loc, v_loc))
    q_ref = q_full.detach().clone().requires_grad_()
    ref = cp_attention_all_ranks(q_ref, k_full, v_full, layout)[:, info.q_positions]  # this rank's rows
    rq, rk, rv = torch.autograd.grad((w * ref).sum(), (q_ref, k_full, v_full))
    assert rel(out, ref) <= 1e-6
    assert rel(gq, rq[:, :, info.q_positions]) <= 1e-6
    assert rel(gk, rk[:, :, info.q_positions]) <= 1e-6 and rel(gv, rv[:, :, info.q_positions]) <= 1e-6
    assert float(gk.abs().sum()) > 0


def test_emulated_cp_errors():
    with pytest.raises(ValueError, match="rank < size"):
        EmulatedCP(2, 2)
    pack, layout = make_layout(2)
    info = cp_attention_info(layout, 0)
    q = torch.zeros(1, H, info.local_tokens, HD)
    k = torch.zeros(1, N_KV, info.local_tokens, HD)
    with pytest.raises(ValueError, match="rank 1"):
        cp_attention(q, k, k, info, EmulatedCP(2, 1))
    with pytest.raises(ValueError, match="cp=2"):
        cp_attention(q, k, k, info, EmulatedCP(4, 0))


# ---------------------------------------------------------------- the length search
def fake_probe(limit: int, gib_per_token: float | None = None, base_gib: float = 10.0, noise: float = 0.0):
    """A probe that trains up to `limit` tokens; with `gib_per_token`, peaks on a (slightly bent) line."""
    def probe(n: int) -> cp_oom_search.Trial:
        peak = None if gib_per_token is None else base_gib + gib_per_token * n * (1 + noise * n / limit)
        return cp_oom_search.Trial(2, True, n, n, n // 2, n <= limit, peak, 0.01 if n <= limit else None)
    return probe


@pytest.mark.parametrize("limit", [100, 1000, 4095, 4096, 10_000, 77_777])
@pytest.mark.parametrize("fit", [None, "line", "bent"])
def test_search_finds_a_planted_limit(limit, fit):
    res, cap = 64, 80.0
    per_token = 70.0 / (limit + 1)  # the line reaches the capacity one token past the limit
    probe = fake_probe(limit) if fit is None else fake_probe(limit, per_token, noise=0.1 if fit == "bent" else 0.0)
    lo, hi, complete, trials = cp_oom_search.search_longest(probe, start=1024, max_len=131072, resolution=res,
                                                     capacity_gib=None if fit is None else cap)
    assert complete
    assert lo == (limit // res) * res and hi == lo + res  # bracketed to the resolution
    assert all(t.response_len % res == 0 for t in trials)
    assert len({t.response_len for t in trials}) == len(trials)  # nothing probed twice
    assert len(trials) <= 2 * math.ceil(math.log2(131072 / res)) + 2
    if fit == "line" and limit >= 4096:
        # 1024, 2048, guesses at most 4x past the longest trained, the last one trains, one step up fails
        assert [t.response_len for t in trials[:2]] == [1024, 2048] and len(trials) <= 6
        assert trials[-2].response_len == lo and trials[-1].response_len == lo + res


def test_search_stops_at_max_len_and_at_the_deadline():
    lo, hi, complete, trials = cp_oom_search.search_longest(fake_probe(10**9), start=256, max_len=3000 // 64 * 64,
                                                     resolution=64)
    assert (lo, hi, complete) == (2944, None, True) and [t.response_len for t in trials] == [256, 512, 1024, 2048, 2944]
    clock = itertools.count(0.0, 1.0).__next__  # one second per call
    lo, hi, complete, trials = cp_oom_search.search_longest(fake_probe(5000), start=256, max_len=65536, resolution=64,
                                                     deadline=4.5, clock=clock)
    assert not complete and len(trials) == 5 and lo == 4096 and hi is None  # the 6th would start at t=5 > 4.5


def test_fit_and_time_predictions():
    trials = [cp_oom_search.Trial(1, True, n, n, n, True, 20.0 + n / 1000, 1e-3 * n + 1e-8 * n * n) for n in (1000, 2000)]
    assert cp_oom_search.fit_limit(trials, 80.0, 64) == 59968  # 60000 floored to the resolution
    assert cp_oom_search.fit_limit(trials, None, 64) is None and cp_oom_search.fit_limit(trials[:1], 80.0, 64) is None
    assert cp_oom_search.predict_seconds(trials, 8000) == pytest.approx(8.0 + 0.64)
    assert cp_oom_search.predict_seconds(trials[:1], 2000) == pytest.approx(trials[0].step_s * 4)


# ---------------------------------------------------------------- the experiment on a tiny model (CPU)
PLANTED = {(1, True): 700, (2, True): 1400, (1, False): 450, (2, False): 900}  # (cp, ac) -> longest that fits


def own_share(cfg, cp: int, n: int) -> float:
    """The fraction of the response tokens an emulated rank 0 scores (its loss holds only those)."""
    pack = cp_oom.make_pack(cfg, cp, n, 128)
    local_pos, _ = cp_local_response(pack, cp_layout(pack, cp), 0)
    return local_pos.numel() / pack.response_index.numel()


def test_cp_oom_on_cpu_finds_the_planted_limits_and_writes_the_tables(tmp_path, one_thread):
    cfg = cp_oom.CPOOMConfig(preset="tiny", device="cpu", cps=(1, 2), acs=(True, False), start_len=128,
                             max_len=2048, resolution=128, time_budget_s=600, out=str(tmp_path))
    cells = cp_oom.run_cp_oom(cfg, planted_oom=lambda cp, ac, n: n > PLANTED[(cp, ac)])
    got = {(c.cp, c.ac): (c.longest, c.shortest_oom, c.complete) for c in cells}
    assert got == {key: (n // 128 * 128, n // 128 * 128 + 128, True) for key, n in PLANTED.items()}
    for c in cells:
        for t in c.trials:
            assert t.works == (t.response_len <= PLANTED[(c.cp, c.ac)])
            assert t.rank_tokens * c.cp == t.pack_tokens and t.pack_tokens % (128 * c.cp) == 0
            assert t.peak_gib is None  # CPU: no allocator peak
            if t.works:  # a real step: the token-mean NLL of a random init, ~ln(128) per token scored, and gradients
                assert abs(t.loss / own_share(cfg, c.cp, t.response_len) - math.log(128)) < 0.5
                assert t.grad_norm > 0 and t.step_s > 0
    rows = list(csv.DictReader(open(tmp_path / "cp_oom_trials.csv")))
    assert len(rows) == sum(len(c.trials) for c in cells)
    assert {(r["cp"], r["emulated"]) for r in rows} == {("1", "False"), ("2", "True")}
    cell_rows = list(csv.DictReader(open(tmp_path / "cp_oom_cells.csv")))
    assert [(r["cp"], r["ac"], r["longest"]) for r in cell_rows] == [
        ("1", "True", "640"), ("2", "True", "1280"), ("1", "False", "384"), ("2", "False", "896")]
    md = (tmp_path / "cp_oom.md").read_text()
    header = "| | 128 | 256 | 512 | 1k | 2k | longest that trains | extrapolated |"
    assert md.count(header) == 2 and "emulation of one CP rank" in md
    assert "| FSDP cp1 | works | works | works | OOM | (OOM) | 640 | — |" in md  # AC on
    assert "| FSDP cp2 (emulated) | works | works | works | OOM | (OOM) | 896 | — |" in md  # AC off
    assert "- AC on, cp2/cp1: longest that trains 2.00x" in md
    assert "- AC off, cp2/cp1: longest that trains 2.33x" in md


def test_cli_runs_the_experiment(tmp_path, one_thread):
    from rlbench.cli import main

    assert main(["experiment", "cp-oom", "--device", "cpu", "--preset", "tiny", "--cp", "2", "--ac", "off",
                 "--start-len", "128", "--max-len", "256", "--resolution", "128", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "cp_oom_trials.csv")))
    assert [(r["cp"], r["ac"], r["response_len"], r["works"]) for r in rows] == [
        ("2", "False", "128", "True"), ("2", "False", "256", "True")]
    assert main(["experiment", "no-such"]) == 2


def test_config_errors():
    with pytest.raises(ValueError, match="multiples of resolution"):
        cp_oom.CPOOMConfig(start_len=1000, resolution=128)
    with pytest.raises(ValueError, match="emulated_rank"):
        cp_oom.CPOOMConfig(cps=(1, 2), emulated_rank=2)
    with pytest.raises(ValueError, match="memory_gib"):
        cp_oom.CPOOMConfig(device="cpu", memory_gib=10)
