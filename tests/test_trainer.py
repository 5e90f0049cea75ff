"""Trainer sub-steps on the real components (tiny random model, CPU): shapes, versions, the first micro-batch's gap to
the engine's log-probs, weight sync, and one clear error per kind of bad data."""

from __future__ import annotations

import dataclasses as dc
import json

import pytest
import torch

from rlbench import Trainer, presets
from rlbench.rewards import RewardError
from rlbench.types import Status


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("trainer")
    cfg = presets.cpu_test(model="tiny", workdir=str(work), level=1, n_eval=16)
    cfg = cfg.replace(
        rollout=dc.replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8),
        batch=dc.replace(cfg.batch, global_batch_size=8, max_tokens_per_gpu=128),
        eval=dc.replace(cfg.eval, interval=1, max_prompts=8, n_samples_per_prompt=2, pass_k=(1, 2)),
    )
    return Trainer(cfg)


def first_mb_gap(batch) -> float:
    """mean |log π_old − log π_rollout| over the trained tokens of the very first micro-batch, by hand."""
    pack, old = batch.packs[0][0], batch.old_log_probs[0][0]
    on = pack.loss_mask != 0
    return float((old - pack.rollout_log_probs).abs()[on].double().mean())


def test_sub_steps_are_inspectable(trainer):
    batch = trainer.rollout()
    assert len(batch.samples) == 16 and len(batch.groups) == 4
    assert all(s.reward is not None and s.weight_version == 0 for s in batch.samples)
    score = trainer.score(batch)
    for group in batch.groups:  # GRPO: one scalar per sample, summing to zero within a group
        assert abs(sum(s.advantage for s in group)) < 1e-5 and all(s.token_advantages is None for s in group)
    assert set(score) == {"rollout/raw_reward"}
    packs = trainer.pack(batch)
    assert len(packs) == 2  # 16 samples / global_batch_size 8
    assert sorted(i for p in packs[0] for i in p.sample_ids) == list(range(8))
    assert all(p.num_tokens <= 128 for step in packs for p in step)
    lp = trainer.compute_log_probs(batch)
    assert [len(x) for x in batch.old_log_probs] == [len(p) for p in packs]
    # The recomputed log-probs are the engine's, to float32 round-off (same weights, same temperature).
    assert abs(lp["rollout/log_probs"] - lp["rollout/rollout_log_probs"]) < 1e-4
    adv = trainer.compute_advantages(batch)
    for s, (step, step_adv) in enumerate(zip(packs, batch.advantages)):  # GRPO: each sample's scalar, per token
        for p, a in zip(step, step_adv):
            for i, x in zip(p.sample_ids, torch.split(a, p.response_lengths)):
                assert torch.equal(x, torch.full_like(x, batch.samples[s * 8 + i].advantage))
    assert adv["rollout/advantages"] == pytest.approx(float(sum(s.advantage * sum(s.loss_mask) for s in batch.samples)
                                                            / sum(sum(s.loss_mask) for s in batch.samples)), abs=1e-6)
    metrics = trainer.train_step(batch)
    assert metrics["train/optimizer_steps"] == 2.0
    # the first training forward (bitwise the recompute on eager CPU) against the engine's log-probs: fp32 round-off
    assert metrics["train/first_mb_kl_vs_rollout"] == pytest.approx(first_mb_gap(batch), rel=1e-5)
    assert 0 < metrics["train/first_mb_kl_vs_rollout"] < 1e-5
    sync = trainer.sync_weights()
    # one policy version per optimizer step applied
    assert sync["weights/bytes"] > 0 and trainer.engine.weight_version == trainer.version == 2


def test_step_history_versions_and_engine_weights(trainer):
    before, version = trainer.rollout_id, trainer.version
    m = trainer.step()
    assert trainer.rollout_id == before + 1 and trainer.history[-1] is m
    assert m["rollout/weight_version"] == version and m["weights/version"] == version + m["train/optimizer_steps"]
    assert m["train/first_mb_kl_vs_rollout"] == pytest.approx(first_mb_gap(trainer.last_rollout), rel=1e-5)
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "rollout/zero_std/count", "rollout/truncated_ratio",
                "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/grad_norm", "train/lr",
                "train/train_rollout_logprob_abs_diff", "perf/rollout_time", "perf/log_probs_time", "perf/train_time",
                "perf/update_weights_time", "perf/step_time", "perf/tokens_per_sec", "eval/reward", "eval/pass@1",
                "eval/pass@2"):
        assert key in m, key
    assert all(isinstance(v, float) for v in m.values())
    engine = dict(trainer.engine.model.named_parameters())
    for name, p in trainer.backend.model.named_parameters():  # engine holds the trainer's current weights
        assert torch.equal(engine[name], p.full_tensor() if hasattr(p, "full_tensor") else p), name
    assert trainer.eval_history[-1]["eval/pass@1"] == m["eval/pass@1"]


def test_step_records_the_peak_memory_of_each_phase(trainer, monkeypatch):
    # A fake CUDA allocator: each reading returns the next peak (GiB) and the trainer resets the counter.
    readings, resets = iter([3.0, 1.0, 5.0, 2.0, 4.0]), []
    monkeypatch.setattr(trainer, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(readings) * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a CPU test")
    m = trainer.step()
    assert {k: m[k] for k in m if k.endswith("peak_memory_gb")} == {
        "perf/rollout_peak_memory_gb": 3.0, "perf/log_probs_peak_memory_gb": 1.0, "perf/train_peak_memory_gb": 5.0,
        "perf/update_weights_peak_memory_gb": 2.0,
        "perf/peak_memory_gb": 5.0}  # the step's peak: the phases' and the last reading's (4.0) maximum
    assert len(resets) == 4 and "perf/mfu" not in m  # no peak FLOP/s for an unknown device


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    "lines, match",
    [
        ([json.dumps({"question": "1+1=?", "label": "2"})], r"bad\.jsonl:1: missing key 'prompt'; available keys: \['label', 'question'\]"),
        ([json.dumps({"prompt": "1+1=?", "label": "2"}), "{not json"], r":2: invalid JSON"),
        ([json.dumps({"prompt": "1+1=?" * 40, "label": "2"})], r"longest prompt \(\d+ tokens\) \+ max response \(8\) exceeds engine.max_seq_len=48"),
        ([json.dumps({"prompt": "1+1=?", "label": "2", "metadata": "x"})], r"'metadata' must be a dict"),
    ],
)
def test_bad_data_gives_one_clear_error(trainer, tmp_path, lines, match):
    cfg = trainer.cfg.replace(data=dc.replace(trainer.cfg.data, path=_write(tmp_path / "bad.jsonl", lines)), task=None,
                              eval=dc.replace(trainer.cfg.eval, interval=None))
    with pytest.raises(ValueError, match=match):
        Trainer(cfg)


def test_a_raising_reward_names_the_sample(trainer):
    batch = trainer.rollout()
    batch.samples[3].reward = None
    batch.samples[3].metadata["rm_type"] = "json:loads"  # a user reward that raises (TypeError)
    with pytest.raises(RewardError, match=r"reward 'json:loads' raised on sample 3 \(prompt=.*, response=.*, label="):
        trainer.score(batch)
    assert batch.samples[0].status in (Status.COMPLETED, Status.TRUNCATED)
