"""Bad rewards (issue 24, item 3): NaN/Inf, None/str, a hanging reward and a wrong rm_type each raise one error
naming the reward function and the sample; skipped optimizer steps are on the console line and warned about.
After each fault the trainer is still usable (the next step trains)."""

from __future__ import annotations

import dataclasses as dc
import math
import sys
import threading
import time
import types

import pytest
import torch

from rlbench import Trainer
from rlbench.configs import RolloutConfig
from rlbench.metrics import ConsoleSink
from rlbench.rewards import RewardError, score_batch
from rlbench.types import Sample

from ._faults import sigint_when
from ._small import small_cfg

MOD = "_rlbench_reliability_rm"


@pytest.fixture(scope="module")
def reward_module():
    """A user reward module whose function the tests swap (`module.impl`)."""
    module = types.ModuleType(MOD)
    module.impl = lambda response, label: 0.0
    module.score = lambda response, label: module.impl(response, label)
    sys.modules[MOD] = module
    yield module
    del sys.modules[MOD]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, reward_module):
    torch.set_num_threads(1)
    cfg = small_cfg(tmp_path_factory.mktemp("rewards"))
    cfg = cfg.replace(rollout=dc.replace(cfg.rollout, rm_type=f"{MOD}:score", reward_timeout=0.5),
                      data=dc.replace(cfg.data, metadata_key=None))  # the rows' rm_type="math" would win
    lines: list[str] = []
    t = Trainer(cfg, sinks=[ConsoleSink(printer=lines.append)])
    t.console_lines = lines
    yield t
    t.close()


def _step_raises(trainer, reward_module, impl, match):
    """Inject `impl` as the reward: step() raises naming it; then a good reward trains the next step."""
    rollout_id, version = trainer.rollout_id, trainer.policy_version
    reward_module.impl = impl
    with pytest.raises(RewardError, match=match) as info:
        trainer.step()
    msg = str(info.value)
    assert f"reward '{MOD}:score'" in msg and "prompt=" in msg and "response=" in msg and "label=" in msg, msg
    assert (trainer.rollout_id, trainer.policy_version) == (rollout_id, version)  # nothing half-applied
    reward_module.impl = lambda response, label: float(len(response) % 2)
    m = trainer.step()  # still usable
    assert trainer.rollout_id == rollout_id + 1 and math.isfinite(m["rollout/raw_reward"]) and m["train/skipped"] == 0
    return msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_is_an_error_naming_the_sample(trainer, reward_module, bad):
    msg = _step_raises(trainer, reward_module, lambda r, label: bad, r"returned -?(nan|inf) \(not finite\)")
    assert "sample 0 " in msg and "return a finite float" in msg


@pytest.mark.parametrize("bad, type_name", [(None, "NoneType"), ("1.0", "str"), ([1.0], "list")])
def test_non_number_reward_is_an_error_naming_value_and_type(trainer, reward_module, bad, type_name):
    msg = _step_raises(trainer, reward_module, lambda r, label: bad, rf"of type {type_name}; a reward must return")
    assert repr(bad) in msg


def test_a_hanging_reward_times_out_naming_the_function_and_sample(trainer, reward_module):
    release = threading.Event()
    _step_raises(trainer, reward_module, lambda r, label: release.wait(30) and 0.0,
                 r"timed out after 0.5s on sample 0 .*raise rollout.reward_timeout \(--reward-timeout\)")
    release.set()  # let the abandoned worker thread finish


def test_rewards_set_by_a_custom_rollout_are_checked_in_score(trainer):
    batch = trainer.rollout()
    batch.samples[5].reward = float("nan")
    with pytest.raises(RewardError, match=r"the reward of sample 5 \(prompt=.*returned nan \(not finite\)"):
        trainer.score(batch)
    s = Sample(tokens=[1, 2], response_length=1, prompt="2+2=?", response="\\boxed{4}", label="4")
    assert score_batch([s], rm_type="math", timeout=5) == [1.0]


def test_wrong_rm_type_is_reported_before_the_model_is_built(trainer, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown reward 'mth' \(rm_type\) \(did you mean 'math'\?\)"):
        RolloutConfig(rm_type="mth")
    import rlbench.orchestration.local as local

    def no_build(cfg, *args):
        raise AssertionError("the model was built before rm_type was checked")

    monkeypatch.setattr(local, "build_backend", no_build)  # what builds the models: the trainer's, the engine's
    monkeypatch.setattr(local, "build_engine", no_build)
    for rm, match in [("no_such_mod_xyz:score", r"cannot import module 'no_such_mod_xyz'.*PYTHONPATH"),
                      (f"{MOD}:scroe", rf"module '{MOD}' has no callable 'scroe' \(did you mean 'score'\?\)")]:
        cfg = trainer.cfg.replace(rollout=dc.replace(trainer.cfg.rollout, rm_type=rm))
        with pytest.raises(ValueError, match=match):
            Trainer(cfg)


def test_skipped_steps_are_on_the_console_and_warned_about(trainer, reward_module, monkeypatch):
    reward_module.impl = lambda response, label: float(len(response) % 2)
    before = {k: v.detach().clone() for k, v in trainer.backend.model.state_dict().items()}
    monkeypatch.setattr(trainer.backend, "_clip_grad_norm", lambda: torch.tensor(float("nan")))  # a NaN grad norm
    trainer.skipped_streak = 0
    m = trainer.step()  # 2 optimizer steps skipped: below warn_skipped_steps=3
    assert m["train/skipped"] == 1.0 and "| skipped 1 |" in trainer.console_lines[-1]
    with pytest.warns(RuntimeWarning, match=r"4 optimizer steps in a row were skipped"):
        trainer.step()
    after = trainer.backend.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # skipped: the weights are bitwise untouched
    monkeypatch.undo()
    m = trainer.step()
    assert m["train/skipped"] == 0 and trainer.skipped_streak == 0 and "skipped" not in trainer.console_lines[-1]


def test_ctrl_c_during_a_hanging_reward_then_the_fixed_reward_trains_at_once(trainer, reward_module, monkeypatch):
    """Ctrl-C while a user reward hangs (in its worker thread): the stuck thread is abandoned there and then, so
    the next step() scores with the fixed reward at once instead of queueing behind it until the timeout."""
    monkeypatch.setattr(trainer.rollouts, "cfg", dc.replace(trainer.rollouts.cfg, reward_timeout=60.0))
    release, started = threading.Event(), threading.Event()

    def hang(response, label):
        started.set()
        release.wait(120)
        return 0.0

    reward_module.impl = hang
    rollout_id = trainer.rollout_id
    try:
        with sigint_when(started.is_set), pytest.raises(KeyboardInterrupt):
            trainer.step()
        assert trainer.rollout_id == rollout_id  # rolled back
        reward_module.impl = lambda response, label: float(len(response) % 2)  # the reward is fixed
        start = time.monotonic()
        m = trainer.step()
        assert time.monotonic() - start < 30  # not behind the stuck call (60 s timeout, then "timed out")
        assert trainer.rollout_id == rollout_id + 1 and m["train/skipped"] == 0
    finally:
        release.set()  # let the abandoned thread finish
