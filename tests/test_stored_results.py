"""benchmarks/stored_results.py: the one reader of benchmarks/results/ (newest file per benchmark, the cost table and
its ratios, e2e rows, the mismatch summaries), on hand-made results with known answers and on the stored files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as notebooks and benchmarks import it
from stored_results import (  # noqa: E402
    COST_COLUMNS,
    MISMATCH_COLUMNS,
    MODES,
    RESULTS_DIR,
    cost_table,
    e2e_cost_rows,
    eval_by_step,
    gradient_bias_rows,
    history_row,
    mismatch_runs,
    mismatch_summary,
    newest_e2e_with_mode,
    newest_result,
    portable_command,
)

from rlbench.viz.on_policy import table_html  # noqa: E402

GPU_JSON = {
    "date": "2026-12-02", "machine": "NVIDIA H200", "command": "python benchmarks/true_on_policy.py", "torch": "2.11",
    "rows": [
        {"preset": "p", "mode": "default", "rollout_tokens_per_s": 1000.0, "rollout_time_s": 2.0,
         "logprob_time_s": 0.5, "train_time_s": 1.0, "step_time_s": 4.0, "train_rollout_logprob_abs_diff": 7e-3,
         "first_mb_kl_vs_rollout": 5e-3, "steps": 2},
        {"preset": "p", "mode": "true_on_policy", "rollout_tokens_per_s": 500.0, "rollout_time_s": 4.0,
         "logprob_time_s": 1.0, "train_time_s": 1.5, "step_time_s": 8.0, "train_rollout_logprob_abs_diff": 0.0,
         "first_mb_kl_vs_rollout": 0.0, "steps": 2},
        {"preset": "p", "mode": "true_on_policy_rollout_logprobs", "rollout_tokens_per_s": 500.0,
         "rollout_time_s": 4.0, "logprob_time_s": None, "train_time_s": 1.5, "step_time_s": 6.0,
         "train_rollout_logprob_abs_diff": None, "first_mb_kl_vs_rollout": 0.0, "steps": 2},
        {"preset": "q", "mode": "true_on_policy", "rollout_tokens_per_s": 10.0, "step_time_s": 1.0},
    ],
}


def test_newest_result_and_mismatch_runs(tmp_path):
    assert newest_result(tmp_path, "mismatch_") is None
    (tmp_path / "mismatch_2026-12-01_seed1.json").write_text("{}")
    assert newest_result(tmp_path, "mismatch_").name == "mismatch_2026-12-01_seed1.json"  # only a variant
    for name in ("mismatch_2026-12-01.json", "mismatch_2026-12-02.json", "mismatch_2026-12-02_seed1.json",
                 "other_2026-12-09.json"):
        (tmp_path / name).write_text("{}")
    assert newest_result(tmp_path, "mismatch_").name == "mismatch_2026-12-02.json"  # dated files before variants
    result = {"what": "x", "settings": {"standard": {"steps": [{"step": 1, "rollout/raw_reward": 0.5}], "eval": []},
                                        "tis": {"steps": [{"step": 1}, {"step": 2}]}, "broken": {"wall_s": 1.0}}}
    runs = mismatch_runs(json.loads(json.dumps(result)))
    assert list(runs) == ["standard", "tis"] and len(runs["tis"]) == 2
    assert mismatch_runs({"a": [{"step": 1}], "b": 3}) == {"a": [{"step": 1}]}
    assert mismatch_runs({"settings": {"a": [{"step": 1}]}}) == {"a": [{"step": 1}]}



def test_cost_table_ratios_against_the_default_row_of_each_preset():
    rows = cost_table(GPU_JSON)
    assert [r["mode"] for r in rows] == [r["mode"] for r in GPU_JSON["rows"]]
    assert rows[0]["step_time_s_x"] == 1.0 and rows[0]["rollout_tokens_per_s_x"] == 1.0
    assert rows[1]["step_time_s_x"] == 2.0 and rows[1]["rollout_tokens_per_s_x"] == 0.5
    assert rows[1]["logprob_time_s_x"] == 2.0 and rows[1]["train_time_s_x"] == 1.5
    assert rows[2]["step_time_s_x"] == 1.5 and rows[2]["logprob_time_s_x"] is None  # no recompute
    assert rows[3]["step_time_s_x"] is None  # preset q has no default row
    assert "step_time_s_x" not in GPU_JSON["rows"][0]  # the input is not changed
    assert cost_table(GPU_JSON["rows"][:2])[1]["step_time_s_x"] == 2.0  # the rows alone work too



def _e2e(date: str, systems: dict) -> dict:
    rows = {name: {"measured_steps": 3, "steady_step_s": step, "rollout_tokens_per_s": 1000 / step,
                   "phases_s": {"rollout": step / 2, "log_probs": 0.0, "train": step / 4},
                   "max_logprob_abs_diff": diff, "max_first_mb_kl_vs_rollout": 0.0}
            for name, (step, diff) in systems.items()}
    return {"date": date, "workload": {"model": "qwen3-0.6b-shape"}, "rows": rows}



def test_e2e_cost_rows_and_the_newest_run_with_the_mode(tmp_path):
    result = _e2e("2026-12-07", {"rlbench": (1.0, 5e-3), "rlbench-top": (1.6, 0.0), "trl": (8.0, None)})
    rows = cost_table(e2e_cost_rows(result))
    assert [(r["preset"], r["mode"]) for r in rows] == [("qwen3-0.6b-shape", "default"),
                                                         ("qwen3-0.6b-shape", "true_on_policy")]
    assert rows[1]["step_time_s_x"] == pytest.approx(1.6) and rows[1]["rollout_tokens_per_s_x"] == pytest.approx(1 / 1.6)
    assert rows[1]["train_rollout_logprob_abs_diff"] == 0.0 and rows[0]["train_rollout_logprob_abs_diff"] == 5e-3
    assert rows[1]["train_time_s"] == 0.4 and rows[1]["logprob_time_s"] == 0.0
    assert newest_e2e_with_mode(tmp_path) is None
    for name, date, systems in (("e2e_b.json", "2026-12-06", {"rlbench": (1, 0), "rlbench-top": (2, 0)}),
                                ("e2e_a.json", "2026-12-07", {"rlbench": (1, 0), "rlbench-top": (2, 0)}),
                                ("e2e_c.json", "2026-12-08", {"rlbench": (1, 0), "trl": (8, 0)})):
        (tmp_path / name).write_text(json.dumps(_e2e(date, systems)))
    assert newest_e2e_with_mode(tmp_path).name == "e2e_a.json"  # the newest date with the mode



def test_mismatch_summary_from_the_steps():
    steps = [{"step": i + 1, "rollout/raw_reward": r, "train/train_rollout_logprob_abs_diff": d}
             for i, (r, d) in enumerate([(0.2, 1e-3), (0.4, 3e-3), (0.6, 1e-3), (1.0, 3e-3)])]
    result = {"settings": {
        "standard": {"steps": steps, "config": {"engine_dtype": "bf16", "loss_mode": "standard"},
                     "eval": [{"rollout/id": 0.0, "eval/pass@1": 0.5}, {"rollout/id": 4.0, "eval/pass@1": 0.75}]},
        "bypass": {"steps": [{"step": 1, "rollout/raw_reward": 0.5}]}}}
    rows = mismatch_summary(result)
    assert [r["setting"] for r in rows] == ["standard", "bypass"]
    std, byp = rows
    assert std["steps"] == 4 and std["reward_first"] == 0.2 and std["reward_last"] == 1.0  # window: 4 // 4 = 1
    assert std["abs_diff"] == pytest.approx(2e-3) and std["engine"] == "bf16" and std["loss"] == "standard"
    assert (std["pass@1_first"], std["pass@1_last"]) == (0.5, 0.75) and std["k3_kl"] is None
    assert byp["abs_diff"] is None and byp["engine"] is None and byp["pass@1_first"] is None
    assert mismatch_summary(result, window=2)[0]["reward_last"] == pytest.approx(0.8)
    html = table_html(rows, MISMATCH_COLUMNS)
    assert html.count("<tr>") == 3 and "bf16" in html and "0.002" in html



def test_eval_by_step_rows_and_seed_means():
    runs = {"tis_seed0": [{"step": 0, "eval/pass@1": 0.3}, {"step": 20, "eval/pass@1": 0.4}],
            "tis_seed1": [{"step": 0, "eval/pass@1": 0.3}, {"step": 20, "eval/pass@1": 0.5}, {"step": 40}],
            "matched": [{"step": 20, "eval/pass@1": 0.45}]}
    rows, columns = eval_by_step(runs)
    assert columns == [("setting", "setting"), ("step 0", "eval/pass@1 @ 0"), ("step 20", "eval/pass@1 @ 20")]
    assert rows[2] == {"setting": "matched", "step 20": 0.45}
    assert rows[3]["setting"] == "tis (mean of 2)" and rows[3]["step 0"] == pytest.approx(0.3)
    assert rows[3]["step 20"] == pytest.approx(0.45) and len(rows) == 4



def test_gradient_bias_rows_read_the_summary():
    result = {"summary": {"tis": {"cos_to_g_true": {"mean": 0.58, "sd": 0.12}, "norm": {"mean": 0.35},
                                  "cos_expected_to_g_true": 0.88, "norm_expected": 0.26}}}
    assert gradient_bias_rows(result) == [{"setting": "tis", "cos": 0.58, "cos_sd": 0.12, "norm": 0.35,
                                           "cos_expected": 0.88, "norm_expected": 0.26}]


def test_history_row_skips_the_warmup_and_the_cost_table_renders():
    hist = [{"perf/step_time": 9.0, "perf/rollout_tokens_per_sec": 1.0, "train/first_mb_kl_vs_rollout": 0.0},
            {"perf/step_time": 2.0, "perf/rollout_tokens_per_sec": 100.0, "perf/log_probs_time": 0.5,
             "train/train_rollout_logprob_abs_diff": 0.0, "train/first_mb_kl_vs_rollout": 0.0},
            {"perf/step_time": 4.0, "perf/rollout_tokens_per_sec": 300.0, "perf/log_probs_time": 0.7,
             "train/train_rollout_logprob_abs_diff": 0.0, "train/first_mb_kl_vs_rollout": 0.0}]
    row = history_row(hist, preset="tiny", mode="true_on_policy")
    assert row["steps"] == 2 and row["step_time_s"] == 3.0 and row["rollout_tokens_per_s"] == 200.0
    assert row["logprob_time_s"] == pytest.approx(0.6) and row["train_time_s"] is None
    assert row["train_rollout_logprob_abs_diff"] == 0.0
    assert history_row(hist[:1], preset="t", mode="default")["step_time_s"] == 9.0  # too short: all steps
    html = table_html(cost_table(GPU_JSON), COST_COLUMNS)
    assert html.count("<tr>") == 1 + len(GPU_JSON["rows"])
    assert "×2.00" in html and ">0.007<" in html and "text-align:right;white-space:nowrap'>–</td>" in html
    assert all(header in html for _, header in COST_COLUMNS)


def test_the_stored_results_the_notebooks_load_are_found_and_read():
    """Notebook 03's newest files exist and parse into rows (a pruned or renamed file fails here, not in a notebook)."""
    for prefix in ("mismatch_", "mismatch_fp8_", "mismatch_nvfp4_", "mismatch_grad_", "true_on_policy_"):
        assert newest_result(RESULTS_DIR, prefix) is not None, prefix
    top = json.loads(newest_result(RESULTS_DIR, "true_on_policy_").read_text())
    assert {r["mode"] for r in top["rows"]} <= set(MODES)
    rows = cost_table(top)  # the ratio column is derived here from the raw times: check one by hand
    base = next(r for r in top["rows"] if r["mode"] == "default")
    mode = next(r for r in rows if r["mode"] == "true_on_policy" and r["preset"] == base["preset"])
    assert mode["step_time_s_x"] == mode["step_time_s"] / base["step_time_s"]
    e2e = json.loads(newest_e2e_with_mode(RESULTS_DIR).read_text())
    (default, top_row) = e2e_cost_rows(e2e)
    assert top_row["step_time_s"] == e2e["rows"]["rlbench-top"]["steady_step_s"]
    assert default["mode"] == "default" and top_row["mode"] == "true_on_policy"


def test_portable_command_drops_machine_paths():
    cmd = ("python3 /work/main/rlbench/cli.py experiment fsdp-vs-megatron --lr 1e-5 --workdir /tmp/fvm06 "
           "--out /root/out/fsdp_vs_megatron_2026-12-02_sft500.json --ratio 1/2 http://x/y")
    assert portable_command(cmd) == (
        "python3 rlbench/cli.py experiment fsdp-vs-megatron --lr 1e-5 --workdir fvm06 "
        "--out fsdp_vs_megatron_2026-12-02_sft500.json --ratio 1/2 http://x/y")
    assert portable_command("benchmarks/mismatch.py --steps 3") == "benchmarks/mismatch.py --steps 3"
