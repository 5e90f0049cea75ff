"""End to end on CPU: PPO with a critic from the same SFT warm start and run shape as tests/test_e2e_grpo.py (tiny,
arithmetic level 1, 20 rollouts of 16 prompts x 8 samples): held-out pass@1 rises, and the critic learns.

Measured (2026-12-07, this config, seeds 0/1/2, fixed eval seed, start 0.316): PPO +0.062/+0.078/+0.066,
GRPO (test_e2e_grpo's config) +0.031/+0.039/+0.082 in the same samples; about 25 s per run on 2 cores.
"""

from __future__ import annotations

import dataclasses as dc

import pytest
from test_e2e_grpo import grpo_config

from rlbench import Trainer
from rlbench.configs import CriticConfig, LossConfig

pytestmark = pytest.mark.slow

PASS1_MARGIN = 0.03  # half the smallest measured gain


def ppo_config(sft: str, work: str, *, seed: int = 0):
    cfg = grpo_config(sft, work, seed=seed)
    return cfg.replace(loss=LossConfig(advantage_estimator="gae", normalize_advantages=True, lambd=0.95),
                       backend=dc.replace(cfg.backend, critic=CriticConfig(lr=1e-3)))


def test_ppo_with_a_critic_improves_held_out_pass_at_1(sft_dir, tmp_path):
    trainer = Trainer(ppo_config(sft_dir, str(tmp_path)))
    history = trainer.fit()
    start, end = trainer.eval_history[0], trainer.eval_history[-1]
    assert end["eval/pass@1"] - start["eval/pass@1"] >= PASS1_MARGIN, (start, end)
    vf = [h["critic/vf_loss"] for h in history]
    assert sum(vf[-5:]) / 5 < 0.8 * vf[0], vf  # the critic fits the returns better than at the start
    assert all(h["critic/step"] == 2 * (i + 1) for i, h in enumerate(history))  # 2 critic steps per rollout
