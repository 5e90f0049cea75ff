"""`Trainer.step()` takes the first optimizer step's π_old from its training forward (no old-log-prob pass for
it): it trains bit for bit like the explicit recompute, reports the same metrics, fills `batch.old_log_probs` with
the forward's values (bitwise the recompute on eager CPU); later optimizer steps still get a recomputed π_old."""

from __future__ import annotations

import dataclasses as dc

import pytest
import torch

from rlbench import Trainer, presets
from rlbench.algorithms import MISConfig


def _trainer(tmp_path, name, global_batch, loss=None):
    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path / name), level=1, n_eval=16)
    cfg = cfg.replace(
        rollout=dc.replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8),
        batch=dc.replace(cfg.batch, global_batch_size=global_batch, max_tokens_per_gpu=64),
        loss=loss or cfg.loss,
    )
    return Trainer(cfg)


def _explicit_step(t: Trainer) -> dict:
    """The loop's stages by hand, with every optimizer step's old log-probs recomputed first (the old way)."""
    batch = t.rollout()
    m = batch.metrics | t.score(batch)
    t.pack(batch)
    m |= t.compute_log_probs(batch)
    m |= t.compute_advantages(batch)
    m |= t.train_step(batch)
    t.sync_weights()
    t.rollout_id += 1  # what step()'s record stage does (the next rollout's seed depends on it)
    return m | {"batch": batch}


def _params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.backend.model.parameters()]


@pytest.mark.parametrize("global_batch", [16, 8], ids=["one_step", "two_steps"])
def test_step_equals_explicit_recompute(tmp_path, global_batch):
    torch.set_num_threads(1)
    a, b = _trainer(tmp_path, "loop", global_batch), _trainer(tmp_path, "explicit", global_batch)
    for _ in range(2):
        got = a.step()
        want = _explicit_step(b)
        for key in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/grad_norm", "rollout/log_probs",
                    "rollout/advantages", "train/train_rollout_logprob_abs_diff", "train/first_mb_kl_vs_rollout"):
            assert got[key] == want[key], key
        assert got["train/first_mb_kl_vs_rollout"] > 0  # the fp32 engine and trainer differ in round-off
        # one optimizer step per rollout: no separate old-log-prob pass at all
        assert ("perf/log_probs_time" in got) == (global_batch < 16)
    assert all(torch.equal(x, y) for x, y in zip(_params(a), _params(b)))
    batch = want["batch"]
    assert all(o is not None for o in batch.old_log_probs)


def test_the_forward_old_fills_the_batch(tmp_path):
    torch.set_num_threads(1)
    t = _trainer(tmp_path, "fill", 16)
    batch = t.rollout()
    t.score(batch)
    t.pack(batch)
    t.compute_log_probs(batch, first_from_forward=True)
    assert batch.old_log_probs == [None]
    recomputed = [o.log_probs for o in t.backend.compute_log_prob(batch.packs[0])]
    m = t.train_step(batch)
    assert all(torch.equal(x, y) for x, y in zip(batch.old_log_probs[0], recomputed))  # eager CPU: the same bits
    pack, on = batch.packs[0][0], batch.packs[0][0].loss_mask != 0  # the first micro-batch against the engine
    gap = (batch.old_log_probs[0][0] - pack.rollout_log_probs).abs()[on].double().mean()
    assert m["train/first_mb_kl_vs_rollout"] == pytest.approx(float(gap), rel=1e-5)


def test_batch_normalised_mis_still_recomputes(tmp_path):
    torch.set_num_threads(1)
    base = presets.cpu_test(model="tiny", workdir=str(tmp_path / "x"), level=1, n_eval=16).loss
    t = _trainer(tmp_path, "mis", 16, loss=dc.replace(base, use_tis=True, mis=MISConfig()))
    m = t.step()
    assert "perf/log_probs_time" in m and m["perf/log_probs_tokens"] > 0
