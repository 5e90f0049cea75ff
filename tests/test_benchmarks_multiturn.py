"""benchmarks/multiturn_speed.py on CPU: both variants generate the same tokens, and the multi-turn one prefills
each prompt once and per continuation only the last sampled token and the observation."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "multiturn_speed.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("multiturn_speed_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_run_counts_tokens_and_prefill(bench, tmp_path, capsys):
    out = tmp_path / "mt.json"
    # 2 prompts x n=2, P=8, K=3 turns of T=4, O=3
    result = bench.main(["--device", "cpu", "--batch", "4", "--n", "2", "--prompt-len", "8", "--turns", "3",
                         "--turn-tokens", "4", "--obs-tokens", "3", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    single, multi = result["rows"]["single_turn"], result["rows"]["multi_turn"]
    assert single["generated_tokens"] == multi["generated_tokens"] == 4 * 3 * 4
    assert single["prefill_tokens"] == single["expected_prefill_tokens"] == 2 * 8  # each prompt once
    assert multi["prefill_tokens"] == multi["expected_prefill_tokens"] == 2 * 8 + 4 * (3 - 1) * (3 + 1)
    assert len(multi["turn_walls_s"]) == 3 and len(single["turn_walls_s"]) == 1 and len(multi["walls_s"]) == 2
    assert multi["wall_s"] == pytest.approx(sum(multi["turn_walls_s"]))  # 2 repeats: median = mean, both ways
    assert result["ratio"] == pytest.approx(multi["tokens_per_s"] / single["tokens_per_s"])
    assert single["tokens_per_s"] == pytest.approx(48 / single["wall_s"])
    assert result["num_slots"] == 4 and result["engine"]["shared_prefix"] is True
    text = capsys.readouterr().out
    assert "| prefill tokens (expected) | 16 (16) | 48 (48) |" in text and "| tokens/s multi / single |" in text


def test_bad_batch_is_clear(bench):
    with pytest.raises(ValueError, match=r"--batch 6 must be a positive multiple of --n 4"):
        bench.Shape(batch=6, n=4, prompt_len=8, turns=2, turn_tokens=4, obs_tokens=2)
