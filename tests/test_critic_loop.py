"""The PPO loop on the tiny model: the critic warm-up (`num_critic_only_steps`) trains the critic alone, the
actor's weights, optimizer and policy version stay; the step after trains both, critic first."""

from __future__ import annotations

import dataclasses as dc

import pytest
import torch
from reliability._faults import tiny_config

from rlbench import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_critic_only_steps_leave_the_actor_alone(tmp_path):
    cfg = tiny_config(str(tmp_path), critic=True)
    cfg = cfg.replace(backend=dc.replace(cfg.backend, critic=dc.replace(cfg.backend.critic, num_critic_only_steps=1)))
    trainer = Trainer(cfg)
    actor = {n: p.full_tensor().clone() for n, p in trainer.backend.model.named_parameters()}
    critic = {n: p.full_tensor().clone() for n, p in trainer.backend.critic.model.named_parameters()}
    warm = trainer.step()
    assert warm["critic/step"] == 2.0 and warm["critic/grad_norm"] > 0 and not any(k.startswith("train/") for k in warm)
    assert trainer.policy_version == trainer.version == trainer.backend.step == 0
    assert all(torch.equal(p.full_tensor(), actor[n]) for n, p in trainer.backend.model.named_parameters())
    assert not any(torch.equal(p.full_tensor(), critic[n]) for n, p in trainer.backend.critic.model.named_parameters())
    both = trainer.step()
    assert both["critic/step"] == 4.0 and both["train/step"] == 2.0 and both["train/grad_norm"] > 0
    assert trainer.policy_version == trainer.version == 2
    assert both["rollout/weight_version"] == 0.0  # the second rollout was still sampled by the starting policy


def test_train_step_on_a_fresh_rollout_with_kl_in_reward(tmp_path):
    """The sub-steps a StepController's Rollout / Train buttons call: `train_step` on a scored rollout whose
    log-probs nobody computed runs the critic first, whose advantages need KL-in-reward's old and ref log-probs
    of every step."""
    cfg = tiny_config(str(tmp_path), critic=True, ref=True)
    assert cfg.loss.kl_coef != 0
    trainer = Trainer(cfg)
    batch = trainer.rollout()
    trainer.score(batch)
    metrics = trainer.train_step(batch)
    assert metrics["critic/grad_norm"] > 0 and metrics["train/grad_norm"] > 0
    assert all(o is not None for o in batch.old_log_probs) and batch.ref_log_probs is not None
