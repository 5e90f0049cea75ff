"""`rlbench demo --device cuda` without a GPU: the config it builds (shapes, lengths, batch sizes, the start-up
memory plan on an H100's memory), the one-line error where there is no CUDA, and the same code path end to end at
the `tiny` size on the CPU (warm start built, GRPO steps, evals, metrics and curve written, progress lines). The
GPU run itself is `rlbench demo --device cuda --seed 0` (README)."""

from __future__ import annotations

import dataclasses as dc
import io
import json
import os

import pytest
import torch

from rlbench import presets
from rlbench.cli import build_parser, main, preset_config
from rlbench.cli_run import expected_samples
from rlbench.configs import LoggingConfig
from rlbench.memory_start import DeviceMemory, plan_at_start
from rlbench.models import build_config
from rlbench.orchestration.local import build_data
from rlbench.progress import Progress

GIB = 1 << 30


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache"


def test_cuda_demo_config(cache, capsys):
    assert main(["demo", "--device", "cuda", "--print-config"]) == 0  # no CUDA needed to print it
    out = json.loads(capsys.readouterr().out)
    name = presets.demo_sft_name("cuda")
    assert name.startswith("sft-qwen3-0.6b-shape-arith1-cuda-") and out["backend"]["model"] == str(cache / name)
    b, r, bt, e = out["backend"], out["rollout"], out["batch"], out["eval"]
    assert (b["device"], b["param_dtype"], out["train_backend"]) == ("cuda", "bf16", "fsdp")
    assert (b["optim"]["lr"], b["optim"]["warmup_steps"], b["optim"]["clip_grad"]) == (2e-5, 10, 1.0)
    assert (r["rollout_batch_size"], r["n_samples_per_prompt"], r["max_response_len"], r["temperature"]) == (32, 8, 16, 1.0)
    assert (bt["global_batch_size"], bt["num_rollout"], bt["max_tokens_per_gpu"]) == (128, 100, 16384)
    assert (e["interval"], e["n_samples_per_prompt"], e["pass_k"], e["temperature"]) == (10, 8, [1, 8], 1.0)
    assert out["engine"]["max_seq_len"] == 256 and out["engine"]["num_slots"] is None  # sized from memory at start
    assert (out["task"]["level"], out["task"]["n_eval"]) == (1, 128)

    args = build_parser().parse_args(["demo", "--device", "cuda", "--seed", "2"])
    cfg = preset_config(args)
    assert args.preset == "cuda_demo" and (cfg.rollout.seed, cfg.data.seed) == (2, 2)
    assert cfg.optimizer_steps_per_rollout == 2
    # the CPU demo's task and eval split: the same files in the cache
    cpu = presets.cpu_demo(model="small", workdir="runs/x")
    assert (cfg.data.path, cfg.task.eval_path) == (cpu.data.path, cpu.task.eval_path)
    # the whole rollout bar: 100 rollouts x 256 samples + 11 evals (0, 10, ..., 100) x 128 prompts x 8
    assert expected_samples(cfg, 128) == 100 * 256 + 11 * 1024
    assert expected_samples(cfg, 128, done=95) == 5 * 256 + 1 * 1024


def test_cuda_demo_warm_start_is_the_gpu_sft_at_level_1():
    spec = presets.DEMO_SFT_CUDA
    assert spec["preset"] == "qwen3-0.6b-shape" and spec["task_kwargs"] == {"level": 1}
    assert {k: spec[k] for k in presets.GPU_SFT} == presets.GPU_SFT  # the SFT settings run on the H100 / H200
    assert (spec["device"], spec["tokenizer_vocab"], spec["max_steps"], spec["target_pass_at_1"]) == ("cuda", False, 400, 0.3)
    assert spec["num_eval"] == presets.DEMO_SFT["num_eval"] == 128  # eval prompts = the GRPO eval prompts
    c = build_config(spec["preset"])  # Qwen3-0.6B's layers and its own vocabulary
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings) == (1024, 3072, 28, 16, 8, 128, 151936, True)
    from rlbench.sft import SFTConfig

    SFTConfig(**(spec | {"device": "cpu"}))  # every field valid (CUDA itself is checked on the GPU)


def test_cuda_demo_warm_start_name_follows_its_config(monkeypatch):
    name = presets.demo_sft_name("cuda")
    assert presets.demo_sft_name("cuda") == name and presets.demo_sft_name("cpu") == presets.DEMO_SFT_NAME
    monkeypatch.setitem(presets.DEMO_SFTS, "cuda", presets.DEMO_SFT_CUDA | {"lr": 1e-4})
    assert presets.demo_sft_name("cuda") != name  # another recipe, another cache directory
    with pytest.raises(ValueError, match="no demo warm start for device 'mps'"):
        presets.demo_sft_name("mps")


def test_cuda_demo_lengths_and_memory_plan_on_an_h100(cache):
    cfg = presets.cuda_demo(model="qwen3-0.6b-shape", workdir="runs/x")
    cfg = cfg.replace(backend=dc.replace(cfg.backend, device="cpu"))  # read the data here (the tokenizer, 152k)
    _, dataset, eval_items = build_data(cfg)  # raises when a prompt + 16 new tokens passes max_seq_len
    lengths = [len(it.prompt_token_ids) for it in dataset.items + eval_items]
    assert len(eval_items) == 128 and max(lengths) + cfg.rollout.max_response_len <= cfg.engine.max_seq_len
    assert 20 <= min(lengths) <= max(lengths) <= 30
    cfg = cfg.replace(backend=dc.replace(cfg.backend, device="cuda"))
    # An H100 80GB HBM3 as torch reports it (79.1 GiB), ~1 GiB taken by the context before the plan
    plan = plan_at_start(cfg, build_config("qwen3-0.6b-shape"), DeviceMemory(int(79.1 * GIB), int(78.1 * GIB)),
                         shortest_prompt=min(lengths))
    p = plan.config
    print("\n".join(plan.lines()))
    assert plan.sizes["kv_slots"] == 256 and plan.sizes["kv_cache"] < 8 * GIB  # one rollout round's samples
    assert p.offload is False and p.backend.fsdp.gradient_checkpointing is False and p.backend.fsdp.cpu_offload is False
    # 44.3 GiB for a full 16k-token micro-batch (the packs here hold ~4.5k) of 76.1 usable
    assert p.batch.max_tokens_per_gpu == 16384 and plan.need["total"] < 50 * GIB


def test_demo_device_cuda_without_cuda_is_one_line(cache, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("rlbench demo: error: --device cuda: no CUDA device here")
    assert "run `rlbench demo` without --device for the CPU demo" in err
    assert not cache.exists()  # refused before any warm start or task file was built
    assert main(["bench"]) == 2
    assert "--preset qwen3_0p6b_gpu (a GPU preset): no CUDA device here" in capsys.readouterr().err


def test_cuda_demo_end_to_end_at_tiny_size_on_cpu(cache, capsys, monkeypatch):
    """`demo --preset cuda_demo` through the CLI with the warm start's model and device swapped for tiny / cpu
    (`DEMO_SFTS["cuda"]`) and small batches: the same builder, warm start, trainer, evals, progress and curve."""
    tiny = presets.DEMO_SFT_CUDA | {"preset": "tiny", "device": "cpu", "batch_size": 8, "num_train": 400,
                                    "num_eval": 8}
    monkeypatch.setitem(presets.DEMO_SFTS, "cuda", tiny)
    argv = ["demo", "--preset", "cuda_demo", "--device", "cpu", "--seed", "1", "--sft-steps", "2",
            "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--global-batch-size", "4", "--eval-interval", "1", "--eval-max-prompts", "4", "--run-dir", "runs/d"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    sft = cache / presets.demo_sft_name("cuda")
    assert f"[rlbench] SFT warm start -> {sft} (built once" in out
    with open(sft / "sft_metrics.json") as f:
        sft_metrics = json.load(f)
    assert sft_metrics["sft/step"] == 2 and sft_metrics["config"]["preset"] == "tiny"
    assert "SFT: 2/2 steps (100%)" in out  # the SFT bar, one plain line per 10% (stdout is no terminal here)
    # the rollout bar: 2 rollouts x 8 samples + 3 evals (0, 1, 2) x 4 prompts x 8 samples, and no line twice
    total = 2 * 8 + 3 * 4 * 8
    lines = [ln for ln in out.splitlines() if ln.startswith("rollout: ")]
    assert lines[-1].startswith(f"rollout: {total}/{total} samples (100%)") and len(lines) == len(set(lines)) <= 11
    assert [ln.split(" |")[0] for ln in out.splitlines() if ln.startswith("step ")] == ["step 1", "step 2"]
    summary = json.loads(out[out.index("{\n"): out.index("\n}") + 2])
    assert summary["eval/rollout_id/start"] == 0.0 and summary["eval/rollout_id/end"] == 2.0
    assert 0.0 <= summary["eval/pass@1/end"] <= summary["eval/pass@8/end"] <= 1.0
    with open("runs/d/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["rollout/id"] for r in rows] == [0.0, 1.0]
    assert all(r["perf/rollout_time"] > 0 and r["perf/train_time"] > 0 and r["weights/bytes"] > 0 for r in rows)
    assert all(r["rollout/weight_version"] == 2 * i for i, r in enumerate(rows))  # two optimizer steps a rollout
    assert "[rlbench] curve -> runs/d/curve.png" in out and os.path.getsize("runs/d/curve.png") > 1000

    assert main(argv[:-1] + ["runs/e", "--num-rollout", "1", "--skip-eval-before-train"]) == 0  # the cache is reused
    out = capsys.readouterr().out
    assert f"[rlbench] reusing SFT warm start {sft}" in out and "SFT:" not in out


def test_progress_without_a_terminal_prints_a_line_per_tenth():
    buf = io.StringIO()
    with Progress(100, "SFT", unit="step", file=buf) as bar:
        for i in range(100):
            bar.update()
            if i == 49:
                bar.write("eval line")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 11 and lines[5] == "eval line" and "\r" not in buf.getvalue()
    assert [ln.split(" (")[0] for ln in lines[:2]] == ["SFT: 10/100 steps", "SFT: 20/100 steps"]
    assert lines[-1].startswith("SFT: 100/100 steps (100%)")
    buf = io.StringIO()
    with Progress(10, "rollout", unit="sample", file=buf) as bar:
        bar.update(25)  # past the estimate: the total follows
        bar.update(3)   # under another tenth: no line until close
    assert buf.getvalue().splitlines()[0].startswith("rollout: 25/25 samples (100%)")
    assert buf.getvalue().splitlines()[-1].startswith("rollout: 28/28 samples (100%)")
    buf = io.StringIO()
    Progress(7, "x", file=buf).close()
    assert buf.getvalue().startswith("x: 0/7 its (0%)")  # a bar that never moved says so once


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_in_place():
    term = _Terminal()
    with Progress(40, "rollout", unit="sample", file=term) as bar:
        for _ in range(4):
            bar.update(10)
        bar.write("step 1 | reward 0.5")
    text = term.getvalue()
    assert "\r" in text and "40/40" in text and "step 1 | reward 0.5\n" in text
    assert text.count("\n") <= 3  # redrawn in place: the written line and the bar's last state


def test_console_sink_prints_above_an_open_bar(capsys):
    from rlbench.metrics import build_sinks

    sink = build_sinks(LoggingConfig(console=True, jsonl_path=None))[0]
    sink.write({"rollout/raw_reward": 0.25}, step=3)
    assert capsys.readouterr().out == "step 3 | reward 0.25\n"
