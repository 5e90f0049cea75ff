"""Rewards scored in worker processes (`rlbench.rollout.reward_pool`), overlapped with generation."""

from __future__ import annotations

import os
import time

import pytest
from test_trainer_rollout import ScriptedEngine, _dataset

from rlbench.configs import RolloutConfig
from rlbench.data import build_tokenizer
from rlbench.rewards import REWARDS, RewardError, score_batch
from rlbench.rollout.manager import RolloutManager
from rlbench.rollout.reward_pool import RewardPool, default_workers, poolable


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _data(tmp_path, tok):
    """The arithmetic prompts without their per-row `rm_type` ("math"), so `RolloutConfig.rm_type` decides."""
    dataset = _dataset(tmp_path, tok)
    for item in dataset.items:
        item.metadata.pop("rm_type", None)
    return dataset


def test_pool_scores_as_inline_including_per_sample_reward_names():
    records = [(f"so \\boxed{{{i}}}", str(i + i % 2), "math", "p", i) for i in range(12)]
    records += [("\\boxed{1/2}", "0.5", "math", "p", 12), ("\\boxed{x}", "x", "exact", "p", 13),
                ("\\boxed{(3+5)*2}", {"target": 16, "numbers": [3, 5, 2]}, "countdown", "p", 14)]
    pool = RewardPool(2)
    try:
        got = pool.map(records)
    finally:
        pool.close()
    want = [score_batch([r[0]], [r[1]], r[2])[0] for r in records]
    assert got == want
    assert sum(want) == 9.0  # 6 integer matches, the fraction, the exact string, the countdown expression


def test_poolable_names():
    assert poolable("math") and poolable("my_pkg.rewards:score")
    assert not poolable("__main__:score") and not poolable("no_colon") and not poolable(lambda response, label: 0.0)
    assert default_workers("cpu") == 0 and 1 <= default_workers("cuda") <= 8


class ReportingEngine(ScriptedEngine):
    """Reports every sample through `on_finish`, then holds `generate` open until the workers have scored
    them: it returns only if scoring really ran while generation was still going."""

    def __init__(self, tokenizer, marks):
        super().__init__(tokenizer, p=0.5)
        self.marks = marks

    def generate(self, prompts, sampling, seeds=None, on_finish=None):
        out = super().generate(prompts, sampling, seeds)
        for g in out:
            on_finish(g)
        deadline = time.monotonic() + 120
        while len(os.listdir(self.marks)) < len(out):
            assert time.monotonic() < deadline, "the pool scored nothing while the engine was generating"
            time.sleep(0.01)
        return out


def test_samples_are_scored_while_the_engine_generates(tmp_path, tok, monkeypatch):
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("RLBENCH_TEST_MARKS", str(marks))
    cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=3, rm_type="reward_helpers:marked")
    mgr = RolloutManager(cfg, ReportingEngine(tok, str(marks)), _data(tmp_path, tok), tok, reward_workers=2)
    batch = mgr.generate(0)
    mgr.reward_pool.close()
    assert len(os.listdir(marks)) == 12  # each sample scored once, in the workers (the engine waited for them)
    assert {name.split("-")[0] for name in os.listdir(marks)} - {str(os.getpid())}  # not in this process
    inline = RolloutManager(RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=3), ScriptedEngine(tok, p=0.5),
                            _dataset(tmp_path, tok), tok).generate(0)
    assert [s.reward for s in batch.samples] == [s.reward for s in inline.samples]
    assert 0 < sum(s.reward for s in batch.samples) < 12
    assert batch.metrics["perf/reward_wait_time"] >= 0.0


def test_engines_without_on_finish_are_scored_by_the_pool_after_generation(tmp_path, tok):
    cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=3)
    pooled = RolloutManager(cfg, ScriptedEngine(tok, p=0.5), _dataset(tmp_path, tok), tok, reward_workers=2)
    inline = RolloutManager(cfg, ScriptedEngine(tok, p=0.5), _dataset(tmp_path, tok), tok)
    assert [s.reward for s in pooled.generate(0).samples] == [s.reward for s in inline.generate(0).samples]
    pooled.reward_pool.close()


def test_rewards_a_worker_cannot_import_are_scored_inline(tmp_path, tok, monkeypatch):
    calls = []

    def runtime_reward(response, label):  # registered at run time: the workers do not have it
        calls.append(response)
        return 1.0

    monkeypatch.setitem(REWARDS, "runtime_reward", runtime_reward)
    monkeypatch.setattr("rlbench.configs.rollout.REWARD_NAMES", (*REWARDS,))
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, rm_type="runtime_reward")
    mgr = RolloutManager(cfg, ReportingEngine(tok, str(tmp_path)), _data(tmp_path, tok), tok, reward_workers=1)
    mgr.engine.marks = str(tmp_path / "none")
    os.mkdir(mgr.engine.marks)
    for i in range(4):  # the engine waits for 4 marks: none come from an inline reward, so pre-fill them
        open(os.path.join(mgr.engine.marks, str(i)), "w").close()
    batch = mgr.generate(0)
    mgr.reward_pool.close()
    assert [s.reward for s in batch.samples] == [1.0] * 4 and len(calls) == 4


def test_a_raising_reward_names_the_function_and_the_sample(tmp_path, tok):
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, rm_type="reward_helpers:boom")
    mgr = RolloutManager(cfg, ScriptedEngine(tok), _data(tmp_path, tok), tok, reward_workers=2)
    with pytest.raises(RewardError, match=r"reward 'reward_helpers:boom' raised on sample \d.*ZeroDivisionError: "
                                          r"the reward's own bug"):
        mgr.generate(0)
    mgr.reward_pool.close()


def test_a_dead_worker_is_a_clear_error(tmp_path, tok):
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, rm_type="reward_helpers:die")
    mgr = RolloutManager(cfg, ScriptedEngine(tok), _data(tmp_path, tok), tok, reward_workers=1)
    with pytest.raises(RuntimeError, match=r"reward worker 0 .*exited with code 3.*--reward-workers 0"):
        mgr.generate(0)
    with pytest.raises(RuntimeError, match="exited with code 3"):  # and stays failed, loudly
        mgr.reward_pool.submit([("x", "1", "math", "p", 0)])
    mgr.reward_pool.close()


def test_close_kills_a_worker_stuck_in_a_reward():
    pool = RewardPool(1, timeout=None)  # no per-call limit: the reward can hang
    future = pool.submit([("x", "1", "reward_helpers:hang", "p", 0)])
    start = time.monotonic()
    pool.close(timeout=0.5)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="exited with code -9"):
        future.result(timeout=30)
