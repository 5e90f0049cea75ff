"""True on-policy views: per-token rollout-vs-recompute log-prob diffs, runs side by side, tables of plain rows.

    diffs = logprob_diffs(batch)                 # after trainer.compute_log_probs(batch): |old - rollout| per token
    diff_histogram({"default": d0, "mode": d1})  # decade bins with an exact-zero bin (a symlog histogram)
    group = TrainerGroup({"default": t0, "mode": t1})
    view = RunsView(keys=DIFF_KEYS)              # one metric at a time, a ToggleButtons picks it
    StepController(group, on_step=view.update_all)
    table_html(rows, [("mode", "mode"), ("step_time_s", "step s")])   # any list of row dicts

Everything here takes plain data (metric dicts, rows, tensors); the schemas of the files in
`benchmarks/results/` are read by `benchmarks/stored_results.py`, which hands rows to these functions.
The data functions (`logprob_diffs`, `diff_decades`, `step_series`, `format_value`, `table_html`) are pure and
tested without a browser; the figures return a `go.Figure`.
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from rlbench.viz._display import FigureView, WidgetMixin
from rlbench.viz.dashboard import first_value
from rlbench.viz.figures import step_dtick

DIFF_KEYS = ("train/train_rollout_logprob_abs_diff", "train/first_mb_kl_vs_rollout", "train/mismatch_k3_kl",
             "train/ppo_kl")
"""The per-step mismatch metrics `RunsView` offers by default."""
COLORS = ("#4c78a8", "#e45756", "#54a24b", "#f58518", "#b279a2", "#72b7b2", "#9d755d", "#bab0ac")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "x", "diamond", "square", "triangle-up", "cross", "star", "triangle-down")


def run_style(i: int) -> dict:
    """Line and marker style of the i-th run: colour, dash and marker symbol all differ, so runs with identical
    values (the mode's all-zero diffs) stay visible on top of each other."""
    return {"line": dict(color=COLORS[i % len(COLORS)], dash=DASHES[i % len(DASHES)], width=2),
            "marker": dict(symbol=SYMBOLS[i % len(SYMBOLS)], size=7 + 2 * (i % 3),
                           color=COLORS[i % len(COLORS)])}


# ---------------------------------------------------------------------------------------------- per-token diffs
def logprob_diffs(batch: Any, *, signed: bool = False) -> torch.Tensor:
    """|recomputed old − rollout| log-prob of every trained response token of a `RolloutBatch` (float64, CPU).

    Reads `batch.old_log_probs` (`[step][micro-batch] -> [R]`, set by `Trainer.compute_log_probs`) against the
    packs' `rollout_log_probs` where `loss_mask` is set, in pack order. The difference is taken in float64, so it
    is 0.0 exactly when the two values are the same bits. `signed=True` returns old − rollout.

    Raises:
        ValueError: the batch has no packs or no recomputed log-probs (bypass mode: `use_rollout_logprobs=True`
            computes none), or the engine reported no rollout log-probs.
    """
    packs, old = getattr(batch, "packs", None), getattr(batch, "old_log_probs", None)
    if packs is None or old is None:
        raise ValueError("the batch has no recomputed log-probs: call trainer.compute_log_probs(batch) first (with "
                         "loss.use_rollout_logprobs=True there is no recompute to compare with)")
    out = []
    for step_packs, step_old in zip(packs, old):
        for pack, lp in zip(step_packs, step_old):
            if pack.rollout_log_probs is None:
                raise ValueError("a pack has no rollout_log_probs: the engine returned no log-probs for its samples")
            mask = pack.loss_mask.detach().cpu() > 0
            delta = lp.detach().cpu().double() - pack.rollout_log_probs.detach().cpu().double()
            out.append((delta if signed else delta.abs())[mask])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def diff_decades(diffs: torch.Tensor | Sequence[float], *, lo: int = -10, hi: int = 1) -> dict[str, int]:
    """Token counts of |diff| per bin: exactly "0", "<1e{lo}", one bin per decade [1e{d}, 1e{d+1}), "≥1e{hi}".

    Every bin is present (zero counts too), in increasing order; the counts sum to the number of values.
    """
    d = torch.as_tensor(diffs, dtype=torch.float64).abs().flatten()
    out = {"0": int((d == 0).sum())}
    out[f"<1e{lo}"] = int(((d > 0) & (d < 10.0 ** lo)).sum())
    for e in range(lo, hi):
        out[f"1e{e}–1e{e + 1}"] = int(((d >= 10.0 ** e) & (d < 10.0 ** (e + 1))).sum())
    out[f"≥1e{hi}"] = int((d >= 10.0 ** hi).sum())
    return out


def diff_histogram(diffs_by_run: Mapping[str, torch.Tensor | Sequence[float]], *, lo: int = -10,
                   hi: int = 1) -> go.Figure:
    """Grouped bars of `diff_decades` per run: a histogram on a symlog axis (an exact-zero bin, then decades).

    Bins empty in every run are dropped; the title gives each run's count of non-zero tokens.
    """
    counts = {name: diff_decades(d, lo=lo, hi=hi) for name, d in diffs_by_run.items()}
    labels = [b for b in next(iter(counts.values()), {}) if any(c[b] for c in counts.values())]
    fig = go.Figure()
    for i, (name, c) in enumerate(counts.items()):
        fig.add_trace(go.Bar(x=labels, y=[c[b] for b in labels], name=name, marker_color=COLORS[i % len(COLORS)],
                             text=[c[b] or "" for b in labels], textposition="outside"))
    nonzero = ", ".join(f"{name}: {sum(c.values()) - c['0']} of {sum(c.values())} tokens non-zero"
                        for name, c in counts.items())
    fig.update_layout(height=340, template="plotly_white", barmode="group", margin=dict(l=50, r=10, t=50, b=50),
                      title=dict(text=f"|rollout − recomputed| log-prob per token<br><sup>{nonzero}</sup>"),
                      xaxis_title="|diff| (exact 0, then decades)", yaxis_title="tokens")
    return fig


# ---------------------------------------------------------------------------------------------- per-step curves
def step_series(history: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """`(steps, values)` of one metric over a run's per-step dicts; steps missing the metric are skipped.

    The x value is `step` when present, else `rollout/id` + 1 (the trainer's step number), else the position + 1.
    """
    xs, ys = [], []
    for i, m in enumerate(history):
        y = first_value(m, (key,))
        if y is None:
            continue
        x = first_value(m, ("step",))
        if x is None:
            rid = first_value(m, ("rollout/id",))
            x = rid + 1 if rid is not None else float(i + 1)
        xs.append(x)
        ys.append(y)
    return xs, ys


def metric_curves(runs: Mapping[str, Iterable[Mapping[str, Any]]], keys: Sequence[str], *, cols: int = 2,
                  height: int = 260) -> go.Figure:
    """One subplot per metric key, one line per run (the same style in every subplot); a run without the key
    has no line there. The legend, above the plots, names every run that has a line in any subplot."""
    runs = {name: list(h) for name, h in runs.items()}
    rows = math.ceil(len(keys) / cols)
    in_legend: set[str] = set()
    last_step = 1.0
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=list(keys), vertical_spacing=0.18 if rows > 1 else 0.1,
                        horizontal_spacing=0.1)
    for j, key in enumerate(keys):
        r, c = divmod(j, cols)
        for i, (name, history) in enumerate(runs.items()):
            xs, ys = step_series(history, key)
            if xs:  # every run in the legend once, from the first subplot that has it
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name, legendgroup=name,
                                         showlegend=name not in in_legend, **run_style(i)),
                              row=r + 1, col=c + 1)
                in_legend.add(name)
                last_step = max(last_step, max(xs))
    fig.update_layout(height=height * rows, template="plotly_white", margin=dict(l=50, r=10, t=40, b=30),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02 + 0.1 / rows, x=0))
    fig.update_xaxes(title_text="step", dtick=step_dtick(last_step), tick0=0)
    return fig


@dataclass
class GroupRollout:
    """The rollouts of every run of a `TrainerGroup` (`samples`: all of them, for counting)."""

    batches: dict[str, Any]
    samples: list = field(default_factory=list)


class TrainerGroup:
    """Several trainers driven as one (duck-typed for `StepController`): `step()` steps each in turn.

    `step()` returns `{run name: that trainer's step metrics}`; `RunsView.update_all` takes that dict.
    """

    def __init__(self, trainers: Mapping[str, Any]) -> None:
        if not trainers:
            raise ValueError("TrainerGroup needs at least one trainer: {name: trainer}")
        self.trainers = dict(trainers)

    def step(self) -> dict[str, dict]:
        return {name: dict(t.step()) for name, t in self.trainers.items()}

    def rollout(self) -> GroupRollout:
        batches = {name: t.rollout() for name, t in self.trainers.items()}
        for name, t in self.trainers.items():  # rewards and group advantages, as StepController.rollout does
            if hasattr(t, "score"):
                t.score(batches[name])
        return GroupRollout(batches, [s for b in batches.values() for s in getattr(b, "samples", [])])

    @property
    def last_rollout(self) -> GroupRollout | None:
        batches = {name: t.last_rollout for name, t in self.trainers.items()}
        if any(b is None for b in batches.values()):
            return None
        return GroupRollout(batches, [s for b in batches.values() for s in getattr(b, "samples", [])])

    def train_step(self, rollout: GroupRollout) -> dict[str, dict]:
        return {name: dict(t.train_step(rollout.batches[name]) or {}) for name, t in self.trainers.items()}

    def sync_weights(self) -> dict[str, dict]:
        return {name: dict(t.sync_weights() or {}) for name, t in self.trainers.items()}

    @property
    def history(self) -> dict[str, list[dict]]:
        return {name: list(getattr(t, "history", [])) for name, t in self.trainers.items()}


class RunsView(WidgetMixin):
    """Per-step curves of several runs, one metric at a time (a ToggleButtons picks it), and a summary line.

    Args:
        runs: `{run name: per-step metric dicts}` to show right away (e.g. `TrainerGroup.history`).
        keys: the metrics offered, first shown first.
        backend: plotting backend of the `FigureView`.
    """

    def __init__(self, runs: Mapping[str, Iterable[Mapping]] | None = None, *, keys: Sequence[str] = DIFF_KEYS,
                 backend: str = "auto") -> None:
        if not keys:
            raise ValueError("RunsView needs at least one metric key")
        self.keys = tuple(keys)
        self.runs: dict[str, list[dict]] = {}
        self._lock = threading.Lock()
        self.toggle = widgets.ToggleButtons(options=[(k.split("/", 1)[-1], k) for k in self.keys], value=self.keys[0],
                                            style={"button_width": "auto"})
        self.toggle.observe(lambda _: self.redraw(), names="value")
        self.summary = widgets.HTML()
        self.view = FigureView(go.Figure(), backend=backend)
        self.widget = widgets.VBox([self.toggle, self.view.widget, self.summary])
        for name, history in (runs or {}).items():
            self.runs[name] = [dict(m) for m in history]
        self.redraw()

    @property
    def key(self) -> str:
        """The metric shown."""
        return self.toggle.value

    def update(self, name: str, metrics: Mapping[str, Any]) -> None:
        """Appends one step of run `name` and redraws (throttled: see `FigureView.refresh`)."""
        with self._lock:
            self.runs.setdefault(name, []).append(dict(metrics))
        self.redraw(throttle=True)

    def update_all(self, metrics_by_run: Mapping[str, Mapping[str, Any]]) -> None:
        """Appends one step of every run (`TrainerGroup.step()`'s dict) and redraws once (throttled)."""
        with self._lock:
            for name, metrics in metrics_by_run.items():
                self.runs.setdefault(name, []).append(dict(metrics))
        self.redraw(throttle=True)

    def series(self, name: str, key: str | None = None) -> tuple[list[float], list[float]]:
        """`step_series` of run `name` for `key` (default: the metric shown)."""
        return step_series(self.runs.get(name, []), key or self.key)

    def summary_text(self, key: str | None = None) -> str:
        """Per run: steps with the metric, its max |value|, and whether every value is exactly 0.0."""
        key = key or self.key
        parts = []
        for name in self.runs:
            _, ys = self.series(name, key)
            if not ys:
                parts.append(f"{name}: no {key}")
                continue
            exact = all(y == 0.0 for y in ys)
            parts.append(f"{name}: {len(ys)} steps, max {max(abs(y) for y in ys):.3g}"
                         f"{' (all exactly 0.0)' if exact else ''}")
        return "; ".join(parts)

    def redraw(self, throttle: bool = False) -> None:
        """Rebuilds the figure for the metric shown; `throttle=True` for per-step updates."""
        with self._lock:
            key = self.key
            fig = go.Figure()
            last_step = 1.0
            for i, name in enumerate(self.runs):
                xs, ys = self.series(name, key)
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name, **run_style(i)))
                last_step = max(last_step, *xs) if xs else last_step
            fig.update_layout(height=340, template="plotly_white", margin=dict(l=60, r=10, t=40, b=40),
                              title=key, xaxis=dict(title="step", dtick=step_dtick(last_step), tick0=0),
                              yaxis=dict(exponentformat="e"),
                              legend=dict(orientation="h", yanchor="top", y=-0.2, x=0))
            self.view.figure = fig
            self.summary.value = f"<span class='rlbench-runs-summary'>{html.escape(self.summary_text(key))}</span>"
        self.view.refresh(throttle=throttle)


# ---------------------------------------------------------------------------------------------- tables
def format_value(value: Any, key: str = "") -> str:
    """Table cell text: "–" for None, ×ratio for `*_x`, "0" for exact zero, 3 significant digits otherwise."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_x"):
        return f"×{value:.2f}"
    if value == 0:
        return "0"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.3g}"


TEXT_CELL_WIDTH_EM = 28  # a long text cell wraps at this width instead of widening the table past the page
CELL = "padding:2px 8px;vertical-align:top"


def table_html(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], *,
               fold_chars: int | None = None) -> str:
    """An HTML table of `rows` with the `(key, header)` columns; columns no row has are left out.

    Numbers are right-aligned; text cells are left-aligned and wrap (at most `TEXT_CELL_WIDTH_EM` wide, long
    names broken anywhere). The table sits in a horizontally scrolling box, so a wide one scrolls instead of
    being clipped at the right. `fold_chars`: a text cell longer than that shows its first `fold_chars`
    characters and unfolds to the whole text on a click (a `<details>`), which keeps a wordy table short.
    """
    cols = [(k, h) for k, h in columns if any(k in r for r in rows)]
    text = {k for k, _ in cols if any(isinstance(r.get(k), str) and len(r[k]) > 12 for r in rows)}

    def style(k: str) -> str:
        if k in text:
            return (f"{CELL};text-align:left;white-space:normal;overflow-wrap:anywhere;min-width:8em;"
                    f"max-width:{TEXT_CELL_WIDTH_EM}em")
        return f"{CELL};text-align:right;white-space:nowrap"

    def cell(value: Any, k: str) -> str:
        shown = format_value(value, k)
        if fold_chars is None or k not in text or len(shown) <= fold_chars:
            return html.escape(shown)
        return (f"<details><summary>{html.escape(shown[:fold_chars].rstrip())}…</summary>"
                f"{html.escape(shown)}</details>")

    head = "".join(f"<th style='{style(k)}'>{html.escape(h)}</th>" for k, h in cols)
    body = "".join(
        "<tr>" + "".join(f"<td style='{style(k)}'>{cell(r.get(k), k)}</td>" for k, _ in cols) + "</tr>"
        for r in rows)
    return (f"<div class='rlbench-table-box' style='overflow-x:auto;max-width:100%'><table class='rlbench-table'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")
