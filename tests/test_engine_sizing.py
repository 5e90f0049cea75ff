"""How the Trainer sizes its engine's KV cache (`orchestration.local.engine_config`): one slot per sample of a
rollout round on the CPU, at most that many on a GPU (the rest of the memory stays free for training)."""

from __future__ import annotations

import dataclasses

import torch

from rlbench import presets
from rlbench.orchestration.local import engine_config


def test_cpu_gets_one_slot_per_sample_of_a_round():
    cfg = presets.cpu_test(model="tiny")
    want = cfg.rollout.prompts_per_round * cfg.rollout.n_samples_per_prompt
    assert engine_config(cfg, torch.device("cpu")).num_slots == want


def test_gpu_sizes_from_memory_but_at_most_a_round():
    cfg = presets.qwen3_0p6b_gpu(model="qwen3-0.6b-shape", workdir="/tmp/rlbench-test-sizing")
    got = engine_config(cfg, torch.device("cuda"))
    assert got.num_slots is None  # still sized from free memory (mem_fraction)
    assert got.max_slots == 32 * 8 < cfg.engine.max_slots
    small = cfg.replace(engine=dataclasses.replace(cfg.engine, max_slots=100))
    assert engine_config(small, torch.device("cuda")).max_slots == 100


def test_explicit_num_slots_is_kept():
    cfg = presets.cpu_test(model="tiny")
    cfg = cfg.replace(engine=dataclasses.replace(cfg.engine, num_slots=5))
    assert engine_config(cfg, torch.device("cpu")).num_slots == 5
    assert engine_config(cfg, torch.device("cuda")).num_slots == 5
