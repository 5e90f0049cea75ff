"""The seeded sampler: exact distributions (chi-square on a toy vocabulary), invariance, greedy, log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.engine.sampling import (
    argmax_rows,
    greedy_tokens,
    logsumexp_rows,
    sample_tokens,
    token_hash,
    truncate_logits,
    uniform_noise,
)

V, N = 12, 40_000
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.2, -2.0, -3.0])


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The exact sampling distribution `[V]` float64 for one row (test reference; plain loops, no tricks)."""
    scaled = logits.double() / temperature
    order = torch.argsort(scaled, descending=True).tolist()
    kept = order[: top_k or len(order)]
    probs = torch.softmax(scaled[kept], dim=0).tolist()
    nucleus, mass = [], 0.0
    for tok, p in zip(kept, probs):
        if mass >= top_p:
            break
        nucleus.append(tok)
        mass += p
    out = torch.zeros_like(scaled)
    out[nucleus] = torch.softmax(scaled[nucleus], dim=0)
    return out


def _draw(temperature, top_k=0, top_p=1.0, logits=LOGITS, n=N, seed0=0, step=3):
    rows = logits.expand(n, V)
    tok, lp = sample_tokens(
        rows, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
        torch.arange(seed0, seed0 + n), torch.full((n,), step), token_hash(V), truncate=top_k > 0 or top_p < 1,
    )
    return tok, lp


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Chi-square statistic over the support of `probs`, and its 0.1 % critical value (Wilson-Hilferty)."""
    counts = torch.bincount(tokens, minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the truncated support"
    expected = probs[support] * tokens.numel()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    z = 3.09  # one-sided 0.1 %
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 5, 1.0),
                                                     (1.0, 0, 0.7), (0.8, 6, 0.9)])
def test_distribution_matches_exact_tempered_truncated(temperature, top_k, top_p):
    tok, _ = _draw(temperature, top_k, top_p)
    stat, crit = _chi2(tok, reference_probs(LOGITS, temperature, top_k, top_p))
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f}"


def test_chi_square_can_fail():
    """The test has power: T=0.6 samples are rejected against the T=1 distribution."""
    tok, _ = _draw(0.6)
    stat, crit = _chi2(tok, reference_probs(LOGITS, 1.0))
    assert stat > 10 * crit


def test_logprob_is_full_tempered_distribution_even_when_truncated():
    tok, lp = _draw(0.8, top_k=3, top_p=0.9, n=200)
    want = torch.log_softmax(LOGITS.double() / 0.8, -1)[tok]
    torch.testing.assert_close(lp.double(), want, atol=1e-6, rtol=0)


def test_row_result_independent_of_batch():
    """Row b's token depends only on its own (logits, seed, step): shuffle and resize the batch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, V, generator=g)
    seeds, steps = torch.randint(0, 2**31 - 1, (64,), generator=g), torch.randint(0, 1000, (64,), generator=g)
    args = (torch.ones(64), torch.zeros(64, dtype=torch.long), torch.ones(64))
    tok, _ = sample_tokens(logits, *args, seeds, steps, token_hash(V), truncate=False)
    perm = torch.randperm(64, generator=g)[:17]
    sub, _ = sample_tokens(logits[perm], *(a[perm] for a in args), seeds[perm], steps[perm], token_hash(V),
                           truncate=True)
    assert torch.equal(sub, tok[perm])
    # and a different step gives different draws
    other, _ = sample_tokens(logits, *args, seeds, steps + 1, token_hash(V), truncate=False)
    assert (other != tok).any()


def test_greedy_rows_take_argmax_and_report_t1_logprob():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(2))
    temp = torch.tensor([0.0, 1.0] * 4)
    tok, lp = sample_tokens(logits, temp, torch.zeros(8, dtype=torch.long), torch.ones(8),
                            torch.arange(8), torch.zeros(8, dtype=torch.long), token_hash(V), truncate=False)
    assert torch.equal(tok[0::2], logits[0::2].argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])


def test_uniform_noise_in_open_interval_and_flat():
    u = uniform_noise(torch.arange(2000), torch.zeros(2000, dtype=torch.long), token_hash(64))
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u.flatten(), bins=16, min=0, max=1).double()
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 40  # df 15, p ~ 5e-4


def _mix32_reference(x: int) -> int:
    """lowbias32 in Python integers (the definition both tensor forms of `mix32` must give)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_uniform_noise_is_the_32_bit_hash_of_seed_step_and_token():
    """The `[B, V]` noise runs in int32 lanes (wrapping products, masked shifts): the same numbers as the hash in
    exact integer arithmetic, for seeds beyond 2**31 and 2**32 (only their low 32 bits count) and every token."""
    seeds = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 + 5, 123456789012])
    steps = torch.tensor([0, 7, 2**24 + 3, 1, 255, 40000])
    vocab = 5000
    got = uniform_noise(seeds, steps, token_hash(vocab))
    assert token_hash(vocab).dtype == torch.int32
    for b, (seed, step) in enumerate(zip(seeds.tolist(), steps.tolist())):
        row = _mix32_reference((_mix32_reference(seed & 0xFFFFFFFF) + (step & 0xFFFFFF) * 0x9E3779B9) & 0xFFFFFFFF)
        want = [((_mix32_reference(row ^ _mix32_reference(2 * t + 1)) >> 9) + 0.5) / 2**23 for t in range(vocab)]
        assert torch.equal(got[b], torch.tensor(want, dtype=torch.float32)), b


def test_greedy_variant_equals_sampler_at_t0():
    """The noise-free greedy step (all rows T = 0) == the sampler's greedy rows, tokens and log-probs exactly."""
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 4
    tok, lp = greedy_tokens(logits)
    want_tok, want_lp = sample_tokens(logits, torch.zeros(6), torch.zeros(6, dtype=torch.long), torch.ones(6),
                                      torch.arange(6), torch.zeros(6, dtype=torch.long), token_hash(1000),
                                      truncate=False)
    assert torch.equal(tok, want_tok) and torch.equal(lp, want_lp)
    ref = torch.log_softmax(logits.double(), -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, atol=2e-6, rtol=0)


def _one_stage_sample(logits, temperature, top_k, top_p, seeds, steps, vocab_hash, truncate):
    """The sampler before the two-stage reductions (plain `argmax` / `logsumexp` over the vocabulary)."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    candidates = truncate_logits(scaled, top_k, top_p) if truncate else scaled
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, vocab_hash)))
    tokens = torch.where(greedy, scaled.argmax(dim=-1), (candidates + gumbel).argmax(dim=-1))
    return tokens, scaled.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)


@pytest.mark.parametrize("vocab", [7, 1024, 3000, 151936])
def test_two_stage_argmax_is_argmax_with_ties(vocab):
    """Bitwise `argmax` (lowest index of the maximum), incl. ties inside a chunk, across chunk boundaries,
    in the padded last chunk, and -inf rows."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = torch.randint(0, 3, (vocab,), generator=g).float()  # many ties
    x[2, [vocab // 3, vocab // 2, vocab - 1]] = 50.0  # ties in different chunks
    x[3, -1] = 50.0  # the maximum in the padded tail
    x[4] = float("-inf")
    x[5, : vocab // 2] = float("-inf")
    x[6] = x[6].round()  # coarse values
    x[7, [0, vocab - 1]] = 50.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[2] == vocab // 3 and argmax_rows(x)[4] == 0
    finite = x[torch.arange(9) != 4]
    torch.testing.assert_close(logsumexp_rows(finite), torch.logsumexp(finite, -1), atol=2e-6, rtol=0)
    assert logsumexp_rows(x)[4] == float("-inf")


@pytest.mark.parametrize("truncate", [False, True])
def test_two_stage_sampler_equals_one_stage(truncate):
    """Same tokens bitwise as the one-stage sampler for the same seeds (greedy, sampled, truncated rows at a
    real vocabulary size with tied logits); log-probs within float32 rounding of the logsumexp."""
    vocab, n = 151936, 12
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(torch.bfloat16)  # bf16: many exact ties
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3] * 3)
    args = (logits, temp, torch.tensor([0, 50, 0] * 4), torch.tensor([1.0, 1.0, 0.9] * 4),
            torch.randint(0, 2**31 - 1, (n,), generator=g), torch.randint(0, 9, (n,), generator=g),
            token_hash(vocab), truncate)
    tok, lp = sample_tokens(*args)
    want_tok, want_lp = _one_stage_sample(*args)
    assert torch.equal(tok, want_tok)
    print(f"two-stage vs one-stage log-prob max |diff| {(lp - want_lp).abs().max():.2e}")
    torch.testing.assert_close(lp, want_lp, atol=2e-6, rtol=0)
    g_tok, _ = greedy_tokens(logits)
    assert torch.equal(g_tok, logits.float().argmax(-1))
