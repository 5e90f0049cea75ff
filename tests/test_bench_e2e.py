"""`rlbench bench e2e` (benchmarks/e2e.py) on CPU: a smoke run through the CLI, the table and JSON it writes,
the TRL switch when trl is missing, and the tokenizer both systems share."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from rlbench import cli

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "e2e.py")


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_phases_and_no_mfu_on_cpu(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--preset", "cpu-tiny", "--vocab-size", "128", "--prompts", "2", "--n", "2",
            "--prompt-len", "8", "--response-len", "4", "--steps", "1", "--threads", "1", "--no-trl",
            "--profile", "--out", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("rlbench bench e2e --preset cpu-tiny") and report["torch"]
    assert report["machine"].startswith("cpu") and report["peak_flops"] is None and report["trl"] is None
    assert list(report["rows"]) == ["rlbench"]
    row = report["rows"]["rlbench"]
    assert len(row["steps"]) == 2 and row["measured_steps"] == 1
    assert row["steady_step_s"] == row["steps"][1]["step_s"] > 0 and row["first_step_s"] == row["steps"][0]["step_s"]
    assert row["cold_extra_s"] == pytest.approx(row["first_step_s"] - row["steady_step_s"])
    for phase in ("rollout", "train", "sync"):
        assert row["phases_s"][phase] > 0, phase
    assert row["phases_s"]["log_probs"] >= 0  # 0 where the training forward supplies the old log-probs
    assert sum(row["phases_s"].values()) == pytest.approx(row["steady_step_s"])  # other = the rest of the step
    assert row["response_len"] == 4.0  # ignore_eos: every sample has the forced length
    assert row["tokens_per_step"] == 2 * 2 * (8 + 4)
    assert row["rollout_tokens_per_s"] == pytest.approx(2 * 2 * 4 / row["phases_s"]["rollout"])
    assert set(row["mfu"].values()) == {None} and row["peak_memory_gb"] is None
    assert row["profile"].startswith("train phase wall") and "aten::" in row["profile"]  # --profile
    assert "rollout phase wall" in row["profile"]
    assert len(row["steps"]) == 2  # the profiled step is not a measured one
    text = capsys.readouterr().out
    assert "[e2e] rlbench: train phase wall" in text
    assert "| steady step (median) s |" in text and "| MFU train | n/a |" in text and "| log_probs s |" in text


def test_trl_missing_is_clear(e2e, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    with pytest.raises(ValueError, match=r"--trl: TRL is not importable .*pip install trl==1.16.0.*--no-trl"):
        e2e.check_trl(True)
    assert e2e.check_trl(None) is False
    assert "TRL not importable" in capsys.readouterr().out
    assert e2e.check_trl(False) is False


def test_tokenizer_one_char_per_token_and_every_id_decodes(e2e):
    tok = e2e.bench_tokenizer(500)
    assert len(tok) == 500
    text = "ab+3 =x"
    assert len(tok(text)["input_ids"]) == len(text) and tok.decode(tok(text)["input_ids"]) == text
    special = set(tok.added_tokens_decoder) | {tok.unk_token_id}
    assert all(tok.decode([i], skip_special_tokens=True) for i in range(500) if i not in special)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def _run(step_s, rollout_s, peaks):
    step = {"step_s": step_s, "phases": {"rollout": rollout_s, "train": step_s - rollout_s}, "peaks_gb": peaks,
            "peak_gb": max(peaks.values()), "tokens": 1000.0, "generated_tokens": 200.0, "response_len": 4.0}
    return {"build_s": 1.0, "num_params": 10**9, "steps": [dict(step, step_s=2 * step_s), step, step]}


def test_summary_mfu_and_ratio_table(e2e):
    peak = 1e15
    ours = e2e.summarize(_run(2.0, 0.5, {"rollout": 3.0, "train": 5.0}), peak)
    theirs = e2e.summarize(_run(8.0, 4.0, {"rollout": 7.0, "train": 9.0}), peak)
    assert ours["steady_step_s"] == 2.0 and ours["first_step_s"] == 4.0 and ours["cold_extra_s"] == 2.0
    assert ours["mfu"]["train"] == pytest.approx(6 * 1e9 * 1000 / 1.5 / peak)
    assert ours["mfu"]["rollout"] == pytest.approx(2 * 1e9 * 200 / 0.5 / peak)
    assert ours["mfu"]["step"] == pytest.approx(6 * 1e9 * 1000 / 2.0 / peak)
    assert ours["peak_memory_gb"] == 5.0 and ours["rollout_tokens_per_s"] == 400.0
    text = e2e.table({"rlbench": ours, "trl": theirs})
    assert "| steady step (median) s | 2.000 | 8.000 | 0.25x |" in text
    assert "| log_probs s | — | — | — |" in text


def test_ppo_variant_config_trains_a_critic_beside_grpo(e2e, tmp_path, monkeypatch):
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "bench_text", e2e.text_reward)  # run_rlbench registers it in its process
    w = e2e.dataclasses.replace(e2e.WORKLOADS["cpu-tiny"], vocab_size=128, prompts=2, n=2, prompt_len=8, response_len=4)
    model_dir = e2e.write_model_dir(w, str(tmp_path / "model"))
    ppo = e2e.rlbench_config(w, model_dir, str(tmp_path / "ppo"), 2, variant=e2e.VARIANTS["rlbench-ppo"])
    grpo = e2e.rlbench_config(w, model_dir, str(tmp_path / "grpo"), 2)
    assert (ppo.loss.advantage_estimator, grpo.loss.advantage_estimator) == ("gae", "grpo")
    assert ppo.loss.needs_critic and ppo.backend.critic is not None and ppo.backend.critic.load is None  # the actor's
    assert grpo.backend.critic is None
    # everything else is the GRPO system's workload
    assert (ppo.rollout, ppo.batch, ppo.engine, ppo.offload) == (grpo.rollout, grpo.batch, grpo.engine, grpo.offload)
    assert e2e.dataclasses.replace(ppo.loss, advantage_estimator="grpo") == grpo.loss


def test_critic_phases_in_summary_and_table(e2e):
    run = _run(2.0, 0.5, {"rollout": 3.0, "train": 5.0})
    run["critic_params"] = 2 * 10**9
    for s in run["steps"]:
        s["phases"] |= {"values": 0.1, "critic_train": 0.4}
        s["values_tokens"] = 500.0
    row = e2e.summarize(run, 1e15)
    assert row["phases_s"]["values"] == 0.1 and row["phases_s"]["critic_train"] == 0.4
    assert row["mfu"]["values"] == pytest.approx(2 * 2e9 * 500 / 0.1 / 1e15)
    assert row["mfu"]["critic_train"] == pytest.approx(6 * 2e9 * 1000 / 0.4 / 1e15)
    grpo = e2e.summarize(_run(2.0, 0.5, {"rollout": 3.0, "train": 5.0}), 1e15)
    assert "values" not in grpo["phases_s"] and "values" not in grpo["mfu"]
    text = e2e.table({"rlbench": grpo, "rlbench-ppo": row})
    assert "| values s | — | 0.100 |" in text and "| critic_train s | — | 0.400 |" in text
    assert "| MFU critic_train | n/a | 3.0% |" in text


def test_4b_workload_leaves_memory_to_the_plan(e2e, tmp_path, monkeypatch):
    """The 4B workload is issue 50's target (`--max-tokens-per-gpu 16384` alone): AC left to the start-up memory
    plan (None in the RunConfig); `--gradient-checkpointing` / `--max-tokens-per-gpu` set them by hand."""
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "bench_text", e2e.text_reward)  # run_rlbench registers it in its process
    w = e2e.workload(e2e.parse_args(["--preset", "qwen3-4b-shape"]))
    assert (w.max_tokens_per_gpu, w.gradient_checkpointing) == (16384, None)
    cfg = e2e.rlbench_config(w, "qwen3-4b-shape", str(tmp_path), 2)
    assert cfg.backend.fsdp.gradient_checkpointing is None and cfg.batch.max_tokens_per_gpu == 16384
    assert cfg.offload is None and cfg.engine.num_slots is None
    hand = e2e.workload(e2e.parse_args(["--preset", "qwen3-4b-shape", "--max-tokens-per-gpu", "8192",
                                        "--gradient-checkpointing"]))
    assert (hand.max_tokens_per_gpu, hand.gradient_checkpointing) == (8192, True)
