"""`make run`'s extras: the learning-curve PNG written beside the metrics (a real image: its size, its axes and
each series' colour where that series' points are), and `demo --seed`, which picks another RL run from the
same warm start (other prompts and samples; the same seed, the same rollout)."""

from __future__ import annotations

import dataclasses as dc
import struct
import types
import zlib

import pytest

from rlbench import Trainer, presets
from rlbench.cli import build_parser, preset_config
from rlbench.curve_png import COLORS, eval_curve_series, nice_ticks, write_curve_png, write_run_curve


def read_png(path) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes row by row) of an 8-bit RGB PNG whose rows use filter 0 (what Canvas writes)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color_type) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 3 * width + 1
    assert len(raw) == height * stride and all(raw[y * stride] == 0 for y in range(height))
    return width, height, b"".join(raw[y * stride + 1 : (y + 1) * stride] for y in range(height))


def pixel(png, x: int, y: int) -> tuple[int, int, int]:
    width, _, rgb = png
    i = 3 * (y * width + x)
    return tuple(rgb[i : i + 3])


def test_nice_ticks():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 60) == [0, 20, 40, 60]
    assert nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(3, 3) == [3, 3.2, 3.4, 3.6, 3.8, 4.0]  # a flat range still gets an axis


def test_curve_png_draws_each_series_where_its_points_are(tmp_path):
    series = {"pass@1": [(0, 0.25), (20, 0.5), (60, 0.75)], "pass@8": [(0, 0.75), (60, 0.875)]}
    path = write_curve_png(str(tmp_path / "sub" / "c.png"), series, title="GRPO", xlabel="step", ylabel="pass@k",
                           y_range=(0, 1), size=(400, 300))
    png = read_png(path)
    assert png[:2] == (400, 300)
    # The plot area (left 78, right 24, top 64, bottom 64): x 0..60 -> 78..376, y 0..1 -> 236..64.
    def at(x, y):
        return round(78 + x / 60 * 298), round(236 - y * 172)
    assert pixel(png, *at(0, 0.25)) == COLORS[0] and pixel(png, *at(20, 0.5)) == COLORS[0]
    assert pixel(png, *at(0, 0.75)) == COLORS[1] and pixel(png, *at(30, 0.8125)) == COLORS[1]  # on the segment
    assert pixel(png, *at(40, 0.25)) == (255, 255, 255)  # nothing drawn there
    assert pixel(png, 78, 150) == (60, 60, 60)  # the y axis
    colors = {png[2][i : i + 3] for i in range(0, len(png[2]), 3)}
    assert len(colors) >= 5  # white, axis, grid, two series: a picture, not a blank
    with pytest.raises(ValueError, match="no points"):
        write_curve_png(str(tmp_path / "e.png"), {"a": []}, title="t", xlabel="x", ylabel="y")


def test_run_curve_is_written_beside_the_metrics(tmp_path):
    cfg = presets.cpu_demo(model="tiny", workdir=str(tmp_path / "run"))
    evals = [{"rollout/id": 0.0, "eval/pass@1": 0.3, "eval/pass@8": 0.7},
             {"rollout/id": 2.0, "eval/pass@1": 0.5, "eval/pass@8": 0.8}]
    history = [{"rollout/raw_reward": 0.3}, {"rollout/raw_reward": 0.4}]
    assert list(eval_curve_series(evals, history)) == ["held-out pass@1", "held-out pass@8", "train reward"]
    trainer = types.SimpleNamespace(cfg=cfg, eval_history=evals, history=history, eval_items=[None] * 128)
    path = write_run_curve(trainer)
    assert path == str(tmp_path / "run" / "curve.png")
    width, height, _ = read_png(path)
    assert (width, height) == (720, 440)
    assert write_run_curve(types.SimpleNamespace(**vars(trainer) | {"eval_history": evals[:1]})) is None  # no curve


def _first_rollout(tmp_path, monkeypatch, seed: int, name: str) -> list[list[int]]:
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path / "cache"))
    cfg = presets.cpu_demo(model="tiny", workdir=str(tmp_path / name), seed=seed)
    cfg = cfg.replace(rollout=dc.replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=2, max_response_len=6),
                      batch=dc.replace(cfg.batch, global_batch_size=8), eval=dc.replace(cfg.eval, interval=None))
    trainer = Trainer(cfg)
    try:
        return [list(s.tokens) for s in trainer.rollout().samples]
    finally:
        trainer.close()


def test_demo_seed_picks_other_prompts_and_samples(tmp_path, monkeypatch):
    args = build_parser().parse_args(["demo", "--seed", "3", "--hf-checkpoint", "tiny"])
    cfg = preset_config(args)
    assert (cfg.rollout.seed, cfg.data.seed, cfg.seed) == (3, 3, 3)
    assert preset_config(build_parser().parse_args(["demo", "--hf-checkpoint", "tiny"])).rollout.seed == 0
    a = _first_rollout(tmp_path, monkeypatch, 0, "a")
    assert _first_rollout(tmp_path, monkeypatch, 0, "b") == a
    b = _first_rollout(tmp_path, monkeypatch, 1, "c")
    assert b != a and len(b) == len(a) == 8
