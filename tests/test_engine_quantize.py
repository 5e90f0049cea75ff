"""Quantized rollout weights (`TorchEngineConfig.weight_format`, `rlbench.engine.quantize`): FP8 e4m3 and the
4-bit MXFP4 / NVFP4 roundings against float64 references built from the formats' value grids, and the engine
storing what it was sent, rounded."""

from __future__ import annotations

import pytest
import torch

from rlbench.configs.engine import WEIGHT_FORMATS
from rlbench.engine import TorchEngine, TorchEngineConfig
from rlbench.engine.quantize import (
    E2M1_GRID,
    FORMATS,
    FP8_E4M3_MAX,
    MX_BLOCK,
    NV_BLOCK,
    round_to_e2m1,
    round_to_fp8,
    round_to_mxfp4,
    round_to_nvfp4,
)
from rlbench.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _e4m3_grid() -> torch.Tensor:
    """Every non-negative finite float8_e4m3fn value in float64, built from the format (not by torch's cast):
    subnormals m * 2^-9 (m = 0..7), normals (1 + m/8) * 2^e (e = -6..8), 448 (e = 8, m = 6) the largest."""
    values = [m * 2.0**-9 for m in range(8)]
    values += [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8) if not (e == 8 and m == 7)]
    return torch.tensor(values, dtype=torch.float64)


def _nearest_even(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """float64 |values| `y` -> the nearest value of the ascending `grid` (ties to the even code: consecutive codes
    alternate parity); past the last value, the last value (saturation)."""
    dist = (y[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best  # one or two neighbours; of two, the even code
    code = torch.where(ties, torch.arange(len(grid)), len(grid)).sort(-1).values[..., :2]
    pick = torch.where((code[..., 1] < len(grid)) & (code[..., 0] % 2 == 1), code[..., 1], code[..., 0])
    return grid[pick]


def _reference(x: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 rounding in float64: scale = row amax / 448 and x / scale in float32 (as `round_to_fp8`
    computes them, so a value at a float32 tie rounds the same), then the nearest grid value (ties to the even
    code) times the scale, in float64."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    y = (x / scale).double().abs()
    x, scale = x.double(), scale.double()
    return torch.sign(x) * _nearest_even(y, _e4m3_grid()) * scale


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


def _e2m1_grid() -> torch.Tensor:
    """The non-negative e2m1 values in float64 from the format: subnormal 0.5 (m = 1, e = 0), normals
    (1 + m/2) * 2^(e - 1) for e = 1..3."""
    values = [0.0, 0.5] + [(1 + m / 2) * 2.0 ** (e - 1) for e in range(1, 4) for m in range(2)]
    return torch.tensor(values, dtype=torch.float64)


def _mxfp4_reference(x: torch.Tensor) -> torch.Tensor:
    """float64 MXFP4: per block of 32 along the last dim, scale 2^(floor(log2 amax) - 2), the nearest e2m1 value
    of |x| / scale (ties to even, saturating at 6) times the scale."""
    xb = x.double().reshape(x.shape[0], -1, MX_BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, 2.0 ** (torch.floor(torch.log2(amax)) - 2), torch.ones_like(amax))
    return (torch.sign(xb) * _nearest_even(xb.abs() / scale, _e2m1_grid()) * scale).reshape(x.shape)


def _nvfp4_reference(x: torch.Tensor) -> torch.Tensor:
    """float64 NVFP4: global scale = tensor amax / (448 * 6) and block amax / 6 / global (float32, as the code
    computes them), the block scale the nearest e4m3 value of that; then the nearest e2m1 value of the float32
    x / (block scale * global), times that scale, in float64."""
    xf = x.float().reshape(x.shape[0], -1, NV_BLOCK)
    glob = xf.abs().amax() / (FP8_E4M3_MAX * 6.0)
    rel = (xf.abs().amax(-1, keepdim=True) / 6.0 / glob).double()
    block = _nearest_even(rel, _e4m3_grid())
    scale = (block.float() * glob)  # [rows, n_blocks, 1] float32, as `round_to_nvfp4`
    y = torch.where(scale > 0, xf / scale.clamp_min(1e-30), 0.0).double()  # a zero block stays zero
    return (torch.sign(y) * _nearest_even(y.abs(), _e2m1_grid()) * scale.double()).reshape(x.shape)


def test_e2m1_grid_and_rounding():
    """The module's grid is the format's; midpoints go to the even code, past 6 saturates, sign kept."""
    assert torch.equal(torch.tensor(E2M1_GRID, dtype=torch.float64), _e2m1_grid())
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.9, 100.0, -0.26, -2.9, 0.0, 0.24])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -3.0, 0.0, 0.0])
    torch.testing.assert_close(round_to_e2m1(y), want, rtol=0, atol=0)
    z = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3
    torch.testing.assert_close(round_to_e2m1(z).double(), torch.sign(z.double()) * _nearest_even(
        z.double().abs(), _e2m1_grid()), rtol=0, atol=0)


def test_round_to_mxfp4_known_block():
    """One block of 32 with amax 5 (scale 2^(2 - 2) = 1) and one with amax 0.7 (scale 2^-3), a zero block:
    e2m1 values x scale, 5 -> 4 (tie to even), -0.7 / 2^-3 = -5.6 -> -6 * 2^-3."""
    row = torch.zeros(3, MX_BLOCK)
    row[0, :5] = torch.tensor([5.0, 1.3, -2.6, 0.2, 3.6])
    row[1, :3] = torch.tensor([-0.7, 0.1, 0.05])
    got = round_to_mxfp4(row)
    want = torch.zeros(3, MX_BLOCK)
    want[0, :5] = torch.tensor([4.0, 1.5, -3.0, 0.0, 4.0])
    want[1, :3] = torch.tensor([-0.75, 0.125, 0.0625])  # 0.8 -> 1.0 * 2^-3; 0.4 -> 0.5 * 2^-3
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_mxfp4_random(dtype):
    """Random weight-like rows: bit-equal to the float64 reference (power-of-two scales: every step exact), at
    most 15 distinct values per block, error <= block amax / 4, ~10 % relative error overall; idempotent."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 4 * MX_BLOCK, generator=g) * torch.logspace(-3, 1, 48)[:, None]).to(dtype)
    got = round_to_mxfp4(x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _mxfp4_reference(x), rtol=0, atol=0)
    blocks, xb = got.double().reshape(48, -1, MX_BLOCK), x.double().reshape(48, -1, MX_BLOCK)
    assert max(len(b.unique()) for b in blocks.reshape(-1, MX_BLOCK)) <= 15
    assert ((blocks - xb).abs() <= xb.abs().amax(-1, keepdim=True) / 4).all()
    rel = (got.double() - x.double()).norm() / x.double().norm()
    assert 0.05 < rel < 0.2
    torch.testing.assert_close(round_to_mxfp4(got), got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_nvfp4_random(dtype):
    """Random weight-like rows, a zero block and a ragged last dim (zero-padded to the block): equal to the
    float64 reference up to rounding e2m1 x scale to `dtype`, at most 15 values per block, error <= amax / 5."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5 * NV_BLOCK, generator=g) * torch.logspace(-2, 1, 40)[:, None]
    x[3, :NV_BLOCK] = 0.0
    x = x.to(dtype)
    got = round_to_nvfp4(x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _nvfp4_reference(x), rtol=torch.finfo(dtype).eps, atol=0)
    assert torch.equal(got[3, :NV_BLOCK], torch.zeros(NV_BLOCK, dtype=dtype))
    blocks, xb = got.double().reshape(40, -1, NV_BLOCK), x.double().reshape(40, -1, NV_BLOCK)
    assert max(len(b.unique()) for b in blocks.reshape(-1, NV_BLOCK)) <= 15
    assert ((blocks - xb).abs() <= xb.abs().amax(-1, keepdim=True) / 5).all()
    ragged = x[:, : 3 * NV_BLOCK + 5]
    padded = torch.nn.functional.pad(ragged, (0, NV_BLOCK - 5))
    padded[0, -1] = 0  # the padding is zeros, which never change an amax
    torch.testing.assert_close(round_to_nvfp4(ragged), round_to_nvfp4(padded)[:, : ragged.shape[1]], rtol=0, atol=0)


def test_weight_format_validation():
    with pytest.raises(ValueError, match="weight_format"):
        TorchEngineConfig(weight_format="int4")
    assert set(FORMATS) == set(WEIGHT_FORMATS) == {"fp8_e4m3", "mxfp4", "nvfp4"}
    for name in WEIGHT_FORMATS:
        assert TorchEngineConfig(weight_format=name).weight_format == name


@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_engine_stores_rounded_weights(weight_format):
    """update_weights with a weight_format: every matrix == the format's rounding of what was sent != sent, 1-D
    as sent; without it, the weights as sent."""
    rounder = FORMATS[weight_format]
    cfg = TorchEngineConfig(max_seq_len=96, num_slots=2, weight_format=weight_format)
    engine = TorchEngine(build_model("tiny", seed=0), cfg)
    sent = {k: v.clone() for k, v in build_model("tiny", seed=1).state_dict().items()}
    engine.update_weights([list(sent.items())], version=1)
    stored = engine._named_tensors()
    matrices = [n for n, t in sent.items() if t.dim() >= 2]
    vectors = [n for n, t in sent.items() if t.dim() == 1]
    assert matrices and vectors
    for name in matrices:
        assert not torch.equal(stored[name], sent[name]), name
        torch.testing.assert_close(stored[name], rounder(sent[name]), rtol=0, atol=0)
    for name in vectors:
        torch.testing.assert_close(stored[name], sent[name], rtol=0, atol=0)
    plain = TorchEngine(build_model("tiny", seed=0), TorchEngineConfig(max_seq_len=96, num_slots=2))
    plain.update_weights([list(sent.items())], version=1)
    for name, tensor in sent.items():
        torch.testing.assert_close(plain._named_tensors()[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_true_on_policy_rejects_weight_format(weight_format):
    import dataclasses as dc

    from rlbench import presets

    cfg = presets.cpu_test(model="tiny", workdir="/tmp/unused", level=1)
    with pytest.raises(ValueError, match=f"engine.weight_format='{weight_format}'"):
        cfg.replace(engine=dc.replace(cfg.engine, weight_format=weight_format), true_on_policy_mode=True)
    assert cfg.replace(engine=dc.replace(cfg.engine, weight_format=weight_format)).engine.weight_format == weight_format
