"""The KL-in-reward coefficient controllers against an independent float64 implementation of verl's
`AdaptiveKLController` (Ziegler et al. 2019), written here with numpy; resume through state_dict; the KL they
read (`mean_sequence_kl`) against a python reference, over one rank and split over two."""

import math

import numpy as np
import pytest
import torch

from rlbench.algorithms import LossConfig
from rlbench.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    mean_sequence_kl,
)

D = torch.float64
RPP = {"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True}  # an estimator with KL-in-reward


class VerlAdaptive:
    """verl/trainer/ppo/core_algos.py AdaptiveKLController, as written there."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def _kls(n, seed=0):
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.uniform(0.0, 0.3, n)], [int(x) for x in rng.integers(1, 512, n)]


def test_adaptive_matches_verl_over_a_run():
    kls, ns = _kls(200)
    ours, ref = AdaptiveKLController(0.05, 0.1, 10000), VerlAdaptive(0.05, 0.1, 10000)
    for kl, n in zip(kls, ns):
        ours.update(kl, n)
        ref.update(kl, n)
        assert abs(ours.value - float(ref.value)) <= 1e-12 * float(ref.value)
    assert ours.value != 0.05  # it moved


def test_adaptive_direction_and_error_clip():
    def after(kl):
        c = AdaptiveKLController(0.1, 0.1, 1000)
        c.update(kl, 100)
        return c.value

    assert after(0.2) > 0.1 > after(0.05)  # drifting further than the target raises β; staying closer lowers it
    assert after(0.1) == 0.1  # on target: unchanged
    assert after(100.0) == after(0.5) == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000), rel=1e-15)  # clipped at +0.2
    assert after(0.0) == pytest.approx(0.1 * (1 - 0.2 * 100 / 1000), rel=1e-15)  # and at −0.2


def test_fixed_never_moves():
    c = FixedKLController(0.03)
    for kl, n in zip(*_kls(20)):
        c.update(kl, n)
    assert c.value == 0.03


def test_resume_through_state_dict_is_exact():
    kls, ns = _kls(10, seed=1)
    straight = AdaptiveKLController(0.05, 0.1, 2000)
    for kl, n in zip(kls, ns):
        straight.update(kl, n)
    first = AdaptiveKLController(0.05, 0.1, 2000)
    for kl, n in zip(kls[:5], ns[:5]):
        first.update(kl, n)
    resumed = AdaptiveKLController(0.05, 0.1, 2000)
    resumed.load_state_dict(dict(first.state_dict()))
    for kl, n in zip(kls[5:], ns[5:]):
        resumed.update(kl, n)
    assert resumed.value == straight.value  # bitwise
    with pytest.raises(ValueError, match="kl_ctl_type changed"):
        FixedKLController(0.05).load_state_dict(first.state_dict())


def test_controller_refusals():
    c = AdaptiveKLController(0.05, 0.1, 1000)
    with pytest.raises(ValueError, match="current_kl=nan"):
        c.update(math.nan, 8)
    with pytest.raises(ValueError, match="flip β's sign"):
        c.update(0.1, 5000)
    with pytest.raises(ValueError, match="kl_coef=0"):
        AdaptiveKLController(0, 0.1, 1000)


def test_config_fields_build_the_controller():
    c = build_kl_controller(LossConfig(**RPP, kl_coef=0.05, kl_ctl_type="adaptive",
                                       kl_target=0.2, kl_horizon=500))
    assert isinstance(c, AdaptiveKLController) and (c.value, c.target, c.horizon) == (0.05, 0.2, 500)
    f = build_kl_controller(LossConfig(**RPP, kl_coef=0.01))
    assert isinstance(f, FixedKLController) and f.value == 0.01
    with pytest.raises(ValueError, match="kl_target > 0"):
        LossConfig(**RPP, kl_coef=0.05, kl_ctl_type="adaptive")
    with pytest.raises(ValueError, match="kl_coef > 0"):
        LossConfig(**RPP, kl_ctl_type="adaptive", kl_target=0.1)
    with pytest.raises(ValueError, match="no effect with kl_ctl_type='fixed'"):
        LossConfig(**RPP, kl_coef=0.05, kl_target=0.1)
    with pytest.raises(ValueError, match="kl_horizon=0"):
        LossConfig(kl_horizon=0)
    with pytest.raises(ValueError, match="kl_ctl_type='pid'"):
        LossConfig(kl_ctl_type="pid")


def test_mean_sequence_kl_one_rank_and_two():
    g = torch.Generator().manual_seed(0)
    lengths = [4, 6, 3, 5]
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0], dtype=D)  # sample 1: no trained token
    kl = torch.rand(sum(lengths), generator=g, dtype=D)
    kl_bad = torch.where(mask > 0, kl, torch.tensor(math.nan, dtype=D))
    per_seq, s = [], 0
    for n in lengths:
        ks = [k for k, m in zip(kl[s:s + n].tolist(), mask[s:s + n].tolist()) if m]
        if ks:
            per_seq.append(sum(ks) / len(ks))
        s += n
    exp = sum(per_seq) / len(per_seq)
    assert abs(mean_sequence_kl(kl_bad, lengths, mask) - exp) < 1e-15
    # two ranks: samples 0-1 and 2-3; each adds the other's [sum, count]
    cut = sum(lengths[:2])
    seen = []
    mean_sequence_kl(kl_bad[cut:], lengths[2:], mask[cut:], reduce_sum=lambda xs: seen.append(xs) or xs)
    got = mean_sequence_kl(kl_bad[:cut], lengths[:2], mask[:cut],
                           reduce_sum=lambda xs: [a + b for a, b in zip(xs, seen[0])])
    assert abs(got - exp) < 1e-15
    assert math.isnan(mean_sequence_kl(kl, lengths, torch.zeros_like(mask)))
