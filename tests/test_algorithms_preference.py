"""Bradley–Terry loss against a float64 reference written here from the formula TRL's RewardTrainer and
OpenRLHF's PairWiseLoss compute (−log σ(s_c − s_r − m), mean over pairs), its gradient, and its global
normalisation (micro-batches add up to the whole batch)."""

import math

import pytest
import torch

from rlbench.algorithms.preference import bradley_terry_loss

D = torch.float64


def _ref(chosen, rejected, margin=None):
    """Python floats: mean of log(1 + e^{−x}) (written in its two stable branches), accuracy, margin."""
    losses, wins = [], 0
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        x = c - r - (0.0 if margin is None else margin[i])
        losses.append(math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x)))
        wins += c > r
    n = len(chosen)
    return sum(losses) / n, wins / n, sum(c - r for c, r in zip(chosen, rejected)) / n


@pytest.mark.parametrize("with_margin", [False, True])
def test_bradley_terry_matches_reference_and_gradient(with_margin):
    g = torch.Generator().manual_seed(3)
    c = (3 * torch.randn(64, generator=g, dtype=D)).requires_grad_()
    r = 3 * torch.randn(64, generator=g, dtype=D)
    m = torch.rand(64, generator=g, dtype=D) if with_margin else None
    loss, metrics = bradley_terry_loss(c, r, m)
    exp_loss, exp_acc, exp_margin = _ref(c.tolist(), r.tolist(), None if m is None else m.tolist())
    assert abs(loss.item() - exp_loss) < 1e-12
    assert metrics["accuracy"].item() == exp_acc and 0 < exp_acc < 1
    assert abs(metrics["margin"].item() - exp_margin) < 1e-12
    assert abs(metrics["chosen_score"].item() - c.mean().item()) < 1e-12
    loss.backward()
    x = (c - r - (0 if m is None else m)).detach()
    torch.testing.assert_close(c.grad, -torch.sigmoid(-x) / 64, rtol=0, atol=1e-15)  # d/dx log(1+e^{-x})


def test_bradley_terry_micro_batches_add_up_to_the_global_mean():
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(10, generator=g, dtype=D), torch.randn(10, generator=g, dtype=D)
    whole, wm = bradley_terry_loss(c, r)
    parts = [bradley_terry_loss(c[s], r[s], n_pairs=10) for s in (slice(0, 3), slice(3, 10))]
    assert abs(sum(p[0] for p in parts).item() - whole.item()) < 1e-14
    for k in wm:
        assert abs(sum(p[1][k] for p in parts).item() - wm[k].item()) < 1e-14


def test_bradley_terry_is_finite_far_out_and_counts_ties_as_wrong():
    c = torch.tensor([1000.0, -1000.0, 0.5], dtype=torch.bfloat16)
    r = torch.tensor([-1000.0, 1000.0, 0.5], dtype=torch.bfloat16)
    loss, metrics = bradley_terry_loss(c, r)
    assert loss.dtype == torch.float32  # bf16 scores are promoted
    # pair 0: ~0, pair 1: 2000, pair 2 (tie): log 2
    assert abs(loss.item() - (2000.0 + math.log(2)) / 3) < 1e-3
    assert metrics["accuracy"].item() == pytest.approx(1 / 3)


def test_bradley_terry_refuses_bad_shapes_and_counts():
    with pytest.raises(ValueError, match="same \\[B\\] vector"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="n_pairs=2"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), n_pairs=2)
    with pytest.raises(ValueError, match="n_pairs=None"):
        bradley_terry_loss(torch.zeros(0), torch.zeros(0))
