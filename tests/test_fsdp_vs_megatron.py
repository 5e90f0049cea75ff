"""rlbench.experiments.fsdp_vs_megatron: the feature table is probed (a refusal's own message is its cell), the
stored CP-OOM and H200 results parse to their recorded values, and a 2-step CPU run on both backends agrees at
step 0 (TP1 megatron == FSDP in fp32; measured: equal rewards, |Δ loss| 5e-10, |Δ grad norm| 9e-8).

All megatron work runs in this process over one world-of-1 gloo group, torn down at the end (as in
tests/test_megatron_backend.py).
"""

from __future__ import annotations

import csv
import json
import re

import pytest
from dist_utils import megatron_world

pytest.importorskip("megatron.core")

from rlbench.configs.backend import TrainConfig  # noqa: E402
from rlbench.experiments import EXPERIMENTS  # noqa: E402
from rlbench.experiments import fsdp_vs_megatron as fvm  # noqa: E402


@pytest.fixture(scope="module")
def world1():
    """The world of one (made by the first backend's init) and megatron's groups, torn down at the end."""
    with megatron_world():
        yield


@pytest.fixture(scope="module")
def features(world1):
    return {r["feature"]: r for r in fvm.feature_table(live=True)}


@pytest.fixture(scope="module")
def run(world1, tmp_path_factory):
    """`convergence(steps=2)` on both backends from one tiny SFT warm start (CPU fp32, one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield fvm.convergence(steps=2, workdir=str(tmp_path_factory.mktemp("fvm")))
    finally:
        torch.set_num_threads(threads)


def test_feature_cells_are_the_backends_own_answers(features):
    from rlbench.backends.megatron.backend import MegatronBackend

    assert list(next(iter(features.values()))) == list(fvm.FEATURE_COLUMNS)
    with pytest.raises(ValueError) as refused:
        MegatronBackend(TrainConfig(device="cpu", cp_size=2))
    cp = features["context parallel (CP)"]
    assert cp["Megatron"].startswith(f"no ({refused.value})") and "TransformerEngine" in cp["Megatron"]
    assert cp["FSDP"] == "yes (kernels: allgather, ring_flash_llama3)"
    assert features["tensor parallel (TP)"]["FSDP"] == "no (TrainConfig has no tensor_model_parallel_size field)"
    assert features["tensor parallel (TP)"]["Megatron"] == "yes (TP=2 accepted)"
    assert features["param dtypes on CPU"]["Megatron"].startswith("fp32; not bf16, fp16 (megatron on CPU runs fp32")
    assert features["param dtypes on CUDA"]["Megatron"] == "bf16, fp16, fp32"
    assert features["pipeline parallel (PP)"]["Megatron"].startswith("yes (1F1B) on CUDA; CPU: no (")
    assert features["Ray cluster (several trainer ranks)"]["Megatron"] == "yes"
    assert "cluster.backend='ray'" in features["TP / PP through the Trainer (one process)"]["Megatron"]
    assert features["rlbench train / Trainer (one process)"]["Megatron"] == "yes"


def test_feature_cell_follows_the_probe(monkeypatch, world1):
    """With the megatron constructor's refusals switched off, the CP cell says yes: nothing is typed in."""
    import rlbench.backends.megatron.backend as mbackend

    monkeypatch.setattr(mbackend, "_check_supported", lambda cfg, m: None)
    rows = {r["feature"]: r for r in fvm.feature_table()}
    assert rows["context parallel (CP)"]["Megatron"].startswith("yes")
    assert rows["CPU offload of the training state (cpu_offload)"]["Megatron"] == "yes"


def test_live_rows_measure_both_backends(features):
    lp = features["log-probs of one packed micro-batch (measured)"]
    assert lp["FSDP"] == lp["Megatron"] == "yes"
    assert float(re.search(r"max \|Δ log-prob\| (\S+),", lp["evidence"]).group(1)) <= 1e-6  # measured 0.0
    step = features["one training step (measured)"]
    assert step["FSDP"] == step["Megatron"] == "yes"
    assert float(re.search(r"\|Δ loss\| (\S+),", step["evidence"]).group(1)) <= 1e-6
    ckpt = features["checkpoint save -> train -> load (measured)"]
    assert ckpt["FSDP"].startswith("yes (") and "trainer_state.pt" in ckpt["FSDP"]
    assert ckpt["Megatron"] == "yes (rank0.pt, trainer_state.pt)"
    assert features["sleep -> wake_up after the load (measured)"]["FSDP"].startswith("yes (")


def test_cp_oom_table_from_the_stored_sweeps(world1):
    rows = fvm.cp_oom_table()
    by = {(r.get("sweep"), r.get("ac"), r["layout"]): r for r in rows}
    cp1 = by[("cp_oom_2026-12-02", "off", "FSDP cp1")]
    assert (cp1["source"], cp1["longest"], cp1["first_oom"], cp1["preset"]) == ("measured", "14k", "16k",
                                                                                 "qwen3-4b-shape")
    assert round(cp1["peak_gib"], 1) == 137.9
    cp2 = by[("cp_oom_2026-12-02", "off", "FSDP cp2")]
    assert (cp2["source"], cp2["longest"], cp2["first_oom"]) == ("emulated", "26k", "28k")
    assert by[("cp_oom_2026-12-02", "on", "FSDP cp4")]["longest"] == "≥ 128k"  # no OOM found: a lower bound
    assert by[("cp_oom_ac_on_2026-12-02", "on", "FSDP cp1")]["longest"] == "112k"
    assert {r["source"] for r in rows if r["layout"].startswith("FSDP cp1")} == {"measured"}
    assert {r["source"] for r in rows if r["layout"].startswith(("FSDP cp2", "FSDP cp4"))} == {"emulated"}
    mg = [r for r in rows if r["layout"].startswith("Megatron")]
    assert [r["layout"] for r in mg] == ["Megatron cp2", "Megatron cp4"]
    assert all(r["source"] == "capability check" and "TransformerEngine" in r["longest"] for r in mg)


def test_cp_oom_table_labels_a_measured_cp2(tmp_path, world1):
    sweep = tmp_path / "cp_oom_x"
    sweep.mkdir()
    cols = ("preset", "device", "cp", "emulated", "ac", "longest", "shortest_oom", "complete", "extrapolated",
            "peak_gib_at_longest", "tokens_per_s_per_gpu_at_longest")
    with open(sweep / "cp_oom_cells.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerow(("p", "cuda", 2, False, False, 6144, "", False, 9000.0, 10.5, ""))
    (row, mg) = fvm.cp_oom_table(tmp_path)
    assert (row["layout"], row["source"], row["longest"], row["first_oom"]) == ("FSDP cp2", "measured", "≥ 6k", "")
    assert (row["peak_gib"], row["tokens_per_s_per_gpu"], row["extrapolated"]) == (10.5, None, "9000")
    assert mg["layout"] == "Megatron cp2"


def test_stored_h200_result_loads(tmp_path):
    res = fvm.stored_results()["2026-12-02"]
    f, m = res["backends"]["fsdp"], res["backends"]["megatron"]
    assert len(f["steps"]) == len(m["steps"]) == 8
    assert f["steps"][0]["rollout/raw_reward"] == m["steps"][0]["rollout/raw_reward"] == 0.015625
    assert res["checks"]["step0_reward_equal"] is True
    assert round(f["summary"]["peak_memory_gb"], 1) == 32.7 and round(m["summary"]["peak_memory_gb"], 1) == 40.8
    assert round(m["summary"]["step_time_s_median"], 2) == 7.92
    rows = fvm.cost_rows({"2026-12-02": res})
    assert [(r["result"], r["backend"]) for r in rows] == [("2026-12-02", "fsdp"), ("2026-12-02", "megatron")]
    assert set(fvm.curve_runs({"x": res})) == {"fsdp x", "megatron x"}
    (tmp_path / "fsdp_vs_megatron_d").mkdir()  # a bench directory and a JSON of one date: both kept
    (tmp_path / "fsdp_vs_megatron_d" / "fsdp.jsonl").write_text(json.dumps({"rollout/raw_reward": 0.5}) + "\n")
    (tmp_path / "fsdp_vs_megatron_d.json").write_text(json.dumps(res))
    both = fvm.stored_results(tmp_path)
    assert list(both) == ["d", "d.json"] and both["d.json"] == res
    assert both["d"]["backends"]["fsdp"]["steps"] == [{"rollout/raw_reward": 0.5}] and both["d"]["checks"] == {}


def test_convergence_agrees_at_step_0(run):
    f, m = (run["backends"][n]["steps"] for n in ("fsdp", "megatron"))
    assert len(f) == len(m) == 2
    assert f[0]["rollout/raw_reward"] == m[0]["rollout/raw_reward"] > 0  # the same rollout, some correct
    assert run["checks"]["step0_reward_equal"] is True
    assert run["checks"]["step0_loss_abs_diff"] <= 1e-6
    assert run["checks"]["step0_grad_norm_abs_diff"] <= 1e-5 * f[0]["train/grad_norm"]
    assert run["checks"]["step0_logprob_diff_abs_diff"] <= 1e-6
    assert abs(f[0]["train/kl_loss"] - m[0]["train/kl_loss"]) <= 1e-6
    assert all(s["train/grad_norm"] > 0 for s in f + m)  # every step a real update
    assert run["warm_start"]["eval/pass@1"] > 0
    assert run["config"]["param_dtype"] == "fp32" and run["config"]["global_batch_size"] == 16


def test_cli_writes_a_result_the_notebook_loads(run, tmp_path, capsys):
    assert EXPERIMENTS["fsdp-vs-megatron"] == "rlbench.experiments.fsdp_vs_megatron"
    out = tmp_path / "fsdp_vs_megatron_test.json"
    assert fvm.main(["--model", run["config"]["model"], "--steps", "1", "--out", str(out),
                     "--workdir", str(tmp_path / "w")]) == 0
    assert "[megatron] step 1: raw_reward" in capsys.readouterr().out
    res = fvm.stored_results(tmp_path)["test"]
    assert res == json.loads(out.read_text())
    assert res["checks"]["step0_reward_equal"] is True
    assert [r["backend"] for r in fvm.cost_rows({"test": res})] == ["fsdp", "megatron"]


def test_two_gpu_layouts_run_on_ray():
    """`--gpus 2`: colocated Ray actors; FSDP at DP 2, megatron at TP 2 (or PP 2 with --pp 2), issue 32's runs."""
    from rlbench.configs.cluster import check_batch_layout

    cfg = fvm.run_config("tiny", "/tmp/unused", gpus=2, sequence_parallel=True)
    assert cfg.cluster.backend == "ray" and cfg.cluster.actor_num_gpus_per_node == 2 and cfg.cluster.colocate
    assert (cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size) == (2, 1)
    assert cfg.megatron.sequence_parallel
    assert check_batch_layout(cfg, cfg.cluster) == 2  # FSDP: DP 2
    assert check_batch_layout(cfg.replace(train_backend="megatron"), cfg.cluster) == 1  # TP peers share a shard
    pp = fvm.run_config("tiny", "/tmp/unused", gpus=2, pp=2)
    assert (pp.megatron.tensor_model_parallel_size, pp.megatron.pipeline_model_parallel_size) == (1, 2)
