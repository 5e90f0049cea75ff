"""Widget logic without a browser: dashboard updates, controller callbacks / stop flag, viewer, re-packing."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from rlbench import packing  # noqa: E402
from rlbench.types import Sample, Status  # noqa: E402
from rlbench.viz import LiveDashboard, PackingInspector, RolloutViewer, StepController  # noqa: E402
from rlbench.viz._display import PLOTLY_MIME, FigureView, resolve_backend  # noqa: E402
from rlbench.viz.packing_plan import (  # noqa: E402
    cp_segments,
    cp_work,
    first_fit_packs,
    padding_waste,
    plan_packing,
)
from rlbench.viz.packing_view import cp_figure, packs_figure  # noqa: E402
from rlbench.viz.rollout_view import (  # noqa: E402
    advantage_color,
    call_label,
    group_html,
    logprob_color,
    mask_runs,
)


def metrics(i: int) -> dict:
    return {"rollout/id": i, "rollout/raw_reward": 0.1 * i, "train/ppo_kl": 0.0, "train/grad_norm": 1.0 + i,
            "perf/rollout_time": 1.0, "perf/train_time": 2.0, "perf/step_time": 3.5}


class FakeTrainer:
    """Trainer-shaped fake: step() returns a metric dict; optionally blocks until released."""

    def __init__(self, gate: threading.Semaphore | None = None, fail_at: int | None = None) -> None:
        self.history: list[dict] = []
        self.gate, self.fail_at = gate, fail_at
        self.last_rollout = None
        self.calls: list[str] = []

    def step(self) -> dict:
        if self.gate is not None:
            assert self.gate.acquire(timeout=10)
        if self.fail_at is not None and len(self.history) == self.fail_at:
            raise FloatingPointError("loss is nan")
        m = metrics(len(self.history))
        self.history.append(m)
        return m

    def rollout(self):
        self.calls.append("rollout")
        self.last_rollout = make_samples()
        return self.last_rollout

    def score(self, batch):
        self.calls.append(f"score({len(batch)})")

    def train_step(self, batch):
        self.calls.append(f"train({len(batch)})")
        return {"train/loss": 0.5}

    def sync_weights(self):
        self.calls.append("sync")
        return {"perf/update_weights_time": 0.1}


def make_samples(n_groups: int = 2, n: int = 2) -> list[Sample]:
    out = []
    for g in range(n_groups):
        for j in range(n):
            out.append(Sample(tokens=[5, 6, 7, 60 + j, 61 + j], response_length=2, rollout_log_probs=[0.0, -2.0],
                              reward=float(j), advantage=1.0 if j else -1.0, group_index=g, index=g * n + j,
                              weight_version=3, status=Status.TRUNCATED, prompt=f"<b>q{g}</b>"))
    return out


# ---- LiveDashboard -------------------------------------------------------------------------------
def test_dashboard_update_appends_present_series_only():
    d = LiveDashboard(backend="output")
    d.update(metrics(0))
    d.update({"rollout/id": 1, "rollout/raw_reward": 0.7, "train/ppo_kl": float("nan")})
    assert d.steps == [0.0, 1.0]
    assert d.points["reward: train"] == ([0.0, 1.0], [0.0, 0.7])
    assert d.n_points("PPO KL (old vs new): ppo_kl") == 1  # NaN skipped
    assert d.n_points("grad norm: grad_norm") == 1  # missing key skipped
    assert "ref KL: ref_kl" not in d.points
    assert set(d.phases) == {"rollout", "train"}  # perf/step_time is the total, not a phase
    assert "data-steps='2'" in d.counter.value
    empty = {a.name[len("empty: "):] for a in d.view.figure.layout.annotations if a.name and a.visible}
    assert "ref KL" in empty and "reward" not in empty and "step-phase time (s)" not in empty


def test_dashboard_figure_follows_points_and_stacks_phases():
    d = LiveDashboard([metrics(0), metrics(1)], backend="output")
    fig = d.view.figure
    reward = next(t for t in fig.data if t.name == "reward: train")
    assert list(reward.x) == [0.0, 1.0] and list(reward.y) == pytest.approx([0.0, 0.1])
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert bars == {"rollout": [1.0, 1.0], "train": [2.0, 2.0]}
    assert fig.layout.barmode == "stack"
    (out,) = d.view.widget.outputs  # the Output backend re-rendered the figure as plotly JSON
    spec = out["data"][PLOTLY_MIME]
    assert [len(t.get("x", [])) for t in spec["data"] if t.get("name") == "reward: train"] == [2]


def test_dashboard_accepts_tensor_and_numpy_scalars():
    torch = pytest.importorskip("torch")
    import numpy as np

    d = LiveDashboard(backend="output")
    d.update({"rollout/raw_reward": torch.tensor(0.25), "train/entropy": np.float32(1.5)})
    assert d.points["reward: train"][1] == [0.25]
    assert d.points["entropy: entropy"][1] == [1.5]


def test_figure_view_backend_validation():
    with pytest.raises(ValueError, match="backend='bogus'"):
        resolve_backend("bogus")
    view = FigureView(packs_figure(plan_packing([3, 4], max_tokens_per_gpu=8)), backend="output")
    assert view.widget.outputs[0]["output_type"] == "display_data"


def test_figure_view_throttles_streaming_updates_and_lands_the_last():
    import time

    import plotly.graph_objects as go

    view = FigureView(go.Figure(go.Scatter(x=[0], y=[0])), backend="output", min_interval_s=0.3)
    assert view.pushes == 1 and view.widget.outputs[0]["data"][PLOTLY_MIME]["layout"]["height"] == 400
    assert view.widget.outputs[0]["data"][PLOTLY_MIME]["config"]["responsive"] is False  # a reload keeps the height
    for i in range(1, 20):  # a fast stream: one push now at most, the rest wait for the timer
        view.figure.data[0].x, view.figure.data[0].y = list(range(i + 1)), list(range(i + 1))
        view.refresh(throttle=True)
    assert view.pushes == 1
    deadline = time.monotonic() + 5
    while view.pushes < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert view.pushes == 2  # one timer push carried the newest state
    assert len(view.widget.outputs[0]["data"][PLOTLY_MIME]["data"][0]["x"]) == 20
    view.refresh()  # a direct refresh (a click, a toggle) is never held back
    assert view.pushes == 3


def test_dashboard_long_run_pushes_a_few_times_not_per_step():
    d = LiveDashboard(backend="output")
    d.view.min_interval_s = 3600.0  # a clock-free check: every update lands inside one interval
    first = d.view.pushes
    for i in range(100):
        d.update(metrics(i))
    assert d.view.pushes == first and d.n_points("reward: train") == 100  # state kept, page not yet redrawn
    d.view.flush()  # what the timer does at the end of the interval
    assert d.view.pushes == first + 1
    spec = d.view.widget.outputs[0]["data"][PLOTLY_MIME]
    assert [len(t["x"]) for t in spec["data"] if t.get("name") == "reward: train"] == [100]
    assert spec["layout"]["xaxis"]["dtick"] == 10  # integer step ticks, at most ~10 of them


def test_figure_widget_backend_restyles_in_place():
    pytest.importorskip("anywidget")
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=[0], y=[1], name="a"), go.Scatter(x=[0], y=[2], name="b")])
    fig.update_layout(height=300)
    view = FigureView(fig, backend="figurewidget", min_interval_s=0)
    fw = view.widget
    uids = [t.uid for t in fw.data]
    assert fw.layout.height == 300 and [t.y for t in fw.data] == [(1,), (2,)]
    fig.data[0].x, fig.data[0].y = [0, 1], [1, 5]
    view.refresh()
    assert [t.uid for t in fw.data] == uids and fw.data[0].y == (1, 5) and fw.data[1].y == (2,)  # same traces
    # the stored state a reloaded page draws from follows too (plotly itself stores it only when built)
    assert [list(t["y"]) for t in fw._widget_data] == [[1, 5], [2]] and fw._widget_layout["height"] == 300
    view.figure = go.Figure(go.Bar(x=[1], y=[1], name="c"), layout={"height": 200})
    view.refresh()  # another set of traces: rebuilt
    assert [t.name for t in fw.data] == ["c"] and fw.layout.height == 200 and fw._widget_layout["height"] == 200


# ---- StepController ------------------------------------------------------------------------------
def test_controller_step_fires_callbacks_and_updates_dashboard():
    trainer, d = FakeTrainer(), LiveDashboard(backend="output")
    seen = []
    c = StepController(trainer, on_step=[d.update, seen.append])
    out = c.run(3)
    assert [m["rollout/id"] for m in out] == [0, 1, 2]
    assert seen == trainer.history and d.n_points("reward: train") == 3
    assert c.progress.value == 3 and c.progress.max == 3 and c.steps_done == 3


def test_controller_button_runs_in_background_and_stop_flag_ends_run():
    gate = threading.Semaphore(0)
    c = StepController(FakeTrainer(gate))
    done_one = threading.Event()
    c.on_step(lambda m: (c.stop(), done_one.set()))  # ask to stop as soon as step 1 finishes
    c.n_box.value = 50
    c.buttons["run"].click()
    assert c.running and c.buttons["step"].disabled  # the click returned while the worker runs
    gate.release()
    assert done_one.wait(10)
    gate.release()  # would let a second step through if the stop flag were ignored
    c.wait(10)
    assert c.steps_done == 1 and len(c.trainer.history) == 1
    assert "stopped after 1/50" in c.status.value
    assert not c.buttons["step"].disabled


def test_controller_busy_second_start_is_refused():
    gate = threading.Semaphore(0)
    c = StepController(FakeTrainer(gate))
    assert c.start(c.run, 1) is not None
    assert c.start(c.run, 1) is None and "busy" in c.status.value
    gate.release()
    c.wait(10)
    assert c.steps_done == 1


def test_controller_error_is_reported_and_reraised_by_wait():
    c = StepController(FakeTrainer(fail_at=1))
    c.buttons["run"].click()
    with pytest.raises(RuntimeError, match="loss is nan"):
        c.wait(10)
    assert "FloatingPointError: loss is nan" in c.status.value and c.steps_done == 1


def test_controller_sub_steps_call_trainer():
    trainer = FakeTrainer()
    c = StepController(trainer)
    with pytest.raises(RuntimeError, match="press Rollout"):
        c.train()
    c.rollout()
    assert c.train() == {"train/loss": 0.5}
    c.sync()
    assert trainer.calls == ["rollout", "score(4)", "train(4)", "sync"]  # Rollout scores: Train has advantages
    with pytest.raises(TypeError, match="callable"):
        c.on_step(3)


def test_widgets_render_as_last_expression():
    c = StepController(FakeTrainer())
    bundle = c._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == c.widget.model_id


# ---- RolloutViewer -------------------------------------------------------------------------------
def test_group_html_colours_and_escapes():
    html = group_html(make_samples()[:2], None, "logprob")
    assert "&lt;b&gt;q0&lt;/b&gt;" in html and "<b>q0</b>" not in html  # prompt escaped
    assert html.count("class='rlbench-tok'") == 4
    assert logprob_color(0.0) in html and logprob_color(-2.0) in html
    assert logprob_color(0.0) == "hsl(120, 75%, 80%)" and logprob_color(-1e9) == "hsl(0, 75%, 80%)"
    assert "truncated" in html and "v3" in html


def test_advantage_colours_diverge():
    assert advantage_color(1.0, 1.0) == "hsl(210, 80%, 65%)"
    assert advantage_color(-1.0, 1.0) == "hsl(0, 80%, 65%)"
    assert advantage_color(0.0, 1.0) == "hsl(210, 80%, 100%)"
    html = group_html(make_samples()[:2], None, "advantage")
    assert html.count("hsl(0, 80%, 65%)") == 2 and html.count("hsl(210, 80%, 65%)") == 2


def test_multi_turn_samples_show_turns_tool_calls_and_masked_observations():
    """Two model turns around one observation: the observation's tokens sit in a grey block labelled with its call
    and "loss mask 0", uncoloured; the model's tokens keep their log-prob colours; the turn count is in the stats."""
    mask = [1, 1, 0, 0, 0, 1]
    s = Sample(tokens=[9, 1, 2, 3, 4, 5, 6], response_length=6, loss_mask=mask,
               rollout_log_probs=[-0.1, -0.2, 0.0, 0.0, 0.0, -3.0], reward=1.0, status=Status.COMPLETED,
               metadata={"turns": 2, "finish_reason": "stop", "tool_calls": [
                   {"turn": 1, "name": "calculator", "arguments": {"expression": "1+2"}, "error": "timeout",
                    "output": "x"}]})
    assert mask_runs(mask) == [(0, 2, 1), (2, 5, 0), (5, 6, 1)] and mask_runs([]) == []
    assert call_label(s.metadata["tool_calls"][0]) == "turn 1: calculator(expression='1+2') → timeout"
    assert call_label({"turn": 2, "name": None, "arguments": None, "error": "malformed"}) == (
        "turn 2: (malformed call)() → malformed")
    html = group_html([s], None, "logprob")
    assert html.count("class='rlbench-obs'") == 1 and html.count("class='rlbench-tok'") == 6
    before, rest = html.split("class='rlbench-obs'")
    obs, after = rest.split("</span></div>", 1)
    assert "turn 1: calculator(expression=&#x27;1+2&#x27;) → timeout · 3 tokens · loss mask 0" in obs
    assert obs.count("class='rlbench-tok'") == 3 and "background:" not in obs.split("</div>", 1)[1]  # uncoloured
    assert logprob_color(-0.1) in before and logprob_color(-3.0) in after and "rlbench-tok" in after
    assert "2 turns" in html
    zeroed = Sample(tokens=[9, 1, 2], response_length=2, loss_mask=[0, 0], rollout_log_probs=[-0.1, -0.2])
    assert "rlbench-obs" not in group_html([zeroed], None, "logprob")  # a mask zeroed whole is not an observation


def test_rollout_viewer_follows_trainer_and_controls():
    trainer = FakeTrainer()
    v = RolloutViewer(trainer)
    assert v.group.options == () and "0 samples" in v.summary.value
    trainer.rollout()
    v.refresh({"rollout/id": 0})  # as an on_step callback: a metrics dict means "re-read the trainer"
    assert [val for _, val in v.group.options] == [0, 1] and v.group.value == 0
    v.group.value = 1
    assert "q1" in v.body.value and "q0" not in v.body.value
    v.color.value = "advantage"
    assert "hsl(210, 80%, 65%)" in v.body.value
    with pytest.raises(ValueError, match="color_by"):
        RolloutViewer([], color_by="reward")


# ---- packing -------------------------------------------------------------------------------------
LENGTHS = [700, 120, 50, 900, 300, 64, 480, 33, 256, 100, 610, 90]


def test_plan_matches_library_counts_and_budget():
    plan = plan_packing(LENGTHS, max_tokens_per_gpu=1000, dp_size=2, cp_size=1)
    expected = max(packing.num_micro_batches([LENGTHS[i] for i in pos], max_tokens=1000)
                   for pos in packing.split_by_dp(LENGTHS, 2, balance=True))
    assert plan.n_micro_batches == expected == 2
    flat = sorted(i for rank in plan.ranks for pack in rank for i in pack)
    assert flat == list(range(len(LENGTHS)))
    assert all(plan.pack_tokens(r, m) <= 1000 for r in range(2) for m in range(len(plan.ranks[r])))
    s = plan.summary()
    assert s["tokens"] == sum(LENGTHS) and s["pad_tokens"] == 0
    assert s["budget_fill"] == pytest.approx(sum(LENGTHS) / (2 * 2 * 1000))


def test_plan_summary_hand_computed():
    # dp=2 round-robin: rank0 = [10, 30], rank1 = [20, 40]; cp=2 aligns every slot to 2*cp = 4 tokens.
    plan = plan_packing([10, 20, 30, 40], max_tokens_per_gpu=50, dp_size=2, cp_size=2, balance_dp=False)
    assert plan.ranks == [[[0, 2]], [[1, 3]]]
    assert plan.cu_seqlens(0, 0) == [0, 12, 44] and plan.cu_seqlens(1, 0) == [0, 20, 60]
    s = plan.summary()
    assert s["pad_tokens"] == 4 and s["n_micro_batches"] == 1
    assert s["rank_imbalance"] == pytest.approx(60 / 50) and s["pack_imbalance"] == pytest.approx(60 / 50)
    assert s["lockstep_idle"] == pytest.approx(1 - 100 / (2 * 60))
    assert s["budget_fill"] == pytest.approx(100 / (1 * 2 * 100))


def test_first_fit_vs_kk_and_padding_waste():
    assert first_fit_packs([6, 5, 4, 3], 10) == [[0, 2], [1, 3]]
    assert padding_waste([1, 3, 2, 2], 2) == pytest.approx(1 - 8 / 10)
    ff = plan_packing(LENGTHS, max_tokens_per_gpu=1000, packer="first-fit")
    kk = plan_packing(LENGTHS, max_tokens_per_gpu=1000)
    assert ff.n_micro_batches == kk.n_micro_batches == packing.first_fit_count(LENGTHS, 1000)
    fullest = [max(p.pack_tokens(0, m) for m in range(p.n_micro_batches)) for p in (ff, kk)]
    assert fullest[0] == 1000  # first-fit in order: 900 + 100 fill pack 2 to the brim
    assert -(-sum(LENGTHS) // 4) <= fullest[1] == 933  # KK: close to the mean of 925.75


def test_cp_work_zigzag_is_balanced():
    pack = packing.pad_for_cp(packing.pack_samples([[0] * 16]), 2, zigzag=True)
    assert cp_work(pack, 2) == [10 + 58, sum(range(5, 13))] == [68, 68]
    contiguous = packing.pad_for_cp(packing.pack_samples([[0] * 16]), 2, zigzag=False)
    assert cp_work(contiguous, 2, zigzag=False) == [36, 100]


def test_packs_figure_segments_and_cp_figure():
    plan = plan_packing([10, 21], max_tokens_per_gpu=50, cp_size=2, sample_ids=[7, 8])
    seqs, pad = packs_figure(plan).data
    assert list(seqs.y) == [10, 21] and list(seqs.base) == [0, 12]
    assert "cu_seqlens [12, 33)" in seqs.hovertext[1] and "sample 8" in seqs.hovertext[1]
    assert list(zip(pad.base, pad.y)) == [(10, 2), (33, 3)]  # per-slot alignment to 2*cp = 4
    assert cp_segments(plan.packs[0][0], 2) == [
        (0, 0, 3, 0), (1, 3, 9, 0), (0, 9, 10, 0), (0, 10, 12, None),
        (0, 12, 18, 1), (1, 18, 30, 1), (0, 30, 33, 1), (0, 33, 36, None)]
    cp = cp_figure(plan).data[0]
    assert list(cp.base) == [0, 3, 9, 10, 12, 18, 30, 33] and cp.y[1] == "cp rank 1"
    assert cp.hovertext[4] == "sample 8<br>positions [12, 18)"


def test_inspector_repacks_on_slider_change():
    ins = PackingInspector(LENGTHS, max_tokens_per_gpu=1000, backend="output")
    assert ins.plan.n_micro_batches == packing.first_fit_count(LENGTHS, 1000)
    ins.max_tokens.value = 2000
    assert ins.plan.max_tokens_per_gpu == 2000
    assert ins.plan.n_micro_batches == packing.first_fit_count(LENGTHS, 2000)
    ins.dp.value = 3
    assert len(ins.plan.ranks) == 3 and "micro-batches/rank" in ins.summary.value
    ins.cp.value = 2
    assert ins.plan.capacity == 4000 and ins.plan.seq_align == 4
    assert ins.cp_view.figure.layout.title.text.endswith("cp=2)")
    ins.max_tokens.value = 100  # 900 > 100*2: the library's budget error is shown, not raised
    assert ins.plan is None and "more than the budget" in ins.summary.value
    ins.set_lengths(make_samples())
    ins.max_tokens.value = 10
    assert ins.plan.sample_ids == [0, 1, 2, 3] and ins.dp.options == (1, 2, 4)


def test_environment_report_lists_versions_and_missing_extras():
    from rlbench.viz.env import OPTIONAL, environment_report

    env = environment_report()
    assert env.versions["torch"] and env.versions["plotly"] and env.devices[-1].startswith("cpu")
    assert set(env.extras) == set(OPTIONAL)
    html = env._repr_html_()
    assert html.count("<tr>") == 2 + len(env.versions) + len(OPTIONAL)
    missing = [k for k, v in env.extras.items() if v is None]
    assert all(f"extra: {k}</td><td style='text-align:left'>missing" in html for k in missing)
