"""A full disk (ENOSPC) at every write of `Trainer.save`: the error names the path, nothing of the failed save
is committed or left behind, and the previous checkpoint still loads bit-exactly."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from rlbench import Trainer

from ._faults import assert_same, state, tiny_config


def _saved_after_one_step(tmp_path):
    """A trainer one step in, saved to `tmp_path/ckpt`: (trainer, checkpoint dir, its state at the save)."""
    torch.set_num_threads(1)
    ckpt = str(tmp_path / "ckpt")
    trainer = Trainer(tiny_config(str(tmp_path)))
    trainer.step()
    trainer.save(ckpt)
    return trainer, ckpt, state(trainer)


def test_enospc_at_every_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer, ckpt, saved = _saved_after_one_step(tmp_path)
    trainer.step()  # the save that fails would hold this step
    after = state(trainer)
    real_save, real_fsync = torch.save, os.fsync
    writes = [0]

    def counting(*args, **kwargs):
        writes[0] += 1
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    trainer.save(str(tmp_path / "count"))  # how many torch.save calls one save makes (DCP's included)
    monkeypatch.setattr(torch, "save", real_save)
    n = writes[0]
    assert n >= 4
    injected = 0
    points = [*range(0, n - 3, 4), n - 3, n - 2, n - 1, "fsync"]  # DCP's chunks (every 4th), RNG, scheduler, loop
    for k in points:  # state (the last 3 calls), the tracker's fsync
        calls = [0]

        def full(obj, f, *args, _k=k, calls=calls, **kwargs):
            calls[0] += 1
            if calls[0] == _k + 1:
                raise OSError(errno.ENOSPC, "No space left on device", f if isinstance(f, str) else None)
            return real_save(obj, f, *args, **kwargs)

        def full_fsync(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        if k == "fsync":
            monkeypatch.setattr(os, "fsync", full_fsync)
        else:
            monkeypatch.setattr(torch, "save", full)
        with pytest.raises(OSError) as err:
            trainer.save(ckpt)
        monkeypatch.setattr(torch, "save", real_save)
        monkeypatch.setattr(os, "fsync", real_fsync)
        injected += 1
        assert err.value.errno == errno.ENOSPC
        assert ckpt in str(err.value) and "iter_" in str(err.value), str(err.value)
        assert not [d for d in os.listdir(ckpt) if d.endswith((".tmp", ".old"))], os.listdir(ckpt)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            assert int(f.read()) == saved["counters"][4]  # the tracker still names the previous checkpoint
        assert state(trainer)["counters"] == after["counters"]  # a failed save changes nothing in memory
    assert injected == len(points)
    assert trainer.load(ckpt) == 1
    assert_same(state(trainer), saved)  # the previous checkpoint, bit for bit


def test_previous_layout_still_loads(tmp_path):
    """A checkpoint of the previous layout (`trainer_XXXXXXX.pt` beside the `iter_*` dirs) loads, by tracker and by
    rollout id; a missing rollout id is a clear error naming the directory."""
    trainer, ckpt, saved = _saved_after_one_step(tmp_path)
    step = saved["counters"][4]
    loop = os.path.join(ckpt, f"iter_{step:07d}", "loop_state.pt")  # rewrite it the old way
    torch.save(torch.load(loop, weights_only=False) | {"backend_step": step}, os.path.join(ckpt, "trainer_0000001.pt"))
    os.remove(loop)
    trainer.step()
    assert trainer.load(ckpt) == 1
    assert_same(state(trainer), saved)
    trainer.step()
    assert trainer.load(ckpt, rollout_id=1) == 1
    assert_same(state(trainer), saved)
    with pytest.raises(ValueError, match=r"has no committed checkpoint of rollout 5"):
        trainer.load(ckpt, rollout_id=5)
