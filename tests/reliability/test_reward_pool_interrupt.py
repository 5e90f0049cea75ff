"""Ctrl-C while a reward worker process hangs in a reward, then the next rollout: the worker holding the abandoned
job is replaced at the interrupt, so the next rollout scores with the fixed reward at once (not after the stuck
call's timeout, or never without one) and gets the right rewards."""

from __future__ import annotations

import os
import time

import pytest
from test_trainer_rollout import ScriptedEngine

from rlbench.configs import RolloutConfig
from rlbench.data import DataConfig, PromptDataset, build_tokenizer, make_arithmetic, write_jsonl
from rlbench.rollout.manager import RolloutManager

from ._faults import hang_if_flagged, sigint_when


def test_ctrl_c_during_a_hung_reward_in_a_worker_then_the_next_rollout_scores_at_once(tmp_path, monkeypatch):
    flag = str(tmp_path / "hang")
    open(flag, "w").close()
    monkeypatch.setenv("RLBENCH_TEST_HANG", flag)  # before the worker starts: it inherits the environment
    tok = build_tokenizer()
    write_jsonl(make_arithmetic(16, seed=3), str(tmp_path / "arith.jsonl"))
    data = PromptDataset(DataConfig(path=str(tmp_path / "arith.jsonl"), metadata_key=None), tok)
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, rm_type="reliability._faults:hang_if_flagged",
                        reward_timeout=60.0)
    mgr = RolloutManager(cfg, ScriptedEngine(tok), data, tok, reward_workers=1)
    try:
        stuck = mgr.reward_pool._workers[0].proc
        with sigint_when(lambda: os.path.exists(flag + ".started")), pytest.raises(KeyboardInterrupt):
            mgr.generate(0)
        os.remove(flag)  # the reward is fixed
        assert stuck.wait(30) == -9  # the worker stuck in the hung call was killed at the interrupt
        start = time.monotonic()
        batch = mgr.generate(1)
        assert time.monotonic() - start < 30  # not behind the stuck call (60 s timeout)
        assert [s.reward for s in batch.samples] == [hang_if_flagged(s.response, s.label) for s in batch.samples]
        assert mgr.reward_pool._workers[0].proc.pid != stuck.pid
    finally:
        mgr.reward_pool.close()
