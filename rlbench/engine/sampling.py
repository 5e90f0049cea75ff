"""Seeded, batch-invariant token sampling (pure tensor functions, no host syncs, CUDA-graph safe).

A sample's random numbers depend only on its own `(seed, step, token id)`: Gumbel-max sampling with
noise from a counter-based integer hash. So a sample is reproducible whatever else is in the batch and
whichever slot it sits in. Log-probs follow the trainer's definition: `log_softmax(logits / T)` of the
full (untruncated) tempered distribution, gathered at the sampled token; greedy rows (T = 0) report T = 1.

The reductions over the vocabulary (argmax, logsumexp) run in two stages over chunks of `VOCAB_CHUNK`
tokens: at batch 1-2 a one-stage reduction is one GPU block per row walking all ~152k entries (inductor
does not split argmax), while chunks spread it over ~150 blocks. The argmax is bitwise the one-stage
`argmax` (the first maximum of the first chunk holding the row maximum = the lowest index of the maximum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31, so a 32-bit value times one fits a signed int64 (no overflow on any backend).
_M1 = 0x7FEB352D
_M2 = 0x5BD1E995
_GOLDEN = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32-style): on int64 tensors holding values in [0, 2**32), or on int32
    tensors holding the same 32 bits (products wrap mod 2**32; shifts are made logical by masking). The int32
    form is the one for `[B, V]` tensors: CPUs multiply int32 lanes natively (AVX2 has no int64 multiply, a 3x
    slower hash) and GPUs read half the bytes."""
    if x.dtype == torch.int32:
        x = x ^ ((x >> 16) & 0xFFFF)
        x = x * _M1
        x = x ^ ((x >> 15) & 0x1FFFF)
        x = x * _M2
        return x ^ ((x >> 16) & 0xFFFF)
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 tensors with the same 32 bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def token_hash(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-token-id hash `[V]` (int32 bits of the 32-bit hash), computed once per engine."""
    return _int32_bits(mix32(torch.arange(vocab_size, device=device, dtype=torch.int64) * 2 + 1))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1) for every (row, token): `[B]`, `[B]`, `[V]` (from `token_hash`) -> `[B, V]` float32.

    Row b's numbers depend only on `(seeds[b], steps[b])`. 23 bits: `k + 0.5` is then exact in float32, so
    `u` is strictly inside (0, 1) (with 24 bits the top value rounds to 1.0 and the Gumbel noise to inf).
    """
    row = mix32((mix32(seeds & _MASK32) + (steps & 0xFFFFFF) * _GOLDEN) & _MASK32)  # [B] int64
    h = mix32(_int32_bits(row)[:, None] ^ vocab_hash[None, :])  # [B, V] int32
    return (((h >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


VOCAB_CHUNK = 1024
"""Tokens per chunk of the two-stage vocabulary reductions."""


def _chunks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """`[B, V]` -> `[B, C, S]` (S = min(V, VOCAB_CHUNK)), the tail padded with `fill` (a view-free pad)."""
    vocab = x.shape[-1]
    size = min(vocab, VOCAB_CHUNK)
    n = -(-vocab // size)
    return F.pad(x, (0, n * size - vocab), value=fill).view(x.shape[0], n, size)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of `[B, V]` float as a two-stage reduction; ties -> the lowest index, like argmax.

    Padding is -inf: it can only tie with a -inf maximum, and then an earlier (real) index wins.
    """
    chunks = _chunks(x, float("-inf"))  # [B, C, S]
    local = chunks.argmax(dim=-1, keepdim=True)  # [B, C, 1]
    best = chunks.gather(-1, local)[..., 0]  # [B, C]
    chunk = best.argmax(dim=-1, keepdim=True)  # [B, 1]: the first chunk holding the row maximum
    return (chunk * chunks.shape[-1] + local[..., 0].gather(-1, chunk))[:, 0]


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(x, dim=-1)` of `[B, V]` as logsumexp of per-chunk logsumexps `[B]` (same math;
    float32 rounding differs in the last bits)."""
    return torch.logsumexp(torch.logsumexp(_chunks(x, float("-inf")), dim=-1), dim=-1)


def truncate_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p (nucleus) on tempered logits `[B, V]`; removed tokens get -inf.

    `top_k[b] == 0` and `top_p[b] == 1` disable the filters for row b. Top-p keeps the smallest prefix of
    the top-k-renormalised distribution whose mass reaches `top_p` (the most likely token always stays).
    """
    vocab = scaled.shape[-1]
    sorted_vals, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = rank[None, :] < k[:, None]
    sorted_vals = sorted_vals.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_vals, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = keep & (mass_before < top_p[:, None])
    sorted_vals = sorted_vals.masked_fill(~keep, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_vals)


def log_prob_at(scaled: torch.Tensor, tokens: torch.Tensor, lse=logsumexp_rows) -> torch.Tensor:
    """`log_softmax(scaled)[b, tokens[b]]` `[B]` without writing the `[B, V]` log-softmax (one logsumexp, by
    `lse`: `[B, V] -> [B]`)."""
    return scaled.gather(1, tokens[:, None])[:, 0] - lse(scaled)


def greedy_tokens(logits: torch.Tensor, lse=logsumexp_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax per row `[B, V]` -> tokens `[B]`, log-probs `[B]` at T = 1 (no noise: every row is greedy)."""
    logits = logits.float()
    tokens = argmax_rows(logits)
    return tokens, log_prob_at(logits, tokens, lse)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    vocab_hash: torch.Tensor,
    truncate: bool,
    lse=logsumexp_rows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: `[B, V]` raw logits (any float dtype; upcast to float32 here).
        temperature: `[B]` float; 0 = greedy.
        top_k: `[B]` long (0 = off). top_p: `[B]` float (1 = off). Ignored unless `truncate`.
        seeds, steps: `[B]` long; the noise of row b depends only on (seeds[b], steps[b]).
        vocab_hash: `[V]` from `token_hash`.
        truncate: apply top-k/top-p (a full-vocab sort; skip it when no row needs it).
        lse: the per-row logsumexp of the log-probs (`rlbench.numerics.logsumexp_rows` in true on-policy mode,
            the trainer's too).

    Returns:
        tokens `[B]` long, log_probs `[B]` float32 = log_softmax(logits / T)[token] (T = 1 for greedy rows).
    """
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]  # [B, V]
    candidates = truncate_logits(scaled, top_k, top_p) if truncate else scaled
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, vocab_hash)))
    sampled = argmax_rows(candidates + gumbel)
    tokens = torch.where(greedy, argmax_rows(scaled), sampled)  # T = 1 on greedy rows: scaled == logits
    return tokens, log_prob_at(scaled, tokens, lse)
