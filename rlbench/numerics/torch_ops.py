"""The batch-invariant ops in plain PyTorch: the CPU path (and the reference the Triton kernels mirror).

Each op makes a row's floating-point reduction order independent of how many rows the call has and which:

- `matmul`: the rows are cut into chunks of `ROW_CHUNK` (the last one zero-padded) and each chunk is one
  `F.linear` call, so the BLAS library sees one GEMM shape whatever the batch (MKL picks GEMV or small-M
  kernels from M, and those sum in another order).
- `silu`: `x / (1 + exp(-x))` in float32. `F.silu`'s vectorised body and scalar tail round differently, so
  its value depended on the tensor's total size.
- `logsumexp_rows`: a two-stage reduction over chunks of `VOCAB_CHUNK`, so that no single row is ever split
  across threads (a one-row `logsumexp` over 152k columns is).
- `attention`: each query row consumes its sequence's keys in blocks of `BLOCK_N` absolute positions from
  0 with an online softmax in float32; both products are `torch.bmm` calls of one fixed per-matrix shape
  (`BLOCK_M` x hd x `BLOCK_N`). A block past a row's position is an exact no-op for it (its scores are
  -inf: alpha = exp(0) = 1, p = 0), so the tile's other rows never change a row's result.

RMSNorm, RoPE, embeddings and residual adds are row-local on the CPU as HF writes them, and stay HF's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlbench.numerics.layout import Tiles

ROW_CHUNK = 16
"""Rows per GEMM call. One value for the engine and the trainer: a row's bits depend on the call shape."""
BLOCK_M = 16
"""Query rows per attention tile ((token, head) pairs; a multiple of 16 keeps every exp a whole vector)."""
BLOCK_N = 16
"""Keys per attention block."""
VOCAB_CHUNK = 1024
"""Columns per first-stage chunk of `logsumexp_rows`."""


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ weight[N, K].T + bias` with every GEMM call `ROW_CHUNK` rows tall (into `out` if given)."""
    m = x.shape[0]
    pad = -m % ROW_CHUNK
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    y = torch.cat([F.linear(x[i : i + ROW_CHUNK], weight, bias) for i in range(0, m + pad, ROW_CHUNK)])[:m]
    return y if out is None else out.copy_(y)


def tokens_per_tile(group: int) -> int:
    """Query tokens per attention tile for `group` query heads per KV head."""
    if group > BLOCK_M or BLOCK_M % group:
        raise ValueError(f"attention: {group} query heads per KV head do not divide the tile of {BLOCK_M} rows")
    return BLOCK_M // group


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU as `x / (1 + exp(-x))` in float32, cast back."""
    xf = x.float()
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """`logsumexp(z, -1)` of `[M, V]` float32 as logsumexp over per-chunk logsumexps (padded with -inf)."""
    m, vocab = z.shape
    size = min(vocab, VOCAB_CHUNK)
    chunks = -(-vocab // size)
    chunks += -chunks % 16  # whole vectors in the second stage too
    padded = F.pad(z, (0, chunks * size - vocab), value=float("-inf")).view(m, chunks, size)
    return torch.logsumexp(torch.logsumexp(padded, dim=-1), dim=-1)


def attention(q, k, v, positions, tile_tok0, tile_ntok, tile_kb, tile_kstart, scale: float, tile_kprefix=None,
              tile_klane=None, kstride: int = 1) -> torch.Tensor:
    """Fixed-block causal attention. q `[B, T, H, hd]`, k/v `[KB, L, n_kv, hd]` -> `[B, T, H, hd]` in q's dtype;
    positions `[B*T]` and the per-tile int32 metadata as `rlbench.numerics.layout.Tiles` holds them (with
    `tile_kprefix` / `tile_klane` / `kstride`: the grouped cache layout, `triton_ops.attention`).

    Math in float32 whatever the input dtype (the bf16 path thus matches SDPA's fp32 accumulation).
    """
    tiles = Tiles(positions, tile_tok0, tile_ntok, tile_kb, tile_kstart)
    b, t, h, hd = q.shape
    n_kv = k.shape[2]
    group = h // n_kv
    rows = torch.arange(BLOCK_M, device=q.device)
    tok_in_tile, head_in_group = rows // group, rows % group  # [BM]
    valid = tok_in_tile[None] < tiles.ntok[:, None].long()  # [NT, BM]
    tok = torch.where(valid, tiles.tok0[:, None].long() + tok_in_tile[None], tiles.tok0[:, None].long())
    heads = torch.arange(n_kv, device=q.device)[:, None] * group + head_in_group[None]  # [n_kv, BM]
    qt = q.reshape(b * t, h, hd)[tok[:, None, :], heads[None]].float()  # [NT, n_kv, BM, hd]
    pos = tiles.positions[tok]  # [NT, BM]
    last = torch.where(valid, pos, 0).amax(1)  # [NT]: the tile's furthest position
    nt = tok.shape[0]
    m = torch.full((nt, n_kv, BLOCK_M), float("-inf"), device=q.device)
    denom = torch.zeros(nt, n_kv, BLOCK_M, device=q.device)
    acc = torch.zeros(nt, n_kv, BLOCK_M, hd, device=q.device)
    kb = tiles.kb[:, None].long()
    for j in range(int(last.max()) // BLOCK_N + 1 if nt else 0):
        kpos = j * BLOCK_N + torch.arange(BLOCK_N, device=q.device)  # [BN]
        readable = kpos[None] <= last[:, None]  # [NT, BN]
        where = kpos[None].expand(nt, -1)  # [NT, BN]: the key's index in its cache row
        if tile_kprefix is not None:
            prefix, lane = tile_kprefix[:, None].long(), tile_klane[:, None].long()
            where = torch.where(where < prefix, where, prefix + (where - prefix) * kstride + lane)
        idx = torch.where(readable, tiles.kstart[:, None].long() + where, tiles.kstart[:, None].long())
        keep = readable[:, :, None, None]
        kblk = torch.where(keep, k[kb, idx], 0).float().permute(0, 2, 3, 1)  # [NT, n_kv, hd, BN]
        vblk = torch.where(keep, v[kb, idx], 0).float().permute(0, 2, 1, 3)  # [NT, n_kv, BN, hd]
        s = torch.bmm(qt.reshape(-1, BLOCK_M, hd), kblk.reshape(-1, hd, BLOCK_N)).view(nt, n_kv, BLOCK_M, BLOCK_N)
        s = (s * scale).masked_fill(~(kpos[None, None, :] <= pos[:, :, None])[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        denom = denom * alpha + p.sum(-1)
        pv = torch.bmm(p.reshape(-1, BLOCK_M, BLOCK_N), vblk.reshape(-1, BLOCK_N, hd)).view(nt, n_kv, BLOCK_M, hd)
        acc = acc * alpha[..., None] + pv
        m = m_new
    out = torch.zeros(b * t, h, hd, dtype=q.dtype, device=q.device)
    sel = valid[:, None, :].expand(nt, n_kv, BLOCK_M)
    tok_e, head_e = tok[:, None, :].expand(nt, n_kv, BLOCK_M), heads[None].expand(nt, n_kv, BLOCK_M)
    out[tok_e[sel], head_e[sel]] = (acc / denom[..., None])[sel].to(q.dtype)
    return out.view(b, t, h, hd)
