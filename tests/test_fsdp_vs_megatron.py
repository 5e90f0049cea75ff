"""benchmarks/backend_features.py and benchmarks/fsdp_vs_megatron.py: a feature cell says "yes" only with named
evidence that exists (a refusal's own message is a "no"; an accepted setting without evidence is "unverified"),
the measured rows can say "no", the stored results' summaries are recomputed from their raw steps and quoted
as such by docs/megatron.md, and a 2-step CPU run on both backends agrees at step 0 (TP1 megatron == FSDP in
fp32; measured: equal rewards, |Δ loss| 5e-10, |Δ grad norm| 9e-8).

All megatron work runs in this process over one world-of-1 gloo group, torn down at the end (as in
tests/test_megatron_backend.py).
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest
from dist_utils import megatron_world

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # the benchmarks import each other by name, as notebooks do (appended: never shadows a package)
import backend_features as bf  # noqa: E402
import fsdp_vs_megatron as fvm  # noqa: E402
import stored_results as sr  # noqa: E402

from rlbench.configs.backend import TrainConfig  # noqa: E402
from rlbench.experiments import EXPERIMENTS, load_benchmark, run_experiment  # noqa: E402

UNVERIFIED = "accepted; no test or stored run exercises it)"


@pytest.fixture(scope="module")
def world1():
    """The world of one (made by the first backend's init) and megatron's groups, torn down at the end."""
    with megatron_world():
        yield


@pytest.fixture(scope="module")
def features(world1):
    return {r["feature"]: r for r in bf.feature_table(live=True)}


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

    assert list(next(iter(features.values()))) == list(bf.FEATURE_COLUMNS)
    with pytest.raises(ValueError) as refused:
        MegatronBackend(TrainConfig(device="cpu", cp_size=2))
    cp = features["context parallel (CP)"]
    assert cp["Megatron"].startswith(f"no ({refused.value})") and "TransformerEngine" in cp["Megatron"]
    assert cp["FSDP"] == ("yes (cp=2; kernels: allgather, ring_flash_llama3; "
                          "ran: tests/test_cp_train.py::test_params_match_cp1_and_cp_peers_agree)")
    assert features["tensor parallel (TP)"]["FSDP"] == "no (TrainConfig has no tensor_model_parallel_size field)"
    assert features["tensor parallel (TP)"]["Megatron"] == (
        "yes (TP=2; ran: tests/test_megatron_backend.py::test_tensor_parallel_training_matches_tp1[tp2])")
    assert features["param dtypes accepted on CPU"]["Megatron"].startswith(
        "fp32; not bf16, fp16 (megatron on CPU runs fp32")
    assert features["param dtypes accepted on CUDA"]["Megatron"] == "bf16, fp16, fp32"
    # run on 2 gloo CPU ranks (fp32), accepted on CUDA and CPU
    assert features["pipeline parallel (PP)"]["Megatron"] == (
        "yes (PP=2, 1F1B; ran: tests/test_megatron_backend.py::test_pipeline_parallel_pp2_matches_tp1)")
    assert features["optimizer-state sharding (ZeRO-1)"]["Megatron"] == (
        "yes (use_distributed_optimizer; ran: "
        "tests/test_megatron_backend.py::test_distributed_optimizer_matches_the_plain_optimizer)")
    assert features["activation recompute"]["Megatron"].startswith("unverified (recompute_granularity: full, selective")
    assert features["Ray cluster (several trainer ranks)"]["Megatron"] == (
        "yes (ran: tests/test_ray.py::test_megatron_on_ray_matches_single_process)")
    assert "cluster.backend='ray'" in features["TP / PP through the Trainer (one process)"]["Megatron"]
    assert features["rlbench train / Trainer (one process)"]["Megatron"] == (
        "yes (ran: tests/test_fsdp_vs_megatron.py::test_convergence_agrees_at_step_0, "
        "benchmarks/results/fsdp_vs_megatron_2026-12-02_sft500.json)")


def test_every_named_evidence_exists():
    refs = [r for refs in bf.EVIDENCE.values() for r in refs]
    assert refs and [r for r in refs if not bf.evidence_exists(r)] == []
    assert not bf.evidence_exists("tests/test_ray.py::test_no_such_test")
    assert not bf.evidence_exists("tests/test_megatron_backend.py::test_tensor_parallel_training_matches_tp1[tp4]")
    assert not bf.evidence_exists("benchmarks/results/no_such_result.json")


def test_no_yes_without_evidence(monkeypatch, world1):
    """Without EVIDENCE, no probed cell says yes; a named id that does not exist is reported, not believed."""
    monkeypatch.setattr(bf, "EVIDENCE", {})
    verdicts = bf.cells_by_verdict(bf.feature_table())
    assert "yes" not in verdicts and len(verdicts["unverified"]) >= 10
    monkeypatch.setattr(bf, "EVIDENCE", {("tensor parallel (TP)", "megatron"): ("tests/test_gone.py::test_tp",)})
    tp = {r["feature"]: r for r in bf.feature_table()}["tensor parallel (TP)"]["Megatron"]
    assert tp == ("unverified (TP=2 accepted; no test or stored run exercises it; named evidence not found: "
                  "tests/test_gone.py::test_tp)")


def test_feature_cell_follows_the_probe(monkeypatch, world1):
    """With the megatron constructor's refusals switched off, the CP cell is no longer a "no", and (nothing having
    run it) not a "yes" either: nothing is typed in."""
    import rlbench.backends.megatron.backend as mbackend

    monkeypatch.setattr(mbackend, "_check_supported", lambda cfg, m: None)
    rows = {r["feature"]: r for r in bf.feature_table()}
    assert rows["context parallel (CP)"]["Megatron"].startswith(f"unverified (cp=2 {UNVERIFIED}")
    assert rows["CPU offload of the training state (cpu_offload)"]["Megatron"] == f"unverified ({UNVERIFIED}"


def test_live_rows_measure_both_backends(features):
    lp = features["log-probs of one packed micro-batch (measured)"]
    assert lp["FSDP"] == lp["Megatron"] == "yes"
    assert float(re.search(r"max \|Δ log-prob\| (\S+),", lp["evidence"]).group(1)) <= 1e-6  # measured 0.0
    step = features["one training step (measured)"]
    assert step["FSDP"] == step["Megatron"] == "yes"
    assert float(re.search(r"\|Δ loss\| (\S+) ", step["evidence"]).group(1)) <= 1e-6
    moved = re.search(r"moved by the step: max (\S+) \(FSDP\) / (\S+) \(Megatron\)", step["evidence"])
    assert float(moved.group(1)) > 0 and float(moved.group(2)) > 0
    ckpt = features["checkpoint save -> train -> load (measured)"]
    assert ckpt["FSDP"].startswith("yes (") and "trainer_state.pt" in ckpt["FSDP"]
    assert ckpt["Megatron"] == "yes (rank0.pt, trainer_state.pt)"
    assert features["sleep -> wake_up after the load (measured)"]["FSDP"].startswith("yes (")


def test_training_step_cell_can_say_no():
    ok = {"train/skipped": 0.0}
    assert bf.training_step_cell(ok, moved=1e-3, loss_gap=0.0, tol=1e-5) == "yes"
    assert bf.training_step_cell({"train/skipped": 1.0}, 1e-3, 0.0, 1e-5) == "no (step skipped)"
    assert bf.training_step_cell(ok, 0.0, 0.0, 1e-5).startswith("no (the weights did not move")
    assert bf.training_step_cell(ok, 1e-3, 1e-2, 1e-5) == "no (|Δ loss| 1.0e-02 vs the other backend > 1e-05)"


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


def test_stored_summaries_are_recomputed_from_the_raw_steps_and_quoted_by_the_docs():
    """The stored comparison's summary and step-0 checks, recomputed by the reader from its per-step rows, equal
    what the run wrote; docs/megatron.md quotes those numbers."""
    res = sr.fsdp_vs_megatron_results()["2026-12-02_sft500"]
    for name, run in res["backends"].items():
        recomputed = sr.summarize(run["steps"])
        assert recomputed == {k: run["summary"][k] for k in recomputed}, name
    assert sr.checks(res["backends"]) == res["checks"]
    assert res["warm_start"]["sft/step"] == 500  # the warm start notebook 04 and docs/megatron.md describe
    f, m = (res["backends"][b]["summary"] for b in ("fsdp", "megatron"))
    doc = (ROOT / "docs" / "megatron.md").read_text()
    quoted = (f"median step {f['step_time_s_median']:.2f} s (FSDP) vs {m['step_time_s_median']:.2f} s (Megatron)",
              f"peak {f['peak_memory_gb']:.1f} vs {m['peak_memory_gb']:.1f} GiB")
    assert [q for q in quoted if q not in doc] == []


def test_stored_directory_and_json_results_are_both_read(tmp_path):
    res = sr.fsdp_vs_megatron_results()["2026-12-02"]  # a directory of per-backend jsonl: summaries computed here
    steps = res["backends"]["megatron"]["steps"]
    assert res["backends"]["megatron"]["summary"]["steps"] == len(steps) == 8
    assert res["checks"]["step0_reward_equal"] == (steps[0]["rollout/raw_reward"]
                                                   == res["backends"]["fsdp"]["steps"][0]["rollout/raw_reward"])
    rows = sr.fvm_cost_rows({"2026-12-02": res})
    assert [(r["result"], r["backend"]) for r in rows] == [("2026-12-02", "fsdp"), ("2026-12-02", "megatron")]
    assert set(sr.curve_runs({"x": res})) == {"fsdp x", "megatron x"}
    (tmp_path / "fsdp_vs_megatron_d").mkdir()  # a bench directory and a JSON of one date: both kept
    (tmp_path / "fsdp_vs_megatron_d" / "fsdp.jsonl").write_text(json.dumps({"rollout/raw_reward": 0.5}) + "\n")
    (tmp_path / "fsdp_vs_megatron_d.json").write_text(json.dumps(res))
    both = sr.fsdp_vs_megatron_results(tmp_path)
    assert list(both) == ["d", "d.json"] and both["d.json"] == res
    assert both["d"]["backends"]["fsdp"]["steps"] == [{"rollout/raw_reward": 0.5}] and both["d"]["checks"] == {}
    with pytest.raises(ValueError, match="neither a result JSON nor a directory"):
        sr.load_fvm_result(tmp_path)


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
    assert EXPERIMENTS["fsdp-vs-megatron"] == "benchmarks/fsdp_vs_megatron.py"
    assert load_benchmark("benchmarks/fsdp_vs_megatron.py") is fvm  # the CLI runs the module the notebook imports
    out = tmp_path / "fsdp_vs_megatron_test.json"
    assert run_experiment(["fsdp-vs-megatron", "--model", run["config"]["model"], "--steps", "1", "--out", str(out),
                           "--workdir", str(tmp_path / "w")]) == 0
    assert "[megatron] step 1: raw_reward" in capsys.readouterr().out
    res = sr.fsdp_vs_megatron_results(tmp_path)["test"]
    assert res == json.loads(out.read_text())
    assert res["checks"]["step0_reward_equal"] is True
    assert [r["backend"] for r in sr.fvm_cost_rows({"test": res})] == ["fsdp", "megatron"]


def test_two_gpu_run_config_layouts():
    """Config only, nothing runs here: `--gpus 2` builds colocated Ray actors, FSDP at DP 2, megatron at TP 2 (or
    PP 2 with --pp 2). The two-GPU runs themselves are `benchmarks/gpu_suite.sh fvm fvm2` (none stored yet)."""
    from rlbench.configs.cluster import check_batch_layout

    cfg = fvm.run_config("tiny", "/tmp/unused", gpus=2, sequence_parallel=True)
    assert cfg.cluster.backend == "ray" and cfg.cluster.actor_num_gpus_per_node == 2 and cfg.cluster.colocate
    assert (cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size) == (2, 1)
    assert cfg.megatron.sequence_parallel
    assert check_batch_layout(cfg, cfg.cluster) == 2  # FSDP: DP 2
    assert check_batch_layout(cfg.replace(train_backend="megatron"), cfg.cluster) == 1  # TP peers share a shard
    pp = fvm.run_config("tiny", "/tmp/unused", gpus=2, pp=2)
    assert (pp.megatron.tensor_model_parallel_size, pp.megatron.pipeline_model_parallel_size) == (1, 2)
