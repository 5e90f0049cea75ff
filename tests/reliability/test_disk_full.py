"""A full disk (ENOSPC) at every write of `Trainer.save`: the error names the path, nothing of the failed save
is committed or left behind, and the previous checkpoint still loads bit-exactly."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from rlbench import Trainer
from rlbench.backends.checkpoint import TRACKER, NotDurableError, save_synced

from ._faults import assert_same, durability_log, file_size_limit, state, tiny_config, write_faults


def _saved_after_one_step(tmp_path):
    """A trainer one step in, saved to `tmp_path/ckpt`: (trainer, checkpoint dir, its state at the save)."""
    torch.set_num_threads(1)
    ckpt = str(tmp_path / "ckpt")
    trainer = Trainer(tiny_config(str(tmp_path)))
    trainer.step()
    trainer.save(ckpt)
    return trainer, ckpt, state(trainer)


def _assert_nothing_committed(trainer, ckpt, err, saved, after, errno_=errno.ENOSPC) -> None:
    assert isinstance(err, OSError) and err.errno == errno_, repr(err)
    assert ckpt in str(err) and "iter_" in str(err), str(err)
    assert not [d for d in os.listdir(ckpt) if d.endswith((".tmp", ".old"))], os.listdir(ckpt)
    with open(os.path.join(ckpt, TRACKER)) as f:
        assert int(f.read()) == saved["counters"][4]  # the tracker still names the previous checkpoint
    assert state(trainer)["counters"] == after["counters"]  # a failed save changes nothing in memory


def test_enospc_at_every_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """ENOSPC where a full disk raises it: at write(2) of a file (every checkpoint file is written through a
    Python file object, so it is an OSError, not torch's `[enforce fail at inline_container.cc]`), and at fsync."""
    trainer, ckpt, saved = _saved_after_one_step(tmp_path)
    trainer.step()  # the save that fails would hold this step
    after = state(trainer)
    count = str(tmp_path / "count")
    with write_faults(count) as seen:  # how many write calls one save makes, and into which files
        trainer.save(count)
    final = os.path.join(count, f"iter_{after['counters'][4]:07d}")
    files = {os.path.join(d, f) for d, _, fs in os.walk(final) for f in fs}
    assert {"loop_state.pt", "trainer_state.pt", "rng_rank0.pt"} <= {os.path.basename(f) for f in files}
    # every file of the checkpoint went through a Python file object (none through torch's C++ path writer);
    # DCP writes `.metadata` as `.metadata.tmp`, then renames it
    via_path = [f for f in files if not {(w := f.replace(final, final + ".tmp")), w + ".tmp"} & seen["files"]]
    assert via_path == []
    n = seen["writes"]
    points = sorted({*range(1, n + 1, max(1, n // 24)), n - 2, n - 1, n})
    fsyncs = [0]
    real_fsync = os.fsync

    def counting_fsync(fd):
        fsyncs[0] += 1
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    trainer.save(count)
    monkeypatch.setattr(os, "fsync", real_fsync)
    for k in points:
        with pytest.raises(OSError) as err, write_faults(ckpt, fail_at=k):
            trainer.save(ckpt)
        assert "No space left on device" in str(err.value) and "free space" in str(err.value), str(err.value)
        _assert_nothing_committed(trainer, ckpt, err.value, saved, after)
    for k in range(1, fsyncs[0] + 1):  # every fsync of the save: DCP's, each file's, the tree's, the root's
        calls = [0]

        def full_fsync(fd, k=k, calls=calls):
            calls[0] += 1
            if calls[0] == k:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", full_fsync)
        with pytest.raises(OSError) as err:
            trainer.save(ckpt)
        monkeypatch.setattr(os, "fsync", real_fsync)
        if k < fsyncs[0]:
            _assert_nothing_committed(trainer, ckpt, err.value, saved, after)
    assert len(points) >= 24 and fsyncs[0] >= 10
    # the last fsync (the root's, after the tracker named the new checkpoint): committed, and the error says so
    assert isinstance(err.value, NotDurableError) and "was committed" in str(err.value), str(err.value)
    assert trainer.load(ckpt, rollout_id=1) == 1
    assert_same(state(trainer), saved)  # the previous checkpoint, bit for bit
    assert trainer.load(ckpt) == 2
    assert_same(state(trainer), after)


def test_a_write_failing_in_the_kernel_is_an_oserror_naming_the_path(tmp_path):
    """A real failing write(2) (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC), not a faked exception: torch's
    path writer turns it into `[enforce fail at inline_container.cc]`; `save_synced` raises an OSError naming the
    file; `Trainer.save` an OSError naming the checkpoint, and the previous one stays the latest."""
    trainer, ckpt, saved = _saved_after_one_step(tmp_path)
    trainer.step()
    after = state(trainer)
    big = {"x": torch.zeros(1 << 16)}  # 256 KiB
    with file_size_limit(64 << 10):
        with pytest.raises(RuntimeError, match="inline_container"):  # why save_synced exists
            torch.save(big, str(tmp_path / "by_path.pt"))
        with pytest.raises(OSError) as direct:
            save_synced(big, str(tmp_path / "by_file.pt"))
        with pytest.raises(OSError) as err:
            trainer.save(ckpt)
    assert direct.value.errno == errno.EFBIG and direct.value.filename == str(tmp_path / "by_file.pt")
    assert "File too large" in str(direct.value)
    _assert_nothing_committed(trainer, ckpt, err.value, saved, after, errno_=errno.EFBIG)
    assert trainer.load(ckpt) == 1
    assert_same(state(trainer), saved)


def test_a_power_cut_cannot_lose_the_checkpoint_the_tracker_names(tmp_path):
    """What a power cut keeps is what was fsynced: every file and directory of the new checkpoint, and the rename
    that publishes it, are fsynced before the tracker names it; the tracker's own entry after."""
    trainer, ckpt, saved = _saved_after_one_step(tmp_path)
    trainer.step()
    with durability_log() as events:
        trainer.save(ckpt)
    final = os.path.join(os.path.abspath(ckpt), f"iter_{trainer.backend.step:07d}")
    tmp, root, tracker = final + ".tmp", os.path.dirname(final), os.path.join(os.path.dirname(final), TRACKER)
    published = events.index(("rename", tmp, final))
    named = events.index(("rename", tracker + ".tmp", tracker))
    synced = {e[1]: i for i, e in enumerate(events) if e[0] == "fsync" and i < published}  # last fsync of each
    unsynced = []
    for dirpath, _, files in os.walk(final):
        at = dirpath.replace(final, tmp)
        entries = [synced.get(os.path.join(at, f), -1) for f in files]
        unsynced += [os.path.join(dirpath, f) for f, i in zip(files, entries) if i < 0]
        if synced.get(at, -1) < max(entries, default=0):  # the directory after its files were created
            unsynced.append(dirpath)
    assert unsynced == [], f"not fsynced before the checkpoint was published: {unsynced}"
    assert ("fsync", tracker + ".tmp") in events[:named]
    assert ("fsync", root) in events[published:named]  # the rename is durable before the tracker names it
    assert ("fsync", root) in events[named:]  # and the tracker's new entry
    assert trainer.load(ckpt) == 2


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
