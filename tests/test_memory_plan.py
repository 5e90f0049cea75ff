"""The colocated memory plan as measured: the micro-batch estimate's formula, the offload decision on measured
numbers, and the plan a CPU Trainer reports (tensor bytes of both sides, no offload). The start-up plan's
decisions on synthetic devices: tests/test_memory_start.py."""

from __future__ import annotations

import dataclasses as dc
from types import SimpleNamespace

import pytest
import torch

from rlbench import presets
from rlbench.memory_plan import GIB, MARGIN, RESERVE, MemoryPlan, micro_batch_bytes, tensor_bytes

QWEN3_0P6B = SimpleNamespace(hidden_size=1024, num_attention_heads=16, head_dim=128, num_key_value_heads=8,
                             num_hidden_layers=28, intermediate_size=3072, vocab_size=151936)


def test_micro_batch_estimate_by_hand():
    tokens = 16384
    per_layer = 2 * (6 * 1024 + 2 * 8 * 128 + 4 * 3072)  # bf16 bytes per token and layer
    no_ac = micro_batch_bytes(QWEN3_0P6B, tokens, checkpointing=False)
    ac = micro_batch_bytes(QWEN3_0P6B, tokens, checkpointing=True)
    assert no_ac["activations"] == tokens * 28 * per_layer
    assert ac["activations"] == tokens * (28 * 2 * 1024 + per_layer)
    assert no_ac["logits"] == ac["logits"] == 2 * tokens * 151936 * 2
    assert 17 < no_ac["activations"] / GIB < 18 and ac["activations"] / GIB < 2
    # every 2nd layer recomputed: 14 keep their input, 14 their whole worth, plus one layer's recompute
    half = micro_batch_bytes(QWEN3_0P6B, tokens, checkpointing=True, checkpoint_every=2)
    assert half["activations"] == tokens * (14 * 2 * 1024 + 14 * per_layer + per_layer)
    # the lm-head runs on the response rows only
    assert micro_batch_bytes(QWEN3_0P6B, tokens, checkpointing=True, logit_rows=100)["logits"] == 2 * 100 * 151936 * 2


def _plan(free, grads, activations, logits):
    return MemoryPlan("cuda", 140 * GIB, free, 10 * GIB, GIB, 20 * GIB, 64, 16384, False, grads, activations,
                      logits, True, "")


@pytest.mark.parametrize("free_gib, offload", [(64, False), (20, True)])
def test_offload_decision_follows_the_free_memory(monkeypatch, free_gib, offload):
    """memory_plan with stand-in parts: offload only when the free memory less RESERVE does not cover the gradients
    plus MARGIN x the micro-batch's activations and logits."""
    from rlbench import memory_plan as mp

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * GIB, 140 * GIB))
    model = torch.nn.Linear(4, 4)
    backend = SimpleNamespace(model=model, state_tensors=lambda: list(model.parameters()), hf_config=QWEN3_0P6B)
    cache = SimpleNamespace(k=[torch.zeros(8)], v=[torch.zeros(8)], shape=SimpleNamespace(num_slots=3))
    engine = SimpleNamespace(model=torch.nn.Linear(4, 4), cache=cache)
    cfg = presets.cpu_test(model="tiny")
    cfg = cfg.replace(batch=dc.replace(cfg.batch, use_dynamic_batch_size=True, max_tokens_per_gpu=16384))
    plan = mp.memory_plan(backend, engine, cfg, torch.device("cuda"))
    need = plan.grads + MARGIN * (plan.activations + plan.logits)
    assert plan.need == int(need) and 30 * GIB < need < 40 * GIB  # 17.5 GiB activations + 9.3 GiB logits, x 1.25
    assert (free_gib * GIB - RESERVE >= need) == (not offload)
    assert plan.offload is offload and plan.tokens == 16384 and plan.kv_cache == 64 and plan.kv_slots == 3
    assert ("offload " + ("on" if offload else "off")) in plan.summary()
    assert plan.metrics()["memory/plan_offload"] == float(offload)


def test_cpu_trainer_reports_its_plan(tmp_path):
    torch.set_num_threads(1)
    from rlbench import Trainer

    t = Trainer(presets.cpu_test(model="tiny", workdir=str(tmp_path)))
    plan = t.memory_plan
    assert plan.device == "cpu" and plan.offload is False and t.offload is False
    params = tensor_bytes(t.backend.model.parameters())
    assert plan.grads == params and plan.trainer_state >= 3 * params  # params + Adam's two moments
    assert plan.engine_weights == tensor_bytes(t.engine.model.parameters()) > 0
    assert plan.kv_cache == tensor_bytes([*t.engine.cache.k, *t.engine.cache.v]) > 0
    assert "free ?" in plan.summary()
    # on the CPU the start-up plan decides nothing: the open knobs take their old defaults
    assert t.start_plan.choice is None and t.start_plan.memory is None
    assert t.cfg.backend.fsdp.gradient_checkpointing is False and t.cfg.backend.fsdp.cpu_offload is False
    assert t.cfg.batch == presets.cpu_test(model="tiny", workdir=str(tmp_path)).batch


def test_no_plan_for_an_engine_without_a_torch_cache():
    """An SGLang engine manages its own memory: no plan, and the Trainer falls back to offload on CUDA."""
    from rlbench.memory_plan import memory_plan

    backend = SimpleNamespace(model=torch.nn.Linear(4, 4), optimizer=None, hf_config=QWEN3_0P6B)
    assert memory_plan(backend, SimpleNamespace(), presets.cpu_test(model="tiny"), torch.device("cpu")) is None


def test_offload_time_is_its_own_metric(tmp_path):
    """With offload on, the sleep / wake_up turns of a step are timed as `perf/offload_time`, apart from the
    phases (they were hidden in the step time); without offload there is no such metric."""
    torch.set_num_threads(1)
    from rlbench import Trainer

    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path))
    m = Trainer(cfg.replace(offload=True)).step()
    phases = sum(m.get(f"perf/{k}_time", 0.0) for k in ("rollout", "log_probs", "train", "update_weights"))
    assert 0.0 < m["perf/offload_time"] <= m["perf/step_time"] - phases
    assert "perf/offload_time" not in Trainer(cfg.replace(offload=False)).step()
