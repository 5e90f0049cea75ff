"""`rlbench quickstart`: an HF directory + a jsonl, no preset; sizes from the device and the data, one real CPU step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlbench.cli import main
from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import build_model, save_pretrained

ROWS = [("What is 1+1?", "2"), ("What is 2+3?", "5"), ("What is 12+30?", "42"), ("Add 4 and 5.", "9")]


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A temp working dir with `model/` (tiny Qwen3 + char tokenizer) and `data.jsonl` (4 rows)."""
    monkeypatch.chdir(tmp_path)
    save_pretrained(build_model("tiny"), build_tokenizer(), tmp_path / "model")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": p, "label": a}) + "\n" for p, a in ROWS))
    return tmp_path


def _longest_prompt_tokens() -> int:
    tok = build_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p, _ in ROWS]
    return max(len(tok(text, add_special_tokens=False)["input_ids"]) for text in texts)


def _config(capsys, *flags) -> dict:
    assert main(["quickstart", "--hf-checkpoint", "model", "--prompt-data", "data.jsonl", "--print-config",
                 *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_print_config_derives_sizes_from_the_device_and_data(run_dir, capsys):
    cfg = _config(capsys)
    longest = _longest_prompt_tokens()
    assert longest == 33  # 19 template tokens + 14 chars, one token a char
    assert cfg["engine"]["max_seq_len"] == 16 * math.ceil((longest + 64) / 16) == 112
    gpu = torch.cuda.is_available()
    assert (cfg["backend"]["device"], cfg["backend"]["param_dtype"]) == (("cuda", "bf16") if gpu else ("cpu", "fp32"))
    assert (cfg["rollout"]["rollout_batch_size"], cfg["rollout"]["n_samples_per_prompt"]) == ((32, 8) if gpu else (4, 4))
    assert (cfg["data"]["input_key"], cfg["data"]["label_key"], cfg["rollout"]["rm_type"]) == ("prompt", "label", "exact")
    assert cfg["task"] is None and cfg["eval"]["interval"] is None
    assert cfg["logging"]["jsonl_path"].startswith("runs/quickstart-")


def test_flags_override_the_derived_choices(run_dir, capsys):
    rows = [{"q": "What is 1+1? Answer in one digit.", "a": "2"}]
    (run_dir / "qa.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cfg = _config(capsys, "--prompt-data", "qa.jsonl", "--input-key", "q", "--label-key", "a",
                  "--rollout-max-response-len", "10", "--device", "cpu", "--rm-type", "math", "--lr", "3e-4")
    assert cfg["engine"]["max_seq_len"] == 16 * math.ceil((19 + 33 + 10) / 16) == 64  # 19 template + 33 chars
    assert (cfg["data"]["input_key"], cfg["data"]["label_key"], cfg["rollout"]["rm_type"]) == ("q", "a", "math")
    assert (cfg["backend"]["param_dtype"], cfg["backend"]["optim"]["lr"]) == ("fp32", 3e-4)
    assert _config(capsys, "--engine-max-seq-len", "200")["engine"]["max_seq_len"] == 208  # given: rounded to 16 only
    cfg = _config(capsys, "--eval-prompt-data", "data.jsonl")
    assert (cfg["eval"]["data_path"], cfg["eval"]["interval"]) == ("data.jsonl", 5)


@pytest.mark.parametrize("argv, message", [
    (["--hf-checkpoint", "missing", "--prompt-data", "data.jsonl"], "--hf-checkpoint missing: no such directory"),
    (["--hf-checkpoint", "model", "--prompt-data", "nope.jsonl"], "--prompt-data nope.jsonl: no such file"),
    (["--hf-checkpoint", "model"], "quickstart needs --hf-checkpoint DIR"),
    (["--hf-checkpoint", "bare", "--prompt-data", "data.jsonl"], "--hf-checkpoint bare: no tokenizer files"),
])
def test_bad_paths_are_one_line(run_dir, capsys, argv, message):
    save_pretrained(build_model("tiny"), None, run_dir / "bare")
    capsys.readouterr()  # the save's progress bar
    assert main(["quickstart", *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlbench quickstart: error: {message}") and err.count("\n") == 1


def test_one_real_cpu_step_writes_metrics_in_its_run_dir(run_dir, capsys):
    torch.set_num_threads(2)
    assert main(["quickstart", "--hf-checkpoint", "model", "--prompt-data", "data.jsonl", "--device", "cpu",
                 "--num-rollout", "1", "--rollout-max-response-len", "8", "--run-dir", "runs/mine"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("[rlbench] quickstart:"):].splitlines()[:8]
    assert block[3] == "  reward     exact (--rm-type)"
    assert "engine max_seq_len 48 (longest prompt + max response" in block[4]  # 33 + 8 -> 48
    assert block[7] == "  metrics    runs/mine/metrics.jsonl"
    rows = [json.loads(line) for line in (run_dir / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/id"] for r in rows] == [0.0]
    assert rows[0]["perf/step_time"] > 0 and 0.0 <= rows[0]["rollout/raw_reward"] <= 1.0
    summary = json.loads(out[out.index("\n{") + 1:])
    assert summary["perf/step_time/mean"] > 0 and "eval/pass@1/start" not in summary  # no eval data: no eval


def _readme_train_command() -> list[str]:
    """The README's GPU example (`rlbench train --train-backend fsdp --hf-checkpoint ...`) as argv."""
    import pathlib
    import shlex

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    start = text.index("rlbench train --train-backend fsdp --hf-checkpoint")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(lines))[1:]


def test_train_without_preset_derives_like_quickstart(run_dir, capsys):
    assert main(["train", "--hf-checkpoint", "model", "--prompt-data", "data.jsonl", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    derived = cfg.pop("derived")
    quick = _config(capsys)
    assert quick.pop("derived") == derived
    assert cfg["logging"]["jsonl_path"].startswith("runs/train-")
    for c in (cfg, quick):
        c.pop("logging")
    assert cfg == quick
    assert derived["engine.max_seq_len"] == ("112 (the longest prompt, 33 tokens in data.jsonl with the model's "
                                             "tokenizer + max response 64, rounded up to 16)")
    gpu = torch.cuda.is_available()
    assert derived["backend.device"] == ("cuda (a CUDA device is present)" if gpu else "cpu (no CUDA device)")
    assert derived["eval.interval"] == "None (no --eval-prompt-data: no evaluation)"


def test_print_config_reads_each_prompt_file_once(run_dir, capsys, monkeypatch):
    from rlbench import presets

    (run_dir / "eval.jsonl").write_text(json.dumps({"prompt": "What is 123+456?", "label": "579"}) + "\n")
    read, longest = [], presets.longest_prompt
    monkeypatch.setattr(presets, "longest_prompt", lambda model, data, path: read.append(path) or longest(model, data, path))
    cfg = _config(capsys, "--eval-prompt-data", "eval.jsonl")
    assert read == ["data.jsonl", "eval.jsonl"]  # once for the config and its explanation together
    assert cfg["derived"]["engine.max_seq_len"] == ("112 (the longest prompt, 35 tokens in data.jsonl and eval.jsonl "
                                                    "with the model's tokenizer + max response 64, rounded up to 16)")


def test_readme_gpu_command_resolves_lengths_from_the_data(run_dir, capsys):
    argv = _readme_train_command()
    assert argv[:2] == ["train", "--train-backend"] and "--preset" not in argv
    swap = {"/models/Qwen3-0.6B": "model", "data/math.jsonl": "data.jsonl", "data/math_eval.jsonl": "data.jsonl"}
    argv = [swap.get(a, a) for a in argv]
    assert main([*argv, "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    # the README's sizes are kept; the engine's length comes from the data + the device's response length
    assert (cfg["rollout"]["rollout_batch_size"], cfg["batch"]["global_batch_size"]) == (32, 256)
    assert (cfg["rollout"]["rm_type"], cfg["backend"]["device"], cfg["backend"]["param_dtype"]) == ("math", "cuda", "bf16")
    assert cfg["rollout"]["max_response_len"] == 512  # the cuda default, not the cpu demo's 32
    assert cfg["engine"]["max_seq_len"] == 16 * math.ceil((33 + 512) / 16)
    assert cfg["eval"]["data_path"] == "data.jsonl" and cfg["eval"]["interval"] == 10
    assert cfg["derived"]["backend.device"] == "cuda (given: --device)"


def test_train_without_model_or_data_keeps_the_demo_preset(run_dir, capsys):
    assert main(["train", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert "derived" not in cfg and cfg["logging"]["jsonl_path"].startswith("runs/cpu-demo-")
    assert main(["train", "--hf-checkpoint", "model", "--print-config"]) == 0  # your model on the demo's task
    assert json.loads(capsys.readouterr().out)["backend"]["model"] == "model"


def test_train_without_preset_runs_one_cpu_step(run_dir, capsys):
    torch.set_num_threads(2)
    assert main(["train", "--hf-checkpoint", "model", "--prompt-data", "data.jsonl", "--device", "cpu",
                 "--num-rollout", "1", "--rollout-max-response-len", "8", "--run-dir", "runs/mine"]) == 0
    out = capsys.readouterr().out
    assert "[rlbench] train:" in out and "engine max_seq_len 48 (longest prompt + max response" in out
    rows = [json.loads(line) for line in (run_dir / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/id"] for r in rows] == [0.0] and rows[0]["perf/step_time"] > 0
