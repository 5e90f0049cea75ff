"""A reward model in the RL loop: `--reward-model DIR` scores every rollout sample, the training reward is the
`--reward-weights` sum (checked against hand-computed values), its terms are logged beside the rule reward, and a
rule-only run logs none of it."""

from __future__ import annotations

import dataclasses as dc

import pytest
import torch

from rlbench import Trainer, presets
from rlbench.cli import build_parser, check_paths, preset_config
from rlbench.configs import RolloutConfig
from rlbench.configs.reward_model import RMTrainConfig
from rlbench.data.preferences import make_arithmetic_preferences
from rlbench.data.tasks import write_jsonl
from rlbench.reward_model.serve import RewardModel
from rlbench.reward_model.train import run_rm
from rlbench.rewards import combine_rewards, exact_reward, math_reward


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    write_jsonl(make_arithmetic_preferences(400, level=1, seed=0), root / "prefs.jsonl")
    run_rm(RMTrainConfig(data=str(root / "prefs.jsonl"), model="tiny", out=str(root / "rm"), lr=1e-3,
                         num_threads=1))
    return str(root / "rm")


def _run(tmp_path, **rollout) -> Trainer:
    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path), level=1, n_eval=8)
    return Trainer(cfg.replace(rollout=dc.replace(cfg.rollout, rollout_batch_size=4, **rollout),
                               batch=dc.replace(cfg.batch, global_batch_size=32), eval=dc.replace(cfg.eval, interval=None)))


def test_combine_rewards_by_hand():
    terms = {"math": [1.0, 0.0, 1.0], "rm": [0.25, -2.0, 3.5], "exact": [0.0, 1.0, 1.0]}
    assert combine_rewards({"math": 1.0, "rm": 0.5, "exact": 0.25}, terms) == [1.125, -0.75, 3.0]
    assert combine_rewards({"rm": 1.0}, terms) == [0.25, -2.0, 3.5]
    with pytest.raises(ValueError, match=r"no values for reward term\(s\) \['countdown'\]"):
        combine_rewards({"countdown": 1.0}, terms)


def test_a_grpo_step_scores_with_the_reward_model_and_logs_it(rm_dir, tmp_path):
    torch.set_num_threads(1)
    weights = {"math": 1.0, "rm": 0.5, "exact": 0.25}
    trainer = _run(tmp_path, reward_model=rm_dir, reward_weights=weights)
    metrics = trainer.step()
    samples = trainer.last_rollout.samples
    rm = RewardModel(rm_dir)  # scored again, independently of the loop
    rm_scores = rm.score([s.prompt for s in samples], [s.response for s in samples])
    for s, score in zip(samples, rm_scores):
        rule = math_reward(s.response, s.label)
        assert s.metadata["rule_reward"] == rule and s.metadata["rm_version"] == rm.version
        assert s.metadata["rm_score"] == pytest.approx(score, abs=1e-6)
        assert s.reward == 1.0 * rule + 0.5 * s.metadata["rm_score"] + 0.25 * exact_reward(s.response, s.label)
    n = len(samples)
    assert metrics["rollout/rm_score"] == pytest.approx(sum(rm_scores) / n, abs=1e-6)
    assert metrics["rollout/rule_reward"] == pytest.approx(sum(s.metadata["rule_reward"] for s in samples) / n)
    assert metrics["rollout/raw_reward"] == pytest.approx(sum(s.reward for s in samples) / n, abs=1e-6)
    assert metrics["rollout/rm_version"] == rm.version_id and metrics["perf/rm_time"] > 0
    assert len({s.reward for s in samples}) > 2 and metrics["train/grad_norm"] > 0  # the RM's scores moved it
    trainer.close()


def test_the_reward_model_alone_and_rule_only_runs(rm_dir, tmp_path):
    torch.set_num_threads(1)
    alone = _run(tmp_path / "alone", reward_model=rm_dir)  # no weights: the RM's score is the reward
    m = alone.step()
    assert all(s.reward == s.metadata["rm_score"] for s in alone.last_rollout.samples)
    assert "rollout/rule_reward" in m and m["rollout/raw_reward"] == pytest.approx(m["rollout/rm_score"], abs=1e-6)
    alone.close()
    rule = _run(tmp_path / "rule")
    m = rule.step()
    assert not [k for k in m if "rm_" in k or "rule_reward" in k]  # a rule-only run logs what it always did
    assert all("rule_reward" not in s.metadata for s in rule.last_rollout.samples)
    rule.close()


def test_reward_weights_and_reward_model_flags(rm_dir, tmp_path):
    args = build_parser().parse_args(["train", "--preset", "cpu_test", "--reward-model", rm_dir,
                                      "--reward-weights", "math:1,rm:0.5", "--run-dir", str(tmp_path)])
    check_paths(args)
    cfg = preset_config(args, model="tiny")
    assert (cfg.rollout.reward_model, cfg.rollout.reward_weights) == (rm_dir, {"math": 1.0, "rm": 0.5})
    json_args = build_parser().parse_args(["train", "--reward-weights", '{"exact": 2}'])
    assert json_args.reward_weights == {"exact": 2}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--reward-weights", "math"])
    bad = build_parser().parse_args(["train", "--reward-model", str(tmp_path)])
    with pytest.raises(ValueError, match="has no config.json"):
        check_paths(bad)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rm_type": "rm:runs/rm"}, r"--reward-model runs/rm\) and weigh it"),
    ({"reward_weights": {"math": 1, "rm": 0.5}}, "weighs 'rm' but no reward_model is set"),
    ({"reward_model": "runs/rm", "reward_weights": {"math": 1}}, "has no 'rm' term"),
    ({"reward_weights": {"mth": 1}}, "reward_weights name 'mth'.*did you mean 'math'"),
    ({"reward_weights": {"math": float("inf")}}, "must be a finite number"),
    ({"reward_weights": {}}, "non-empty dict"),
    ({"reward_model": "runs/rm", "reward_model_device": "gpu"}, "reward_model_device='gpu'"),
])
def test_reward_mix_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_the_manager_refuses_a_config_without_its_reward_model(rm_dir, tmp_path):
    from rlbench.rollout.manager import RolloutManager

    cfg = RolloutConfig(reward_model=rm_dir)
    with pytest.raises(ValueError, match="was given no reward model"):
        RolloutManager(cfg, engine=type("E", (), {"generate": lambda self, p, s, seeds=None: []})(), dataset=None,
                       tokenizer=type("T", (), {"eos_token_id": 1})())
