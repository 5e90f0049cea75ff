"""A less precise rollout engine (`TorchEngineConfig.dtype`) is a measurable train-inference mismatch, and the
TIS correction acts in proportion to it (benchmarks/mismatch.py runs the curves).

One rollout of the untrained `tiny` model per engine dtype, rewarded by a fixed rule (every third sample) so
the advantages are non-zero; then the same batch trains under plain PPO and under TIS. Measured here
(2026-12-02): fp32 trainer with an fp32 engine |old - rollout| ~8e-8 (fp32 rounding of two kernel paths),
bf16 engine ~8e-4, fp16 engine ~1e-4; the TIS-vs-PPO loss difference on the same batch ~8e-9 matched, ~3e-5
with bf16 (the loss itself is ~-6e-4).
"""

from __future__ import annotations

import dataclasses as dc
import importlib.util
import os
import sys

import pytest
import torch

from rlbench import Trainer, presets


def _one_step(tmp_path, engine_dtype: str | None, use_tis: bool) -> dict:
    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path / f"{engine_dtype}-{use_tis}"), level=1)
    cfg = cfg.replace(engine=dc.replace(cfg.engine, dtype=engine_dtype), eval=dc.replace(cfg.eval, interval=None),
                      loss=dc.replace(cfg.loss, use_tis=use_tis))
    assert cfg.backend.param_dtype == "fp32"
    trainer = Trainer(cfg)
    try:
        batch = trainer.rollout()
        for i, s in enumerate(batch.samples):
            s.reward = float(i % 3 == 0)  # not all equal within a group: non-zero GRPO advantages
        trainer.score(batch)
        trainer.pack(batch)
        metrics = trainer.compute_log_probs(batch)
        metrics |= trainer.train_step(batch)
    finally:
        trainer.close()
    return metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("mismatch")
    try:
        return {(dt, tis): _one_step(tmp, dt, tis) for dt in (None, "bf16") for tis in (False, True)}
    finally:
        torch.set_num_threads(threads)


def test_a_bf16_engine_is_a_mismatch_a_matched_one_is_not(runs):
    matched, low = runs[(None, False)], runs[("bf16", False)]
    diff_matched = matched["train/train_rollout_logprob_abs_diff"]
    diff_low = low["train/train_rollout_logprob_abs_diff"]
    assert diff_matched < 1e-5, diff_matched  # same dtype: only fp32 rounding of two kernel paths
    assert diff_low > 1e-4, diff_low  # bf16 engine: ~8e-4 measured
    assert diff_low > 100 * diff_matched, (diff_low, diff_matched)
    assert abs(low["train/mismatch_kl"]) > 100 * abs(matched["train/mismatch_kl"])
    assert low["train/mismatch_k3_kl"] > 0


def test_tis_weights_leave_one_only_with_the_mismatch(runs):
    tis_matched, tis_low = runs[(None, True)], runs[("bf16", True)]
    assert tis_matched["train/tis_abs"] < 1e-5  # |w - 1|: weights ~1 when engine == trainer
    assert tis_low["train/tis_abs"] > 1e-4
    # The IS weights enter the loss: on the same batch, TIS moves the loss ~100x more with the bf16 engine.
    effect_matched = abs(tis_matched["train/loss"] - runs[(None, False)]["train/loss"])
    effect_low = abs(tis_low["train/loss"] - runs[("bf16", False)]["train/loss"])
    assert effect_low > 10 * effect_matched, (effect_low, effect_matched)
    # Rollout is identical under both losses (the loss does not change sampling).
    assert tis_low["train/train_rollout_logprob_abs_diff"] == runs[("bf16", False)]["train/train_rollout_logprob_abs_diff"]


# --- benchmarks/mismatch.py's perturbed engine (EngineWeightNoise) ------------------------------------------------

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "mismatch.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("mismatch_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _RecordingEngine:
    """Keeps the last weights it was sent, as `{name: tensor}`."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.versions: list[int] = []

    def update_weights(self, buckets, version: int) -> None:
        self.weights = {name: t.clone() for bucket in buckets for name, t in bucket}
        self.versions.append(version)


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [[("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4, generator=g)),
             ("model.layers.0.input_layernorm.weight", torch.ones(4))],
            [("model.norm.weight", torch.ones(4)), ("model.embed_tokens.weight", torch.randn(10, 4, generator=g))]]


def test_engine_weight_noise_is_deterministic_per_version_and_redrawn_across(bench):
    engine = _RecordingEngine()
    noise = bench.EngineWeightNoise(engine, sigma=0.5, seed=3)
    sent = {n: t for b in _buckets() for n, t in b}
    draws = []
    for version in (1, 1, 2):
        engine.update_weights(_buckets(), version)
        draws.append(engine.weights)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(draws[0][name], draws[1][name])  # the same version re-sent: the same draw
    assert not torch.equal(draws[0][name], draws[2][name])  # a new version: a new draw
    rel = draws[0][name] / sent[name] - 1  # w * (1 + sigma * N(0, 1)): relative noise of std ~sigma
    assert 0.2 < rel.std().item() < 1.0, rel.std()
    for d in draws:  # 1-D tensors (norms) pass as sent, every matrix is perturbed
        assert torch.equal(d["model.layers.0.input_layernorm.weight"], torch.ones(4))
        assert torch.equal(d["model.norm.weight"], torch.ones(4))
        assert not torch.equal(d["model.embed_tokens.weight"], sent["model.embed_tokens.weight"])
    assert noise.syncs == [(1, True), (1, True), (2, True)]
    fixed = _RecordingEngine()
    bench.EngineWeightNoise(fixed, sigma=0.5, seed=3, redraw=False)
    fixed.update_weights(_buckets(), 1)
    first = fixed.weights[name]
    fixed.update_weights(_buckets(), 2)
    assert torch.equal(first, fixed.weights[name])  # --noise-fixed: one draw for the run


def test_engine_weight_noise_disabled_or_zero_passes_weights_through(bench):
    sent = {n: t for b in _buckets() for n, t in b}
    engine = _RecordingEngine()
    noise = bench.EngineWeightNoise(engine, sigma=0.5, seed=0)
    noise.enabled = False  # the clean engine (the clean eval)
    engine.update_weights(_buckets(), 4)
    assert all(torch.equal(engine.weights[n], t) for n, t in sent.items())
    zero = _RecordingEngine()
    bench.EngineWeightNoise(zero, sigma=0.0, seed=0)
    zero.update_weights(_buckets(), 4)
    assert all(torch.equal(zero.weights[n], t) for n, t in sent.items())
    assert engine.versions == zero.versions == [4]
    with pytest.raises(ValueError, match="sigma"):
        bench.EngineWeightNoise(_RecordingEngine(), sigma=-0.1)


def test_engine_norm_scale_scales_only_the_final_norm(bench):
    engine = _RecordingEngine()
    bench.EngineWeightNoise(engine, sigma=0.0, norm_scale=0.5)
    engine.update_weights(_buckets(), 0)
    assert torch.equal(engine.weights["model.norm.weight"], torch.full((4,), 0.5))  # logits / 2: a hotter engine
    assert torch.equal(engine.weights["model.layers.0.input_layernorm.weight"], torch.ones(4))
