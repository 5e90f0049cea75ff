"""`kill -9` at random points while a run saves checkpoints: the tracker's checkpoint always loads, resumes bit for
bit like the uninterrupted run, and the next save leaves no `.tmp` behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch

from rlbench import Trainer

from ._faults import assert_same, comparable, state, tiny_config

STEPS = 3
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kill_9_during_save_loses_nothing(tmp_path):
    torch.set_num_threads(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    children = [subprocess.Popen([sys.executable, "-m", "reliability._save_loop", str(tmp_path / f"child{i}"),
                                  str(tmp_path / f"ckpt{i}"), str(STEPS)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=env) for i in range(2)]
    try:
        _check_kills(tmp_path, children)
    finally:
        for child in children:
            child.kill()
            child.wait()


def _check_kills(tmp_path, children):
    trainer = Trainer(tiny_config(str(tmp_path / "ref")))  # the uninterrupted run, while the children start
    start = str(tmp_path / "start")
    trainer.save(start)
    for _ in range(STEPS):
        trainer.step()
    reference = state(trainer)
    rng = random.Random(int(time.time()))
    for trial, child in enumerate(children):
        ckpt = str(tmp_path / f"ckpt{trial}")
        assert child.stdout.readline().startswith("saved"), "the child never saved"
        delay = rng.uniform(0.0, 1.0)  # the child spends most of its time inside Trainer.save
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        trainer.load(start)
        rid = trainer.load(ckpt)  # the tracker's checkpoint
        assert 1 <= rid <= STEPS, (delay, rid)
        assert comparable(trainer.history) == reference["history"][:rid], delay
        trainer.save(ckpt)  # the next save removes whatever the kill left half-written
        assert not [d for d in os.listdir(ckpt) if d.endswith((".tmp", ".old"))], (delay, os.listdir(ckpt))
        while trainer.rollout_id < STEPS:
            trainer.step()
        assert_same(state(trainer), reference)  # resumed bit-exactly
