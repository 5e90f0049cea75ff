"""Resuming with a different config (issue 24, item 4): a different model is refused before DCP reads anything,
naming each differing field; changed optimizer hyper-parameters follow the rule "the new config wins" (announced
in one line); `--load` past `num_rollout` says so. The checkpoint is never modified."""

from __future__ import annotations

import dataclasses as dc
import hashlib
import os
import warnings

import pytest
import torch

from rlbench import Trainer
from rlbench.backends.optim import lr_at
from rlbench.backends.resume import ResumeError

from ._small import small_cfg


def _digest(root) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run trained for one rollout and saved; returns (cfg, checkpoint dir, saved optimizer state)."""
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("resume")
    cfg = small_cfg(work, optim=dc.replace(small_cfg(work).backend.optim, lr_schedule="linear", decay_steps=10,
                                           min_lr=1e-5))
    trainer = Trainer(cfg)
    trainer.step()
    ckpt = str(work / "ckpt")
    trainer.save(ckpt)
    state = {k: v.clone() for k, v in trainer.backend.optimizer.state_dict()["state"][0].items()}
    trainer.close()
    return cfg, ckpt, state


def _resume(cfg, ckpt, **backend_changes):
    cfg = cfg.replace(backend=dc.replace(cfg.backend, **backend_changes),
                      checkpoint=dc.replace(cfg.checkpoint, load_dir=ckpt))
    return Trainer(cfg)


def test_more_layers_in_the_checkpoint_is_refused_naming_the_field(saved):
    cfg, ckpt, _ = saved
    before = _digest(ckpt)
    with pytest.raises(ResumeError) as info:
        _resume(cfg, ckpt, model_overrides={"num_hidden_layers": 1})
    msg = str(info.value)
    assert "num_hidden_layers: checkpoint 2, now 1" in msg and "model='tiny'" in msg
    assert "without --load" in msg and "checkpoint is unchanged" in msg
    assert _digest(ckpt) == before  # nothing lost: the checkpoint is untouched


def test_a_shape_change_is_a_clear_error_not_a_dcp_exception(saved, tmp_path):
    cfg, ckpt, _ = saved
    with pytest.raises(ResumeError, match=r"intermediate_size: checkpoint 128, now 96"):
        _resume(cfg, ckpt, model_overrides={"intermediate_size": 96})
    # An older checkpoint without the stored model config: the DCP metadata check still names the shapes.
    import shutil

    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    for dirpath, _, files in os.walk(old):
        if "trainer_state.pt" in files:
            p = os.path.join(dirpath, "trainer_state.pt")
            meta = torch.load(p, weights_only=False)
            meta.pop("model_config")
            torch.save(meta, p)
    with pytest.raises(ResumeError, match=r"parameters do not match this model: .*mlp.*checkpoint \[128, 64\], now \[96, 64\]"):
        _resume(cfg, str(old), model_overrides={"intermediate_size": 96})


def test_changed_optimizer_hyperparameters_the_new_config_wins(saved):
    cfg, ckpt, state = saved
    new = dc.replace(cfg.backend.optim, lr=1e-4, weight_decay=0.1, betas=(0.8, 0.9), decay_steps=20)
    with pytest.warns(UserWarning, match=r"the new config wins for optim lr 0.0002 -> 0.0001, weight_decay 0 -> 0.1, "
                                         r"betas \(0.9, 0.98\) -> \(0.8, 0.9\), decay_steps 10 -> 20"):
        trainer = _resume(cfg, ckpt, optim=new)
    opt, sched = trainer.backend.optimizer, trainer.backend.scheduler
    step = trainer.backend.step
    for g in opt.param_groups:
        assert (g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) == (lr_at(step, new), 0.1, (0.8, 0.9), 1e-4)
    assert sched.base_lrs == [1e-4] and sched.get_last_lr() == [lr_at(step, new)]
    restored = opt.state_dict()["state"][0]
    assert all(torch.equal(restored[k], v) for k, v in state.items())  # AdamW moments and step restored bitwise
    trainer.step()  # the next schedule step uses the new schedule and base lr
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step + 2, new), rel=1e-12)


def test_load_past_num_rollout_says_so_and_unchanged_config_is_silent(saved):
    cfg, ckpt, _ = saved
    cfg = cfg.replace(batch=dc.replace(cfg.batch, num_rollout=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _resume(cfg, ckpt)
        history = trainer.fit()
    messages = [str(w.message) for w in caught]
    assert not any("new config wins" in m for m in messages)  # same config: nothing announced, nothing changed
    assert any("nothing to train: the run is at rollout 1" in m and "raise num_rollout (--num-rollout) above 1" in m
               for m in messages), messages
    assert len(history) == 1 and trainer.rollout_id == 1
