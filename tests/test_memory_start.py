"""The start-up memory plan (`rlbench.memory_start`) on synthetic devices, from the config alone (no weights):
the sizes by hand, which knobs it picks at the 0.6B and 4B shapes on 80 GB (H100), 141 GB (H200) and 24 GB
devices with slime-like flags, that the user's flags are kept, the refusal text when nothing fits, the CPU
(nothing planned), the check against the measured plan, and the CLI's tri-state flag."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest

from rlbench.backends.hf_weights import model_config
from rlbench.configs import (
    BatchConfig,
    DataConfig,
    FSDPOptions,
    LoggingConfig,
    RolloutConfig,
    RunConfig,
    TorchEngineConfig,
    TrainConfig,
)
from rlbench.memory_plan import GIB, MARGIN, RESERVE
from rlbench.memory_start import DeviceMemory, measured_gap, parameter_counts, plan_at_start

CONTEXT = GIB // 2
"""What a CUDA context takes before anything is built (free = total - this)."""
H100 = DeviceMemory(int(79.2 * GIB), int(79.2 * GIB) - CONTEXT)  # "80 GB"
H200 = DeviceMemory(int(139.8 * GIB), int(139.8 * GIB) - CONTEXT)  # "141 GB"
GPU24 = DeviceMemory(int(23.6 * GIB), int(23.6 * GIB) - CONTEXT)  # "24 GB"
SMALL, BIG = "qwen3-0.6b-shape", "qwen3-4b-shape"
PROMPT = 512
"""slime-like flags: 8 prompts x 8 samples of 512 prompt + 256 response tokens, --max-tokens-per-gpu 16384."""


def slime(model: str, offload=None, num_slots=None, max_tokens=16384, **fsdp) -> RunConfig:
    return RunConfig(
        data=DataConfig(path="prompts.jsonl"), backend=TrainConfig(model=model, device="cuda", fsdp=FSDPOptions(**fsdp)),
        rollout=RolloutConfig(rollout_batch_size=8, n_samples_per_prompt=8, max_response_len=256),
        batch=BatchConfig(global_batch_size=64, use_dynamic_batch_size=True, max_tokens_per_gpu=max_tokens),
        engine=TorchEngineConfig(max_seq_len=PROMPT + 256, num_slots=num_slots), offload=offload,
        logging=LoggingConfig(console=False))


def plan(model: str, device: DeviceMemory, **flags):
    return plan_at_start(slime(model, **flags), model_config(model), device, shortest_prompt=PROMPT)


def knobs(p) -> tuple:
    c = p.choice
    return c.checkpointing, c.tokens, c.turns, c.cpu_offload


def test_sizes_by_hand_at_4b():
    """Qwen3-4B: embeddings 151936 x 2560 (tied), 36 layers of q 2560x4096, k/v 2560x1024, o 4096x2560, MLP
    3 x 2560x9728, norms."""
    layer = 2560 * 4096 * 2 + 2560 * 1024 * 2 + 3 * 2560 * 9728 + 2 * 128 + 2 * 2560
    n = 151936 * 2560 + 36 * layer + 2560
    assert parameter_counts(model_config(BIG)) == (n, layer, 36) and n == 4_022_468_096
    s = plan(BIG, H200).sizes
    assert s["state"] == 12 * n and s["grads"] == 4 * n and s["engine_weights"] == 2 * n  # fp32 + AdamW; bf16 copy
    assert s["kv_slots"] == 64 and s["kv_cache"] == 64 * 2 * 36 * 8 * 128 * (768 + 16) * 2  # K and V, KV_PAD 16
    assert s["gathered"] == 2 * (n - 36 * layer + 2 * layer)  # the root (embeddings) + two layers, bf16


# (model, device) -> (activation checkpointing, micro-batch tokens, offload turns, FSDP CPU offload)
PICKS = [
    (SMALL, H100, (False, 16384, False, False)),  # everything fits: the defaults, nothing to pay
    (SMALL, H200, (False, 16384, False, False)),
    (SMALL, GPU24, (False, 2048, False, False)),  # a smaller budget is cheaper than AC
    (BIG, H100, (True, 2048, False, False)),  # AC and a 2048 budget: no offload turns on 80 GB
    (BIG, H200, (False, 8192, False, False)),  # 141 GB: no AC at half the cap
    (BIG, GPU24, (True, 8192, False, True)),  # the 45 GiB trainer state only fits in host memory
]


@pytest.mark.parametrize("model, device, expected", PICKS, ids=[f"{m}-{d.total // GIB}G" for m, d, _ in PICKS])
def test_picks_the_cheapest_setting_that_fits(model, device, expected):
    p = plan(model, device)
    assert knobs(p) == expected
    usable = device.free - RESERVE
    assert p.need["total"] <= usable and p.need["total"] == sum(v for k, v in p.need.items() if k != "total")
    # the config the backend, engine and Trainer are built from carries the decisions
    c = p.config
    assert (c.backend.fsdp.gradient_checkpointing, c.batch.max_tokens_per_gpu, c.offload,
            c.backend.fsdp.cpu_offload) == expected
    assert c.engine.num_slots == 64  # the rollout's live samples: 8 prompts x 8
    # one line of sizes, then one per decision; each knob turned on names the cheaper setting that did not fit
    lines = p.lines()
    assert len(lines) == 6 and lines[0].startswith("memory plan (cuda, ") and "64 slots" in lines[1]
    for line in lines[2:]:
        if " on: without it" in line or "under --max-tokens-per-gpu" in line:
            need, left = map(float, re.search(r"~([\d.]+) GiB of ([\d.]+) usable", line).groups())
            assert need > left == round(usable / GIB, 1)
    # the response rows bound the logits: 256 of 768 tokens
    assert p.logit_share == 256 / 768 and p.need["logits"] == int(MARGIN * 2 * round(expected[1] / 3) * 151936 * 2)


def test_user_flags_are_kept():
    # AC forced off at 4B on 80 GB: the plan works around it (a smaller budget, offload turns), never turns it on
    p = plan(BIG, H100, gradient_checkpointing=False)
    assert knobs(p) == (False, 1024, True, False)
    assert "activation checkpointing off (given: --no-gradient-checkpointing)" in p.lines()[2]
    # AC and offload forced on where neither is needed
    p = plan(SMALL, H100, gradient_checkpointing=True, offload=True)
    assert knobs(p) == (True, 16384, True, False)
    assert any("offload turns (engine and trainer take turns) on (given: --offload)" in line for line in p.lines())
    # the user's KV slots and token cap
    p = plan(SMALL, H200, num_slots=16, max_tokens=4096)
    assert p.config.engine.num_slots == p.sizes["kv_slots"] == 16 and knobs(p) == (False, 4096, False, False)
    assert not any("live samples" in line for line in p.lines())
    # the brief's 24 GB case with AC forced off still fits: host-memory state, turns, 2048 tokens
    assert knobs(plan(BIG, GPU24, gradient_checkpointing=False)) == (False, 2048, True, True)


REFUSALS = [
    (BIG, GPU24, dict(cpu_offload=False),
     "--no-fsdp-cpu-offload: nothing fits on this GPU (23.6 GiB, 23.1 free, 21.1 usable): even a micro-batch of 768 "
     "tokens (AC, offload turns) needs ~69.0 GiB; use --fsdp-cpu-offload (then a micro-batch of 8192 tokens (AC, "
     "FSDP CPU offload) fits in ~20.2 GiB)"),
    (BIG, GPU24, dict(cpu_offload=False, gradient_checkpointing=False),
     "--no-gradient-checkpointing --no-fsdp-cpu-offload: nothing fits on this GPU (23.6 GiB, 23.1 free, 21.1 usable): "
     "even a micro-batch of 768 tokens (no AC, offload turns) needs ~72.3 GiB; use --fsdp-cpu-offload (then a "
     "micro-batch of 2048 tokens (no AC, offload turns, FSDP CPU offload) fits in ~18.7 GiB)"),
    (BIG, H100, dict(cpu_offload=False, gradient_checkpointing=False, offload=False),
     "--no-gradient-checkpointing --no-offload --no-fsdp-cpu-offload: nothing fits on this GPU (79.2 GiB, 78.7 free, "
     "76.7 usable): even a micro-batch of 768 tokens (no AC) needs ~79.2 GiB; use --gradient-checkpointing (then a "
     "micro-batch of 2048 tokens (AC) fits in ~76.6 GiB) or --offload (then a micro-batch of 1024 tokens (no AC, "
     "offload turns) fits in ~73.6 GiB) or --fsdp-cpu-offload (then a micro-batch of 8192 tokens (no AC, FSDP CPU "
     "offload) fits in ~56.1 GiB)"),
]


@pytest.mark.parametrize("model, device, flags, text", REFUSALS)
def test_refusal_names_the_flags_and_the_numbers(model, device, flags, text):
    with pytest.raises(ValueError) as err:
        plan(model, device, **flags)
    assert str(err.value) == text


def test_refusal_when_nothing_fits_at_all():
    tiny_gpu = DeviceMemory(8 * GIB, 8 * GIB - CONTEXT)  # the engine's bf16 copy of 4B alone is 7.5 GiB
    with pytest.raises(ValueError, match=r"^nothing fits on this GPU .* with every memory option allowed: the trainer "
                                         r"state alone is 45.0 GiB. Use more GPUs"):
        plan(BIG, tiny_gpu)


def test_more_ranks_shard_the_state():
    one, four = (plan_at_start(slime(BIG), model_config(BIG), H100, shortest_prompt=PROMPT, world=w) for w in (1, 4))
    assert four.sizes["state"] == one.sizes["state"] // 4
    assert four.sizes["grads"] == one.sizes["grads"]  # unsharded while no_sync_accumulation accumulates
    assert knobs(four) == (False, 4096, False, False)


def test_cpu_plans_nothing():
    cfg = slime(BIG).replace(backend=TrainConfig(model=BIG, device="cpu", param_dtype="fp32"))
    p = plan_at_start(cfg, model_config(BIG), None)
    assert p.choice is None and p.lines() == ["memory plan (cpu): host memory, nothing planned"]
    c = p.config
    assert c.backend.fsdp.gradient_checkpointing is False and c.backend.fsdp.cpu_offload is False
    assert c.offload is None and c.batch == cfg.batch and c.engine == cfg.engine  # decided later, as before


def _measured(p, **changes):
    s = p.sizes
    m = dict(trainer_state=s["state"], engine_weights=s["engine_weights"], kv_cache=s["kv_cache"],
             free=p.memory.free - s["state"] - s["engine_weights"] - s["kv_cache"], offload=False, reason="fits")
    return SimpleNamespace(**(m | changes), summary=lambda: "measured")


def test_measured_gap_is_reported():
    p = plan(SMALL, H100)
    assert measured_gap(p, _measured(p)) is None
    assert measured_gap(p, _measured(p, trainer_state=p.sizes["state"] + GIB // 4)) is None  # within 1 GiB
    m = _measured(p, trainer_state=p.sizes["state"] + 5 * GIB, free=_measured(p).free - 8 * GIB)  # > 10 %
    line = measured_gap(p, m)
    assert line.startswith("measured trainer state 11.7 GiB (estimated 6.7)") and "free memory" in line


@pytest.mark.parametrize("left_open", [True, False])
def test_an_unsafe_decision_is_revised_only_when_the_plan_made_it(left_open):
    """Offload off, but the measured sizes say training does not fit: turned on (with a warning) only when the
    user left `offload` open; the user's --no-offload stands."""
    from rlbench.trainer import Trainer

    p = plan_at_start(slime(SMALL, offload=None if left_open else False), model_config(SMALL), H100,
                      shortest_prompt=PROMPT)
    trainer = SimpleNamespace(cfg=p.config, start_plan=p, memory_plan=_measured(p, offload=True, reason="too full"),
                              device=SimpleNamespace(type="cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Trainer._decide_offload(trainer) is left_open
    assert [str(w.message) for w in caught] == (["memory plan: offload turned on after all: too full"] if left_open
                                                else [])


@pytest.mark.parametrize("argv, value", [([], None), (["--gradient-checkpointing"], True),
                                         (["--no-gradient-checkpointing"], False)])
def test_gradient_checkpointing_flag_is_tri_state(argv, value):
    from rlbench.cli import build_parser, preset_config

    cfg = preset_config(build_parser().parse_args(["train", "--preset", "cpu_test", *argv]))
    assert cfg.backend.fsdp.gradient_checkpointing is value
