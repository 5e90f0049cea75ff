"""Child process of test_kill_during_save: trains the tiny run and saves over and over until killed."""

from __future__ import annotations

import sys

import torch

from reliability._faults import tiny_config
from rlbench import Trainer

if __name__ == "__main__":
    workdir, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    trainer = Trainer(tiny_config(workdir))
    while True:  # until killed: train `steps` steps, then keep re-saving the last one (the iter_N.old path)
        if trainer.rollout_id < steps:
            trainer.step()
        for _ in range(2):
            trainer.save(ckpt)
            print("saved", trainer.rollout_id, flush=True)
