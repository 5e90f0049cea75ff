"""The batch-invariant Triton kernels on CUDA (`pytest -m gpu -s tests/test_numerics_gpu.py`).

The CPU tests interpret the kernels, where `tl.dot` is a numpy matmul; here the real instructions run, so
these equalities are the ones that matter: a row's bits across batch sizes and positions (matmul across the
configs of `MATMUL_CONFIGS`, whose small and large tiles lower to different tensor-core instructions), and
attention's decode, packed and padded paths (and decode replayed from a CUDA graph) against each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlbench.numerics import layout

pytest.importorskip("triton")

from test_numerics_triton import decode_inputs, packed_attention, padded_attention  # noqa: E402

from rlbench.numerics import triton_ops as ops  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32")]

DTYPES = [torch.bfloat16, torch.float32]
M_VALUES = [1, 2, 7, 64, 128, 129, 511, 4096]
MATMUL_SHAPES = [(2048, 1024), (1024, 3072), (9728, 2560), (151936, 1024)]
"""(N, K): Qwen3-0.6B q_proj and down_proj, Qwen3-4B gate/up, the 0.6B lm_head."""

DIFFER = "small-M and large-M configs disagree: use one config (a single-entry MATMUL_CONFIGS)"


def _sites(m: int) -> list[int]:
    """Row indices to watch in a batch of m: both ends, tile edges of both configs, the middle."""
    return sorted({i for i in (0, 1, 31, 32, 63, 64, 127, 128, m // 2, m - 1) if 0 <= i < m})


def _rows_in_batches(fn, probe: torch.Tensor, seed: int):
    """Yield `(m, site, out_row, ref_row)`: each probe row computed inside a random batch of m rows at each
    watched site, against that row computed alone (`fn` of a one-row batch)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    alone = [fn(probe[i : i + 1])[0] for i in range(probe.shape[0])]
    for m in M_VALUES:
        sites = _sites(m)
        x = torch.randn(m, probe.shape[1], device="cuda", generator=gen).to(probe.dtype)
        which = [j % probe.shape[0] for j in range(len(sites))]
        x[sites] = probe[which]
        out = fn(x)
        for site, j in zip(sites, which):
            yield m, site, out[site], alone[j]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matmul_rows_invariant_across_m(dtype, shape):
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    probe = torch.randn(4, k, device="cuda", generator=gen).to(dtype)
    small = ops.matmul_config(1)
    for m, site, row, ref in _rows_in_batches(lambda x: ops.matmul(x, w, b), probe, seed=k):
        if not torch.equal(row, ref):
            cfg = ops.matmul_config(m)
            where = DIFFER if cfg != small else f"rows depend on the batch within config {cfg}"
            pytest.fail(f"{where}: M={m}, row {site}, max |diff| {(row.float() - ref.float()).abs().max():.3e}")
    x = probe.repeat(32, 1)
    torch.testing.assert_close(ops.matmul(x, w, b).float(), F.linear(x, w, b).float(),
                               **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matmul_table_configs_agree(monkeypatch, dtype):
    """Every config of the table computes the same M = 512 batch: all elements bitwise equal."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 2560, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(4096, 2560, device="cuda", generator=gen) * 0.02).to(dtype)
    outs = {}
    for _, cfg in ops.MATMUL_CONFIGS:
        monkeypatch.setattr(ops, "MATMUL_CONFIGS", ((0, cfg),))
        outs[cfg] = ops.matmul(x, w, None)
    first, *rest = outs.items()
    for cfg, out in rest:
        diff = (out.float() - first[1].float()).abs()
        assert torch.equal(out, first[1]), (f"{DIFFER}: {cfg} vs {first[0]} differ in {(diff > 0).sum().item()} "
                                            f"of {diff.numel()} elements (max {diff.max():.3e}) in {dtype}")


CANDIDATES = [
    ops.MatmulConfig(16, 32, 4, 4, 16),  # mma.sync
    ops.MatmulConfig(32, 64, 4, 4, 16),  # mma.sync
    ops.MatmulConfig(64, 32, 4, 4, 16),  # wgmma m64n32
    ops.MatmulConfig(64, 64, 4, 4, 16),  # wgmma m64n64
    ops.MatmulConfig(128, 64, 4, 4, 8),
    ops.MatmulConfig(128, 128, 8, 4, 8),  # wgmma m64n128 x 2 warpgroups
    ops.MatmulConfig(128, 256, 8, 3, 8),
]


def test_matmul_candidate_configs_report(monkeypatch):
    """Informational (run with -s): which candidate configs give the same bits as MATMUL_LARGE, per dtype.
    Fails only if a config of the current table is among the disagreeing ones."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    table = {cfg for _, cfg in ops.MATMUL_CONFIGS}
    bad = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(300, 1024, device="cuda", generator=gen).to(dtype)
        w = (torch.randn(1000, 1024, device="cuda", generator=gen) * 0.03).to(dtype)
        monkeypatch.setattr(ops, "MATMUL_CONFIGS", ((0, ops.MATMUL_LARGE),))
        ref = ops.matmul(x, w, None)
        for cfg in CANDIDATES:
            monkeypatch.setattr(ops, "MATMUL_CONFIGS", ((0, cfg),))
            same = torch.equal(ops.matmul(x, w, None), ref)
            print(f"\n{str(dtype):15} {cfg}: {'same bits as' if same else 'DIFFERS from'} MATMUL_LARGE", end="")
            if not same and cfg in table:
                bad.append((dtype, cfg))
    assert not bad, f"{DIFFER}: {bad}"


# ---------------------------------------------------------------------------------- rms_norm, logsumexp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 1024, 2560])
def test_rms_norm_rows_invariant_across_m(dtype, d):
    gen = torch.Generator(device="cuda").manual_seed(d)
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(dtype)
    probe = torch.randn(4, d, device="cuda", generator=gen).to(dtype)
    for m, site, row, ref in _rows_in_batches(lambda x: ops.rms_norm(x, w, 1e-6), probe, seed=d):
        assert torch.equal(row, ref), f"rms_norm D={d}: M={m}, row {site}"
    xf = probe.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(ops.rms_norm(probe, w, 1e-6), hf, **({} if dtype == torch.float32 else
                                                                      dict(rtol=1.6e-2, atol=1.6e-2)))


def test_logsumexp_rows_invariant_across_m():
    v = 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    probe = torch.randn(4, v, device="cuda", generator=gen) * 3
    probe[1, :100000] = float("-inf")
    for m, site, row, ref in _rows_in_batches(ops.logsumexp_rows, probe, seed=1):
        assert torch.equal(row, ref), f"logsumexp_rows: M={m}, row {site}"
    torch.testing.assert_close(ops.logsumexp_rows(probe), torch.logsumexp(probe, -1))


# ------------------------------------------------------------------------------------------- attention

LENGTHS = [2048, 700, 129, 64, 1]
"""Up to 2k positions; 64 and 129 end just after a block boundary, 1 is a lone token."""


def _docs(lengths, heads, n_kv, hd, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [tuple(torch.randn(n, c, hd, device="cuda", generator=gen).to(dtype) for c in (heads, n_kv, n_kv))
            for n in lengths]


def _decode_positions(n: int) -> list[int]:
    """Both sides of every block boundary (p % BLOCK_N in {0, BLOCK_N - 1}), a few others, the last."""
    bn = ops.ATTN_BLOCK_N
    return sorted({p for p in range(n) if p % bn in (0, bn - 1, 17)} | {n - 1})


def _decode_inputs(docs):
    """`decode_inputs` on CUDA: every `_decode_positions` query of every document against its own cache slot."""
    return decode_inputs(docs, _decode_positions, "cuda", 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [2, 4])
def test_attention_decode_packed_padded_agree(dtype, group):
    n_kv, hd = 4, 128
    scale = hd**-0.5
    docs = _docs(LENGTHS, n_kv * group, n_kv, hd, dtype, seed=group)
    packed = packed_attention(ops, docs, group, scale, "cuda")
    padded = padded_attention(ops, docs, group, scale, "cuda")
    picked, q, kc, vc, positions = _decode_inputs(docs)
    decode = ops.attention(q, kc, vc, positions, *layout.tiles_for_decode(torch.arange(q.shape[0], device="cuda")),
                           scale)[:, 0].split(list(map(len, picked)))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i, (doc, ps) in enumerate(zip(docs, picked)):
        assert torch.equal(packed[i], padded[i]), f"document {i} (length {LENGTHS[i]}): packed != padded"
        bad = (packed[i][ps] != decode[i]).flatten(1).any(1)
        assert not bad.any(), f"document {i}: packed != decode at positions {torch.tensor(ps)[bad.cpu()].tolist()}"
        qd, kd, vd = (t.transpose(0, 1)[None].float() for t in doc)
        ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
        torch.testing.assert_close(packed[i].float(), ref[0].transpose(0, 1), **tol)


def test_attention_decode_cuda_graph_matches_eager():
    """Decode captured in a CUDA graph (the loop bound is read in the kernel): replays with new positions and
    queries give the eager bits."""
    b, n_kv, group, hd, length = 64, 8, 2, 128, 1536
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc, vc = (torch.randn(b, n_kv, length, hd, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = kc.transpose(1, 2), vc.transpose(1, 2)
    q = torch.empty(b, 1, n_kv * group, hd, device="cuda", dtype=torch.bfloat16)
    positions = torch.empty(b, dtype=torch.long, device="cuda")
    tiles = layout.tiles_for_decode(torch.randperm(b, device="cuda", generator=gen))

    def step():
        return ops.attention(q, k, v, positions, *tiles, 0.088)

    q.normal_(generator=gen)
    positions.random_(0, length, generator=gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        q.normal_(generator=gen)
        positions.random_(0, length, generator=gen)
        positions[:4] = torch.tensor([0, 63, 64, length - 1])
        graph.replay()
        assert torch.equal(out, step())


def _sdpa_per_sequence(q, k, v, cu_seqlens, scale):
    """Causal SDPA per sequence of the flat tokens (autograd reference)."""
    b, t, h, hd = q.shape
    qf, kf, vf = q.reshape(b * t, h, hd), k.reshape(b * t, -1, hd), v.reshape(b * t, -1, hd)
    bounds = cu_seqlens.tolist()
    outs = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (qf, kf, vf)), is_causal=True,
                                           scale=scale, enable_gqa=True)[0].transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs).view(b, t, h, hd)


@pytest.mark.parametrize("rows", [1, 3], ids=["packed", "padded"])
def test_attention_backward_flash_matches_per_sequence(rows):
    """The backward of `ops.attention` on CUDA in bf16 (flash attention over the packed sequences) gives the
    gradients of per-sequence SDPA in fp32: packed streams and rows of several sequences."""
    from rlbench.numerics import ops as bi

    n_kv, group, hd, t = 4, 4, 128, 1536
    lengths = [[700, 129, 64, 1, 642], [1200, 336], [1536]][:rows]  # each row: documents filling t tokens
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths]).cuda()
    tiles = layout.document_tiles(position_ids, bi.tokens_per_tile(torch.device("cuda"), group))
    gen = torch.Generator(device="cuda").manual_seed(rows)
    q, k, v = (torch.randn(rows, t, c, hd, device="cuda", generator=gen) for c in (n_kv * group, n_kv, n_kv))
    grad = torch.randn(rows, t, n_kv * group, hd, device="cuda", generator=gen)

    def grads(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        torch.autograd.backward(fn(*leaves), grad.to(dtype))
        return [x.grad.float() for x in leaves]

    got = grads(lambda *qkv: bi.attention(*qkv, tiles, hd**-0.5), torch.bfloat16)
    want = grads(lambda *qkv: _sdpa_per_sequence(*qkv, tiles.cu_seqlens, hd**-0.5), torch.float32)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=3e-2, atol=3e-2, msg=lambda m, name=name: f"d{name}: {m}")
