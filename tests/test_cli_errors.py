"""The CLI as a new user meets it: parsing imports no torch, help strings are whole, an unknown flag gets "did
you mean", every mistake is one line naming the flag (the traceback behind --debug), missing paths are called
missing paths, your own data replaces the preset's (eval included), and each run gets its own directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlbench import presets
from rlbench.cli import build_parser, flag_message, main, preset_config
from rlbench.cli_flags import config_flags
from rlbench.cli_run import summarize_run

HEAVY = ("torch", "transformers", "numpy", "safetensors", "triton")


def _run_cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "rlbench.cli", *argv], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv", [["train", "--help"], ["train", "--rollout-temprature", "1"]])
def test_help_and_a_bad_flag_import_no_torch(argv):
    """`-X importtime` lists every module imported; none of the heavy ones may be among them."""
    proc = _run_cli(*argv)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"rlbench", "rlbench.configs", "rlbench.configs.loss"} <= imported  # it did read the configs
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []
    if argv[1] == "--help":
        assert proc.returncode == 0 and "--rollout-temperature" in proc.stdout
    else:
        assert proc.returncode == 2


def test_help_strings_keep_their_quotes():
    docs = {flag: doc for flag, (_, _, _, doc) in config_flags().items()}
    assert [f for f, d in docs.items() if not d] == []
    assert [f for f, d in docs.items() if d.count('"') % 2] == []
    assert docs["--device"].endswith('"cuda" or "cpu".')
    assert docs["--lr-decay-style"].startswith('"constant", "linear" or "cosine"')


def test_unknown_flag_suggests_the_closest(capsys):
    assert main(["train", "--rollout-temprature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "rlbench train: error: unknown flag --rollout-temprature; did you mean --rollout-temperature or "
        "--eval-temperature or --rollout-seed?"]


def test_a_value_given_to_a_boolean_flag_is_named(capsys):
    assert main(["train", "--use-kl-loss", "yes"]) == 2
    assert capsys.readouterr().err == (
        "rlbench train: error: unexpected argument 'yes' (a boolean flag takes no value: --x or --no-x)\n")


def test_a_bad_value_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--lr", "abc"])
    assert capsys.readouterr().err == (
        "rlbench train: error: argument --lr: invalid float value: 'abc' (`rlbench train --help` lists every flag)\n")


def test_config_errors_name_flags_without_a_traceback(capsys):
    argv = ["train", "--preset", "cpu_test", "--rollout-max-prompt-len", "40", "--print-config"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "rlbench train: error: --rollout-max-prompt-len=40 + --rollout-max-response-len=12 exceeds "
        "--engine-max-seq-len=48; raise --engine-max-seq-len (--debug: the traceback)\n")
    with pytest.raises(ValueError, match=r"exceeds engine\.max_seq_len=48"):  # --debug: the original error
        main([*argv, "--debug"])


@pytest.mark.parametrize("message, expected", [
    ("rollout_batch_size=8 x n_samples_per_prompt=8 = 64", "--rollout-batch-size=8 x --n-samples-per-prompt=8 = 64"),
    ("eval n_samples_per_prompt=0 must be >= 1", "eval --n-samples-per-eval-prompt=0 must be >= 1"),
    ("need a reference model; set backend.ref_model (--ref-load)", "need a reference model; set --ref-load"),
    ("backend.optim.lr=3", "--lr=3"),
    ("data/mine.jsonl: seed=3 lr", "data/mine.jsonl: seed=3 lr"),  # a file name, an ambiguous and a bare word
])
def test_flag_message_rewrites_field_names(message, expected):
    assert flag_message(message) == expected


def test_a_missing_checkpoint_is_a_missing_path(capsys, tmp_path):
    assert main(["train", "--hf-checkpoint", "/no/such/model", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlbench train: error: --hf-checkpoint /no/such/model: no such directory") and "preset" in err
    assert "unknown model preset" not in err and len(err.splitlines()) == 1
    assert main(["train", "--hf-checkpoint", str(tmp_path), "--print-config"]) == 2
    assert f"--hf-checkpoint {tmp_path}: the directory has no config.json" in capsys.readouterr().err
    assert main(["train", "--ref-load", "./missing", "--print-config"]) == 2
    assert "--ref-load ./missing: no such directory" in capsys.readouterr().err


def test_a_missing_data_file_names_its_flag(capsys):
    assert main(["train", "--prompt-data", "mine.jsonl", "--print-config"]) == 2
    assert capsys.readouterr().err.startswith("rlbench train: error: --prompt-data mine.jsonl: no such file (from ")


def _cfg(*argv: str, preset: str = "cpu_test"):
    return preset_config(build_parser().parse_args(["train", "--preset", preset, *argv]))


def test_own_prompt_data_replaces_the_preset_task_and_its_eval(tmp_path):
    mine, held = str(tmp_path / "mine.jsonl"), str(tmp_path / "held.jsonl")
    cfg = _cfg("--prompt-data", mine)
    assert (cfg.data.path, cfg.task, cfg.eval.interval) == (mine, None, None)
    cfg = _cfg("--prompt-data", mine, "--eval-prompt-data", held)
    assert (cfg.task, cfg.eval.data_path, cfg.eval.interval) == (None, held, 5)  # the preset's interval
    with pytest.raises(ValueError, match="eval.interval is set but there is no eval data") as info:
        _cfg("--prompt-data", mine, "--eval-interval", "2")
    assert flag_message(str(info.value)).startswith("--eval-interval is set but there is no eval data; set "
                                                    "--eval-prompt-data")
    assert _cfg().task is not None and _cfg().eval.interval == 5  # without --prompt-data: the preset's task


def test_each_run_gets_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _cfg(preset="cpu_demo").logging.jsonl_path
    assert path.startswith(os.path.join("runs", "cpu-demo-")) and path.endswith("metrics.jsonl")
    assert _cfg("--run-dir", "out/r1", preset="cpu_demo").logging.jsonl_path == os.path.join("out", "r1", "metrics.jsonl")
    assert _cfg("--metrics-jsonl", "m.jsonl", preset="cpu_demo").logging.jsonl_path == "m.jsonl"
    demo = presets.cpu_demo(model="small").logging.jsonl_path
    assert demo.startswith(os.path.join("runs", "demo-")) and not demo.startswith(os.path.join("runs", "demo", ""))
    monkeypatch.setattr(presets.time, "strftime", lambda fmt: "20261202-101500")
    assert presets.new_run_dir("demo") == os.path.join("runs", "demo-20261202-101500")
    os.makedirs(os.path.join("runs", "demo-20261202-101500"))
    os.makedirs(os.path.join("runs", "demo-20261202-101500-2"))
    assert presets.new_run_dir("demo") == os.path.join("runs", "demo-20261202-101500-3")  # the same second: -3


class _Finished:
    """The two histories `summarize_run` reads."""

    def __init__(self, evals):
        self.eval_history = [{"rollout/id": float(r), "weights/version": float(r), "eval/pass@1": p} for r, p in evals]
        self.history = [{"perf/step_time": 2.0}, {"perf/step_time": 4.0}]


def test_summary_reports_only_measured_evals():
    assert summarize_run(_Finished([(0, 0.25)])) == {
        "eval/rollout_id/start": 0.0, "eval/pass@1/start": 0.25, "perf/step_time/mean": 3.0}
    assert summarize_run(_Finished([(0, 0.25), (5, 0.5), (8, 0.75)])) == {
        "eval/rollout_id/start": 0.0, "eval/pass@1/start": 0.25, "eval/rollout_id/end": 8.0, "eval/pass@1/end": 0.75,
        "perf/step_time/mean": 3.0}
    assert "eval/pass@1/start" not in summarize_run(_Finished([]))


def test_print_config_without_a_warm_start_builds_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--preset", "cpu_demo", "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"]["model"] == str(tmp_path / "cache" / presets.DEMO_SFT_NAME)
    assert not (tmp_path / "cache").exists()
