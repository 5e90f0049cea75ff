"""End to end on CPU, the classic RLHF chain on the synthetic preference task (rlbench.experiments.rlhf): a verbose
SFT warm start, a reward model trained on preferences made by a hidden rule (>= 90 % held-out pair accuracy), then
GRPO against the RM's score alone: the held-out hidden-rule score rises, and so does the RM's score.

The warm start is its own (not tests/conftest.py's `sft_dir`): that one already answers in the short form ~82 % of
the time, so the part of the rule the RM learns has little room there, and RL against the RM lowered the hidden
score from it (docs/log/2026-12.md, seventh session). Measured numbers: docs/reward_model.md.
"""

from __future__ import annotations

import pytest
import torch

from rlbench import Trainer
from rlbench.experiments.rlhf import hidden_parts, run_config, train_reward_model, warm_start

STEPS = 12
# Measured (2026-12-07, this config, seed 0): hidden 0.564 -> 0.922 at 12 steps (short form 0.45 -> 0.83, correct
# answers 0.22 -> 0.18: the RM does not tell answers apart, the drift RL shows there). Half the gain, rounded down.
HIDDEN_MARGIN = 0.15


@pytest.mark.slow
def test_rl_against_the_reward_model_raises_the_hidden_rule_score(tmp_path):
    torch.set_num_threads(1)
    model = warm_start(str(tmp_path / "sft"))
    rm, rm_metrics = train_reward_model(str(tmp_path / "rm"))
    assert rm_metrics["rm/eval_accuracy"] >= 0.9, rm_metrics
    trainer = Trainer(run_config(model, rm, str(tmp_path / "grpo"), estimator="grpo", reward="rm", steps=STEPS))
    history = trainer.fit()
    trainer.close()
    start, end = hidden_parts(trainer.eval_history[0]), hidden_parts(trainer.eval_history[-1])
    assert trainer.eval_history[-1]["rollout/id"] == STEPS
    assert start["short"] < 0.7, start  # the warm start leaves the form room to improve
    assert end["hidden"] - start["hidden"] >= HIDDEN_MARGIN, (start, end)
    rm_score = [h["rollout/rm_score"] for h in history]
    assert sum(rm_score[-3:]) / 3 > sum(rm_score[:3]) / 3 + 0.2, rm_score  # what it was trained on rose too
    # the rule was logged beside the RM score, and trained nothing: the reward is the RM's score alone
    assert all(h["rollout/raw_reward"] == pytest.approx(h["rollout/rm_score"], abs=1e-6) for h in history)


def test_hidden_parts_and_run_config_by_hand(tmp_path):
    # 8 samples: 5 short (3 of them correct), 3 long (1 correct): reward = (3 x 1.5 + 2 x 1 + 1 x 0.5) / 8
    parts = hidden_parts({"eval/reward": 7.0 / 8, "eval/pass@1": 5 / 8})
    assert parts == {"hidden": 0.875, "short": 0.625, "correct": 0.5}
    ppo = run_config("tiny", "runs/rm", str(tmp_path), estimator="ppo", reward="rm+math", kl_horizon=1000)
    assert ppo.rollout.reward_weights == {"rm": 1.0, "math": 1.0} and ppo.rollout.rm_type.endswith(":hidden_rule_score")
    assert (ppo.loss.advantage_estimator, ppo.loss.kl_ctl_type, ppo.loss.kl_horizon) == ("gae", "adaptive", 1000)
    assert ppo.backend.ref_model == "tiny" and ppo.data.metadata_key is None
    with pytest.raises(ValueError, match="estimator='reinforce' must be one of"):
        run_config("tiny", "runs/rm", str(tmp_path), estimator="reinforce")
    with pytest.raises(ValueError, match="reward='math' must be one of"):
        run_config("tiny", "runs/rm", str(tmp_path), reward="math")
