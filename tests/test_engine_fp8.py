"""FP8 rollout weights (`TorchEngineConfig.weight_format="fp8_e4m3"`, `rlbench.engine.quantize.round_to_fp8`):
the rounding against a float64 reference of float8_e4m3fn, and the engine storing what it was sent, rounded."""

from __future__ import annotations

import pytest
import torch

from rlbench.engine import TorchEngine, TorchEngineConfig
from rlbench.engine.quantize import FP8_E4M3_MAX, round_to_fp8
from rlbench.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _e4m3_grid() -> torch.Tensor:
    """Every non-negative finite float8_e4m3fn value in float64, built from the format (not by torch's cast):
    subnormals m * 2^-9 (m = 0..7), normals (1 + m/8) * 2^e (e = -6..8), 448 (e = 8, m = 6) the largest."""
    values = [m * 2.0**-9 for m in range(8)]
    values += [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8) if not (e == 8 and m == 7)]
    return torch.tensor(values, dtype=torch.float64)


def _reference(x: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 rounding in float64: scale = row amax / 448 and x / scale in float32 (as `round_to_fp8`
    computes them, so a value at a float32 tie rounds the same), then the nearest grid value (ties to the even
    code) times the scale, in float64."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    y = (x / scale).double().abs()
    x, scale = x.double(), scale.double()
    grid = _e4m3_grid()
    dist = (y[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best  # one or two neighbours; of two, the even code (consecutive codes alternate parity)
    code = torch.where(ties, torch.arange(len(grid)), len(grid)).sort(-1).values[..., :2]
    pick = torch.where((code[..., 1] < len(grid)) & (code[..., 0] % 2 == 1), code[..., 1], code[..., 0])
    return torch.sign(x) * grid[pick] * scale


def test_round_to_fp8_known_matrix():
    """Power-of-two row scales (the division is exact): ties to even, subnormals, a zero row, negative values."""
    x = torch.tensor([
        [448.0, 1.0625, 1.1875, -3.3, 0.01],   # scale 1: 1.0625 -> 1.0, 1.1875 -> 1.25 (ties), -3.3 -> -3.25
        [224.0, -100.0, 17.0, 2.0**-9 * 3, 2.0**-10 * 3.3],  # scale 0.5: -200 -> -192 and 34 -> 32 (ties to
        # even), 3 * 2^-8 -> 6 * 2^-9 and 3.3 * 2^-9 -> 3 * 2^-9 (subnormals after scaling)
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    got = round_to_fp8(x)
    want = torch.tensor([
        [448.0, 1.0, 1.25, -3.25, 0.009765625],
        [224.0, -96.0, 16.0, 2.0**-9 * 3, 2.0**-10 * 3],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got.double(), _reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_fp8_random(dtype):
    """A random weight-like matrix: equal to the float64 reference (up to rounding code * scale to `dtype`), error per
    element <= 2^-4 of |x| in the normal range and <= 2^-4 of the row amax everywhere; idempotent."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]).to(dtype)
    got = round_to_fp8(x)
    assert got.dtype == dtype and got.shape == x.shape
    ref = _reference(x.float())
    # the same e4m3 code everywhere: off by at most the rounding of code * scale to `dtype` (a code apart is 2^-4)
    torch.testing.assert_close(got.double(), ref, rtol=torch.finfo(dtype).eps, atol=0)
    err = (got.double() - x.double()).abs()
    amax = x.double().abs().amax(dim=1, keepdim=True)
    assert (err <= 2.0**-4 * amax).all()
    normal = x.double().abs() >= amax / FP8_E4M3_MAX * 2.0**-6
    rel = err[normal] / x.double().abs()[normal]
    assert rel.max() <= 2.0**-4 and rel.mean() > 1e-3  # it does round: ~2^-6 on average for 3 mantissa bits
    torch.testing.assert_close(round_to_fp8(got), got, rtol=0, atol=0)
    assert not torch.equal(got, x)


def test_round_to_fp8_leaves_1d():
    v = torch.randn(17)
    assert round_to_fp8(v) is v


def test_weight_format_validation():
    with pytest.raises(ValueError, match="weight_format"):
        TorchEngineConfig(weight_format="int4")
    assert TorchEngineConfig(weight_format="fp8_e4m3").weight_format == "fp8_e4m3"


def test_engine_stores_fp8_rounded_weights():
    """update_weights with weight_format="fp8_e4m3": every matrix == round_to_fp8(sent) != sent, 1-D as sent;
    without it, the weights as sent."""
    cfg = TorchEngineConfig(max_seq_len=96, num_slots=2, weight_format="fp8_e4m3")
    engine = TorchEngine(build_model("tiny", seed=0), cfg)
    sent = {k: v.clone() for k, v in build_model("tiny", seed=1).state_dict().items()}
    engine.update_weights([list(sent.items())], version=1)
    stored = engine._named_tensors()
    matrices = [n for n, t in sent.items() if t.dim() >= 2]
    vectors = [n for n, t in sent.items() if t.dim() == 1]
    assert matrices and vectors
    for name in matrices:
        assert not torch.equal(stored[name], sent[name]), name
        torch.testing.assert_close(stored[name], round_to_fp8(sent[name]), rtol=0, atol=0)
    for name in vectors:
        torch.testing.assert_close(stored[name], sent[name], rtol=0, atol=0)
    plain = TorchEngine(build_model("tiny", seed=0), TorchEngineConfig(max_seq_len=96, num_slots=2))
    plain.update_weights([list(sent.items())], version=1)
    for name, tensor in sent.items():
        torch.testing.assert_close(plain._named_tensors()[name], tensor, rtol=0, atol=0)


def test_true_on_policy_rejects_weight_format():
    import dataclasses as dc

    from rlbench import presets

    cfg = presets.cpu_test(model="tiny", workdir="/tmp/unused", level=1)
    with pytest.raises(ValueError, match="weight_format"):
        cfg.replace(engine=dc.replace(cfg.engine, weight_format="fp8_e4m3"), true_on_policy_mode=True)
