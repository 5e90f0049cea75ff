"""A full disk while `step()` appends its metrics line: the step is recorded once (rollout_id, history), the error
names the file and the step, and once space is back the metrics file holds every step exactly once, in order."""

from __future__ import annotations

import dataclasses as dc
import json

import pytest
import torch

from rlbench import Trainer
from rlbench.metrics import JsonlSink

from ._faults import FullDisk, comparable, tiny_config

STEPS = 3


def test_disk_full_in_the_metrics_file_records_the_step_once(tmp_path):
    torch.set_num_threads(1)
    cfg = tiny_config(str(tmp_path))
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(cfg.replace(logging=dc.replace(cfg.logging, jsonl_path=str(path))))
    start = str(tmp_path / "start")
    trainer.save(start)
    for _ in range(STEPS):
        trainer.step()
    reference = comparable(trainer.history)
    trainer.load(start)
    sink = JsonlSink(tmp_path / "faulted.jsonl")
    trainer.logger.sinks = [sink]
    trainer.step()
    sink.file = disk = FullDisk(sink.file)
    with pytest.raises(OSError, match=r"cannot append step 2 to the metrics file '.*faulted\.jsonl': No space left"):
        trainer.step()
    assert trainer.rollout_id == len(trainer.history) == 2  # recorded once, despite the failed line
    m = trainer.step()  # the disk is still full: finishes the step without recording it again
    assert trainer.rollout_id == len(trainer.history) == 2 and m is trainer.history[-1]
    disk.free()
    trainer.step()  # writes the pending line of step 2, then step 3
    assert comparable(trainer.history) == reference
    trainer.close()
    lines = [json.loads(line) for line in (tmp_path / "faulted.jsonl").read_text().splitlines()]
    assert [line.pop("step") for line in lines] == [1, 2, 3]  # no partial line, no duplicate
    assert comparable(lines) == reference
