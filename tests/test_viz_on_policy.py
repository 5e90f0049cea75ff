"""rlbench.viz.on_policy: per-token diffs from a real RolloutBatch (0.0 in the true on-policy mode, not without
it), decade bins, per-step series, the runs view and trainer group, result loading, the cost table."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rlbench.viz import StepController
from rlbench.viz.on_policy import (
    COST_COLUMNS,
    MISMATCH_COLUMNS,
    RunsView,
    TrainerGroup,
    cost_table,
    diff_decades,
    diff_histogram,
    e2e_cost_rows,
    eval_by_step,
    format_value,
    gradient_bias_rows,
    history_row,
    logprob_diffs,
    metric_curves,
    mismatch_runs,
    mismatch_summary,
    newest_e2e_with_mode,
    newest_result,
    step_series,
    table_html,
)


def _char_reward(response: str, label) -> float:
    return (sum(map(ord, response)) % 7) / 6


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """One scored rollout with recomputed log-probs per mode (default, true on-policy) of the tiny model."""
    from rlbench import presets
    from rlbench.configs import EvalConfig
    from rlbench.trainer import Trainer

    out = {}
    for mode in (False, True):
        workdir = str(tmp_path_factory.mktemp(f"mode{int(mode)}"))
        cfg = presets.cpu_test(model="tiny", workdir=workdir, level=1, n_eval=16)
        cfg = cfg.replace(true_on_policy_mode=mode, eval=EvalConfig(),
                          rollout=dataclasses.replace(cfg.rollout, rollout_batch_size=4, max_response_len=10),
                          batch=dataclasses.replace(cfg.batch, global_batch_size=16))
        trainer = Trainer(cfg)
        batch = trainer.rollout()
        trainer.score(batch)
        trainer.compute_log_probs(batch)
        out[mode] = batch
    return out


def test_logprob_diffs_zero_in_the_mode_nonzero_without(batches):
    for mode, batch in batches.items():
        diffs = logprob_diffs(batch)
        trained = sum(sum(s.loss_mask) for s in batch.samples)
        assert diffs.dtype == torch.float64 and diffs.numel() == trained > 0
        if mode:
            assert torch.count_nonzero(diffs) == 0
        else:
            assert torch.count_nonzero(diffs) > 0 and 0 < float(diffs.max()) < 1e-4  # fp32 rounding apart


def test_logprob_diffs_match_the_samples_and_the_signed_values(batches):
    batch = batches[False]
    signed = logprob_diffs(batch, signed=True)
    assert torch.equal(signed.abs(), logprob_diffs(batch))
    # the same values from the packs' own order: old - rollout per trained token
    pack, old = batch.packs[0][0], batch.old_log_probs[0][0]
    n = int((pack.loss_mask > 0).sum())
    expect = (old.double() - pack.rollout_log_probs.double())[pack.loss_mask > 0]
    assert torch.equal(signed[:n], expect)


def test_logprob_diffs_need_a_recompute(batches):
    batch = dataclasses.replace(batches[True], old_log_probs=None)
    with pytest.raises(ValueError, match="compute_log_probs"):
        logprob_diffs(batch)


def test_diff_decades_bins_and_histogram():
    d = torch.tensor([0.0, 0.0, 0.0, 3e-8, 5e-8, 2e-3, 1e-12, 20.0])
    bins = diff_decades(d)
    assert bins["0"] == 3 and bins["1e-8–1e-7"] == 2 and bins["1e-3–1e-2"] == 1
    assert bins["<1e-10"] == 1 and bins["≥1e1"] == 1 and sum(bins.values()) == d.numel()
    assert list(bins)[:2] == ["0", "<1e-10"]
    fig = diff_histogram({"default": d, "mode": torch.zeros(5)})
    assert [t.name for t in fig.data] == ["default", "mode"]
    assert list(fig.data[1].x) == ["0", "<1e-10", "1e-8–1e-7", "1e-3–1e-2", "≥1e1"]  # empty bins dropped
    assert list(fig.data[1].y) == [5, 0, 0, 0, 0]
    assert "default: 5 of 8 tokens non-zero" in fig.layout.title.text
    assert "mode: 0 of 5 tokens non-zero" in fig.layout.title.text


def test_step_series_x_values_and_missing_keys():
    hist = [{"rollout/id": 0.0, "a": 1.0}, {"rollout/id": 1.0}, {"rollout/id": 2.0, "a": float("nan")},
            {"rollout/id": 3.0, "a": torch.tensor(0.5)}]
    assert step_series(hist, "a") == ([1.0, 4.0], [1.0, 0.5])
    assert step_series([{"step": 7, "a": 2}, {"a": 3}], "a") == ([7.0, 2.0], [2.0, 3.0])
    fig = metric_curves({"x": hist, "y": [{"b": 1.0}]}, ["a", "b"])
    assert [(t.name, t.showlegend) for t in fig.data] == [("x", True), ("y", False)]


class FakeTrainer:
    def __init__(self, diff: float) -> None:
        self.diff, self.history, self.last_rollout, self.synced = diff, [], None, 0

    def step(self) -> dict:
        m = {"rollout/id": float(len(self.history)), "train/train_rollout_logprob_abs_diff": self.diff,
             "train/ppo_kl_first_mb": 0.0}
        self.history.append(m)
        return m

    def rollout(self):
        self.last_rollout = type("B", (), {"samples": [1, 2]})()
        return self.last_rollout

    def train_step(self, batch) -> dict:
        return {"train/loss": 1.0}

    def sync_weights(self) -> dict:
        self.synced += 1
        return {}


def test_runs_view_and_trainer_group_under_the_step_controller():
    group = TrainerGroup({"default": FakeTrainer(1e-7), "mode": FakeTrainer(0.0)})
    view = RunsView(backend="output")
    controller = StepController(group, on_step=view.update_all)
    controller.run(3)
    assert view.series("mode") == ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert view.series("default")[1] == [1e-7] * 3
    assert "mode: 3 steps, max 0 (all exactly 0.0)" in view.summary.value
    assert "default: 3 steps, max 1e-07;" in view.summary.value + ";"
    assert len(view.view.figure.data) == 2
    view.toggle.value = "train/ppo_kl_first_mb"  # what clicking the toggle does: the other metric, redrawn
    assert view.view.figure.layout.title.text == "train/ppo_kl_first_mb"
    assert "default: 3 steps, max 0 (all exactly 0.0)" in view.summary.value
    view.update("mode", {"rollout/id": 3.0, "train/ppo_kl_first_mb": 0.0})
    assert len(view.series("mode")[0]) == 4
    assert group.history["mode"] == group.trainers["mode"].history
    assert group.last_rollout is None
    assert len(controller.rollout().samples) == 4 and set(group.last_rollout.batches) == {"default", "mode"}
    assert controller.train() == {"default": {"train/loss": 1.0}, "mode": {"train/loss": 1.0}}
    controller.sync()
    assert all(t.synced == 1 for t in group.trainers.values())
    with pytest.raises(ValueError):
        TrainerGroup({})


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


GPU_JSON = {
    "date": "2026-12-02", "machine": "NVIDIA H200", "command": "python benchmarks/true_on_policy.py", "torch": "2.11",
    "rows": [
        {"preset": "p", "mode": "default", "rollout_tokens_per_s": 1000.0, "rollout_time_s": 2.0,
         "logprob_time_s": 0.5, "train_time_s": 1.0, "step_time_s": 4.0, "train_rollout_logprob_abs_diff": 7e-3,
         "ppo_kl_first_mb": 0.0, "steps": 2},
        {"preset": "p", "mode": "true_on_policy", "rollout_tokens_per_s": 500.0, "rollout_time_s": 4.0,
         "logprob_time_s": 1.0, "train_time_s": 1.5, "step_time_s": 8.0, "train_rollout_logprob_abs_diff": 0.0,
         "ppo_kl_first_mb": 0.0, "steps": 2},
        {"preset": "p", "mode": "true_on_policy_rollout_logprobs", "rollout_tokens_per_s": 500.0,
         "rollout_time_s": 4.0, "logprob_time_s": None, "train_time_s": 1.5, "step_time_s": 6.0,
         "train_rollout_logprob_abs_diff": None, "ppo_kl_first_mb": 0.0, "steps": 2},
        {"preset": "q", "mode": "true_on_policy", "rollout_tokens_per_s": 10.0, "step_time_s": 1.0},
    ],
}


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
                   "max_logprob_abs_diff": diff, "max_abs_ppo_kl_first_mb": 0.0}
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


def test_history_row_skips_the_warmup_and_table_html():
    hist = [{"perf/step_time": 9.0, "perf/rollout_tokens_per_sec": 1.0, "train/ppo_kl_first_mb": 0.0},
            {"perf/step_time": 2.0, "perf/rollout_tokens_per_sec": 100.0, "perf/log_probs_time": 0.5,
             "train/train_rollout_logprob_abs_diff": 0.0, "train/ppo_kl_first_mb": 0.0},
            {"perf/step_time": 4.0, "perf/rollout_tokens_per_sec": 300.0, "perf/log_probs_time": 0.7,
             "train/train_rollout_logprob_abs_diff": 0.0, "train/ppo_kl_first_mb": 0.0}]
    row = history_row(hist, preset="tiny", mode="true_on_policy")
    assert row["steps"] == 2 and row["step_time_s"] == 3.0 and row["rollout_tokens_per_s"] == 200.0
    assert row["logprob_time_s"] == pytest.approx(0.6) and row["train_time_s"] is None
    assert row["train_rollout_logprob_abs_diff"] == 0.0
    assert history_row(hist[:1], preset="t", mode="default")["step_time_s"] == 9.0  # too short: all steps
    html = table_html(cost_table(GPU_JSON))
    assert html.count("<tr>") == 1 + len(GPU_JSON["rows"])
    assert "×2.00" in html and ">0.007<" in html and "<td style='text-align:right;padding:2px 8px'>–</td>" in html
    assert all(header in html for _, header in COST_COLUMNS)
    assert format_value(0.0) == "0" and format_value(None) == "–" and format_value(12345.6) == "12,346"
    assert format_value(8.3e-8) == "8.30e-08"
    assert format_value(3, "steps") == "3" and format_value(0.25, "step_time_s_x") == "×0.25"
    assert "rollout tok/s" not in table_html([{"preset": "a"}])  # columns no row has are left out


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
