"""examples/*.sh on the CPU with the tiny preset: every flag of each launch script exists and the combination
validates (`--print-config`, checked against what the script's comments promise), and the one-GPU script
trains one real step when a few flags shrink it to CPU size."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script -> (cluster backend, trainer GPUs, rollout GPUs, colocate, KL loss)
EXPECTED = {
    "run-qwen3-0.6B-colocate-1gpu.sh": ("local", 1, None, True, False),
    "run-qwen3-4B-colocate-Ngpu.sh": ("ray", 8, 8, True, True),
    "run-qwen3-4B-disaggregated.sh": ("ray", 4, 4, False, False),
    "run-qwen3-0.6B-ppo-critic-1gpu.sh": ("local", 1, None, True, True),  # KL-in-reward (kl_coef), no KL loss
    "tool_use.sh": ("local", 1, None, True, False),
}
CPU_SIZE = ["--device", "cpu", "--param-dtype", "fp32", "--num-rollout", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "8",
            "--engine-max-seq-len", "128", "--max-tokens-per-gpu", "512", "--eval-max-prompts", "2",
            "--n-samples-per-eval-prompt", "1", "--eval-pass-k", "1"]


def _run(script: str, tmp_path: pathlib.Path, *argv: str) -> subprocess.CompletedProcess:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is 1+{i}?", "label": str(1 + i)}) + "\n" for i in range(8)))
    env = dict(os.environ, MODEL="tiny", DATA=str(data), EVAL_DATA=str(data),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(EXAMPLES / script), *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.sh")) == sorted([*EXPECTED, "train_rm.sh", "rlhf_hidden_rule.sh"])


def test_train_rm_example_writes_a_reward_model_on_cpu(tmp_path):
    env = dict(os.environ, MODEL="tiny", DATA=str(tmp_path / "prefs.jsonl"), OUT=str(tmp_path / "rm"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(EXAMPLES / "train_rm.sh"), "--epochs", "1", "--num-threads", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "prefs.jsonl").read_text().splitlines()) == 2000  # the synthetic pairs, written first
    final = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert final["rm/epoch"] == 1.0 and final["rm/eval_pairs"] == 200 and final["rm/eval_accuracy"] >= 0.9
    stamp = json.loads((tmp_path / "rm" / "version.json").read_text())
    assert stamp["version"] == final["version"] and f"--reward-model {tmp_path / 'rm'}" in proc.stdout


def test_rlhf_example_runs_the_chain_on_cpu(tmp_path):
    """SFT (40 steps), an RM on 64 pairs and one PPO step against it: each stage's output is where the next reads it,
    and the run's config is the one the script's comments describe."""
    env = dict(os.environ, WORK=str(tmp_path / "w"), SFT_STEPS="40", N_PAIRS="64",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    script = str(EXAMPLES / "rlhf_hidden_rule.sh")
    small = ["--num-rollout", "1", "--eval-interval", "1", "--rollout-batch-size", "4", "--global-batch-size", "32"]
    proc = subprocess.run(["bash", script, *small], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    work = tmp_path / "w"
    assert (work / "sft" / "config.json").is_file() and (work / "rm" / "version.json").is_file()
    assert len((work / "prefs.jsonl").read_text().splitlines()) == 64
    summary = json.loads(proc.stdout[proc.stdout.rindex("\n{") + 1:])
    assert summary["eval/rollout_id/end"] == 1.0 and "eval/reward/start" in summary
    proc = subprocess.run(["bash", script, "--print-config"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    cfg = json.loads(proc.stdout)
    rollout, loss = cfg["rollout"], cfg["loss"]
    assert (rollout["reward_model"], rollout["reward_weights"], rollout["rm_type"], cfg["data"]["metadata_key"]) == (
        str(work / "rm"), {"rm": 1.0}, "rlbench.data.preferences:hidden_rule_score", None)
    assert (loss["advantage_estimator"], loss["kl_ctl_type"], loss["kl_target"], cfg["backend"]["ref_model"]) == (
        "gae", "adaptive", 0.1, str(work / "sft"))


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_flags_resolve(script, tmp_path):
    proc = _run(script, tmp_path, "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = json.loads(proc.stdout)
    backend, train_gpus, rollout_gpus, colocate, kl = EXPECTED[script]
    cluster = cfg["cluster"]
    assert (cluster["backend"], cluster["actor_num_gpus_per_node"], cluster["rollout_num_gpus"], cluster["colocate"]) \
        == (backend, train_gpus, rollout_gpus, colocate)
    loss = cfg["loss"]
    assert (loss["use_kl_loss"] or loss["kl_coef"] > 0) is kl and (cfg["backend"]["ref_model"] == "tiny") is kl
    assert (cfg["backend"]["model"], cfg["task"], cfg["eval"]["interval"]) == ("tiny", None, 10)
    assert cfg["data"]["path"] == cfg["eval"]["data_path"] == str(tmp_path / "prompts.jsonl")
    assert cfg["backend"]["device"] == "cuda" and cfg["rollout"]["rm_type"] == "math"
    multiturn = script == "tool_use.sh"
    assert (cfg["rollout"]["custom_generate_function_path"] == "rlbench.rollout.multiturn:generate") is multiturn
    if multiturn:
        assert cfg["rollout"]["multiturn"] == {"tools": ["calculator"], "max_turns": 4, "max_turn_tokens": 512,
                                               "tool_timeout": 5.0, "max_observation_chars": 2000}


def test_one_gpu_example_trains_a_step_on_cpu(tmp_path):
    proc = _run("run-qwen3-0.6B-colocate-1gpu.sh", tmp_path, *CPU_SIZE, "--save", "ck", "--save-interval", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["eval/rollout_id/start"] == 0.0 and "eval/pass@1/end" not in summary  # one eval: no "end"
    assert summary["perf/step_time/mean"] > 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("qwen3-0p6b-gpu-")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/id"] for r in rows] == [0.0]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").is_file()


def test_ppo_example_builds_the_critic(tmp_path):
    """The PPO script: GAE with a critic of its own LR, warm-up and critic-only steps, KL-in-reward (not a loss)."""
    proc = _run("run-qwen3-0.6B-ppo-critic-1gpu.sh", tmp_path, "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = json.loads(proc.stdout)
    loss, critic = cfg["loss"], cfg["backend"]["critic"]
    assert (loss["advantage_estimator"], loss["lambd"], loss["value_clip"], loss["kl_coef"], loss["use_kl_loss"]) \
        == ("gae", 0.95, 0.2, 0.01, False)
    assert critic == {"load": None, "lr": 5e-6, "lr_warmup_iters": 5, "num_critic_only_steps": 2}
