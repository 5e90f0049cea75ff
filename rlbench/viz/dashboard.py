"""LiveDashboard: training curves that grow by one point per `update(metrics)`.

The panel layout is data (`PANELS`): each series names the flat metric keys it accepts, first
match wins, so the dashboard follows the trainer's key names without code changes. Step-phase
times are every `perf/*_time` key except the total, drawn as stacked bars.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from rlbench.viz._display import FigureView, WidgetMixin
from rlbench.viz.figures import step_dtick

STEP_KEYS = ("rollout/id", "step")  # train/step is a mean over optimizer steps, not an x value
TOTAL_TIME_KEYS = ("perf/step_time", "perf/total_time")


@dataclass(frozen=True)
class Series:
    """One line of a panel: its legend name and the metric keys it reads (first present wins)."""

    name: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Panel:
    """One subplot: a title and its line series (empty for the stacked phase-time panel)."""

    title: str
    series: tuple[Series, ...]


PANELS: tuple[Panel, ...] = (
    Panel("reward", (Series("train", ("rollout/raw_reward", "rollout/reward")),
                     Series("eval", ("eval/reward", "eval/raw_reward", "eval/accuracy")))),
    Panel("response length", (Series("mean", ("rollout/response_len/mean", "rollout/response_length/mean",
                                              "rollout/response_len", "rollout/response_length")),)),
    Panel("PPO KL (old vs new)", (Series("ppo_kl", ("train/ppo_kl",)),)),
    Panel("ref KL", (Series("ref_kl", ("train/kl_loss", "train/ref_kl", "train/kl")),)),
    Panel("entropy", (Series("entropy", ("train/entropy", "train/entropy_loss")),)),
    Panel("clip fraction", (Series("clipfrac", ("train/pg_clipfrac", "train/clipfrac")),)),
    Panel("grad norm", (Series("grad_norm", ("train/grad_norm",)),)),
    Panel("|train - rollout| logprob", (Series("abs_diff", ("train/train_rollout_logprob_abs_diff",)),)),
    Panel("step-phase time (s)", ()),
)
PHASE_PANEL = len(PANELS) - 1


def first_value(metrics: Mapping[str, object], keys: Iterable[str]) -> float | None:
    """The first finite number among `metrics[k]` for k in `keys`, else None."""
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, bool) or value is None:
            continue
        try:
            value = float(value)  # accepts python/numpy numbers and 0-d tensors
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            return value
    return None


def phase_times(metrics: Mapping[str, object]) -> dict[str, float]:
    """`perf/<phase>_time` values (seconds) except the step total, keyed by phase name."""
    out = {}
    for key in sorted(metrics):
        if key.startswith("perf/") and key.endswith("_time") and key not in TOTAL_TIME_KEYS:
            value = first_value(metrics, (key,))
            if value is not None:
                out[key[len("perf/") : -len("_time")]] = value
    return out


class LiveDashboard(WidgetMixin):
    """Subplots of the RL training curves; `update(metrics)` appends one point per series present.

    Args:
        history: metric dicts to plot right away (e.g. `trainer.history`).
        backend: plotting backend for `FigureView` ("auto", "output", "figurewidget").
        cols: subplot columns.
    """

    def __init__(self, history: Iterable[Mapping] = (), *, backend: str = "auto", cols: int = 3) -> None:
        self.steps: list[float] = []
        self.points: dict[str, tuple[list[float], list[float]]] = {}
        self.phases: dict[str, tuple[list[float], list[float]]] = {}
        self._lock = threading.Lock()
        self._cols = cols
        self.view = FigureView(self._empty_figure(), backend=backend)
        self.counter = widgets.HTML(self._counter_text())
        self.widget = widgets.VBox([self.counter, self.view.widget])
        self.extend(history)

    def _empty_figure(self) -> go.Figure:
        rows = math.ceil(len(PANELS) / self._cols)
        fig = make_subplots(rows=rows, cols=self._cols, subplot_titles=[p.title for p in PANELS],
                            vertical_spacing=0.12, horizontal_spacing=0.07)
        for i, panel in enumerate(PANELS):
            row, col = divmod(i, self._cols)
            for series in panel.series:
                fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=self._trace_name(panel, series),
                                         showlegend=False), row=row + 1, col=col + 1)
            keys = ", ".join(k for s in panel.series for k in s.keys[:1]) or "perf/*_time"
            fig.add_annotation(text=f"no {keys} yet", name=f"empty: {panel.title}", x=0.5, y=0.5,
                               xref="x domain", yref="y domain", showarrow=False, font=dict(color="#999"),
                               row=row + 1, col=col + 1)
        fig.update_layout(height=260 * rows, margin=dict(l=40, r=10, t=40, b=30), barmode="stack",
                          template="plotly_white")
        return fig

    def _trace_name(self, panel: Panel, series: Series) -> str:
        return f"{panel.title}: {series.name}"

    def update(self, metrics: Mapping[str, object]) -> None:
        """Appends the values present in one step's flat metric dict; missing keys are skipped.

        The page follows at most every `FigureView.min_interval_s` (the newest state always lands), so a
        long Run N does not re-draw nine panels per step.
        """
        self._append(metrics)
        self._redraw(throttle=True)

    def extend(self, history: Iterable[Mapping]) -> None:
        """Appends many steps, then redraws once."""
        for metrics in history:
            self._append(metrics)
        self._redraw()

    def _append(self, metrics: Mapping[str, object]) -> None:
        with self._lock:
            step = first_value(metrics, STEP_KEYS)
            x = step if step is not None else float(len(self.steps))
            self.steps.append(x)
            for panel in PANELS:
                for series in panel.series:
                    y = first_value(metrics, series.keys)
                    if y is not None:
                        xs, ys = self.points.setdefault(self._trace_name(panel, series), ([], []))
                        xs.append(x)
                        ys.append(y)
            for phase, seconds in phase_times(metrics).items():
                xs, ys = self.phases.setdefault(phase, ([], []))
                xs.append(x)
                ys.append(seconds)

    def n_points(self, trace_name: str) -> int:
        """Number of points of one series (`"<panel title>: <series name>"`, or a phase name)."""
        xs, _ = self.points.get(trace_name) or self.phases.get(trace_name) or ([], [])
        return len(xs)

    def _redraw(self, throttle: bool = False) -> None:
        with self._lock:
            fig = self.view.figure
            fig.update_xaxes(dtick=step_dtick(max(self.steps, default=1.0)), tick0=0)
            for trace in fig.data:
                if trace.name in self.points:
                    trace.x, trace.y = (list(v) for v in self.points[trace.name])
            self._sync_phase_traces(fig)
            for note in fig.layout.annotations:  # hide "no ... yet" once a panel has data
                if note.name and note.name.startswith("empty: "):
                    note.visible = not self._panel_has_data(note.name[len("empty: "):])
            self.counter.value = self._counter_text()
        self.view.refresh(throttle=throttle)

    def _panel_has_data(self, title: str) -> bool:
        panel = next(p for p in PANELS if p.title == title)
        if not panel.series:
            return bool(self.phases)
        return any(self._trace_name(panel, s) in self.points for s in panel.series)

    def _sync_phase_traces(self, fig: go.Figure) -> None:
        existing = {t.name: t for t in fig.data if t.type == "bar"}
        row, col = divmod(PHASE_PANEL, self._cols)
        for phase, (xs, ys) in self.phases.items():
            if phase not in existing:
                fig.add_trace(go.Bar(x=list(xs), y=list(ys), name=phase), row=row + 1, col=col + 1)
            else:
                existing[phase].x, existing[phase].y = list(xs), list(ys)

    def _counter_text(self) -> str:
        last = self.steps[-1] if self.steps else "-"
        return (f"<b>LiveDashboard</b> <span class='rlbench-steps' data-steps='{len(self.steps)}'>"
                f"steps: {len(self.steps)}</span> &middot; last step: {last}")
