"""rlbench.viz.on_policy: per-token diffs from a real RolloutBatch (0.0 in the true on-policy mode, not without
it), decade bins, per-step series, the runs view and trainer group, table cells of plain rows (the result files
are read by benchmarks/stored_results.py: tests/test_stored_results.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlbench.viz import StepController
from rlbench.viz.figures import step_dtick
from rlbench.viz.on_policy import (
    RunsView,
    TrainerGroup,
    diff_decades,
    diff_histogram,
    format_value,
    logprob_diffs,
    metric_curves,
    step_series,
    table_html,
)


def _char_reward(response: str, label) -> float:
    return (sum(map(ord, response)) % 7) / 6


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """One scored rollout with recomputed log-probs per mode (default, true on-policy) of the tiny model."""
    from rlbench import Trainer, presets
    from rlbench.configs import EvalConfig

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
    assert [(t.name, t.showlegend) for t in fig.data] == [("x", True), ("y", True)]  # y has no line in "a"


def test_metric_curves_name_every_run_once_and_keep_identical_runs_apart():
    same = [{"rollout/id": float(i), "a": 0.0, "b": 1.0} for i in range(3)]
    fig = metric_curves({"p": same, "q": same, "r": same[:1]}, ["a", "b"])
    assert [(t.name, t.showlegend) for t in fig.data] == [("p", True), ("q", True), ("r", True),
                                                         ("p", False), ("q", False), ("r", False)]
    styles = {(t.line.dash, t.marker.symbol) for t in fig.data[:3]}
    assert len(styles) == 3  # identical values, yet three distinguishable lines
    assert fig.layout.xaxis.dtick == 1 and fig.layout.xaxis2.dtick == 1  # steps 1..3: integer ticks
    assert step_dtick(3) == 1 and step_dtick(10) == 1 and step_dtick(11) == 2 and step_dtick(100) == 10
    assert step_dtick(101) == 20 and step_dtick(0) == 1 and step_dtick(240) == 50


class FakeTrainer:
    def __init__(self, diff: float) -> None:
        self.diff, self.history, self.last_rollout, self.synced = diff, [], None, 0

    def step(self) -> dict:
        m = {"rollout/id": float(len(self.history)), "train/train_rollout_logprob_abs_diff": self.diff,
             "train/first_mb_kl_vs_rollout": 0.0}
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
    view.toggle.value = "train/first_mb_kl_vs_rollout"  # what clicking the toggle does: the other metric, redrawn
    assert view.view.figure.layout.title.text == "train/first_mb_kl_vs_rollout"
    assert "default: 3 steps, max 0 (all exactly 0.0)" in view.summary.value
    view.update("mode", {"rollout/id": 3.0, "train/first_mb_kl_vs_rollout": 0.0})
    assert len(view.series("mode")[0]) == 4
    assert group.history["mode"] == group.trainers["mode"].history
    assert group.last_rollout is None
    assert len(controller.rollout().samples) == 4 and set(group.last_rollout.batches) == {"default", "mode"}
    assert controller.train() == {"default": {"train/loss": 1.0}, "mode": {"train/loss": 1.0}}
    controller.sync()
    assert all(t.synced == 1 for t in group.trainers.values())
    with pytest.raises(ValueError):
        TrainerGroup({})


def test_table_html_and_cell_formats():
    rows = [{"mode": "default", "step_time_s": 2.0, "step_time_s_x": 1.0, "diff": 7e-3},
            {"mode": "mode", "step_time_s": 4.0, "step_time_s_x": 2.0, "diff": None}]
    html = table_html(rows, [("mode", "mode"), ("step_time_s", "step s"), ("step_time_s_x", "× default"),
                             ("diff", "|diff|"), ("absent", "never shown")])
    assert html.count("<tr>") == 1 + len(rows) and "never shown" not in html  # columns no row has are left out
    number = "<td style='padding:2px 8px;vertical-align:top;text-align:right;white-space:nowrap'>"
    assert "×2.00" in html and f"{number}0.007<" in html and f"{number}–</td>" in html
    assert html.startswith("<div class='rlbench-table-box' style='overflow-x:auto")  # wide tables scroll
    long = table_html([{"evidence": "ran: " + "tests/x.py::test_y " * 5, "n": 1}], [("evidence", "e"), ("n", "n")])
    assert "text-align:left;white-space:normal;overflow-wrap:anywhere;min-width:8em;max-width:28em'>ran: tests" in long
    folded = table_html([{"evidence": "yes (ran: " + "x" * 50 + ")"}], [("evidence", "e")], fold_chars=12)
    assert "<details><summary>yes (ran: xx…</summary>yes (ran: " + "x" * 50 + ")</details>" in folded
    assert format_value(0.0) == "0" and format_value(None) == "–" and format_value(12345.6) == "12,346"
    assert format_value(8.3e-8) == "8.30e-08"
    assert format_value(3, "steps") == "3" and format_value(0.25, "step_time_s_x") == "×0.25"
