"""The seeded sampler: exact distributions (chi-square on a toy vocabulary), invariance, greedy, log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.rollout.sampling import greedy_tokens, reference_probs, sample_tokens, token_hash, uniform_noise

V, N = 12, 40_000
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.2, -2.0, -3.0])


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
