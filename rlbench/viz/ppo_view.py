"""PPO and reward-model views: per-token values, returns and advantages of a rollout, the KL controller against its
target, the RM's score beside a rule's, held-out curves of several runs.

    traces = token_traces(trainer.last_rollout)      # after a step: per sample, per trained response token
    TokenTraceView(traces)                           # a slider picks the sample: value vs return, advantages
    kl_figure({"ppo": history}, target=0.1)          # rollout/reward_kl against the target, and the coefficient
    eval_figure({"grpo": evals, "ppo": evals}, ["hidden", "correct"])   # held-out records against the rollout id

The data function (`token_traces`) is pure and tested without a browser; the figures return a `go.Figure` and take
plain data (per-step metric dicts, per-eval dicts with a `rollout/id`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from rlbench.viz._display import FigureView, WidgetMixin
from rlbench.viz.figures import step_dtick
from rlbench.viz.on_policy import COLORS, run_style, step_series


def token_traces(batch: Any, *, limit: int | None = None) -> list[dict]:
    """Per sample of a trained `RolloutBatch`, its trained response tokens' advantages and (PPO) values and returns.

    Reads `batch.packs`, `batch.advantages` and, when a critic ran, `batch.values` / `batch.returns`
    (`[step][micro-batch] -> [R]`, set by `Trainer.compute_advantages`; `step()` leaves them on
    `trainer.last_rollout`). Tokens outside the loss mask are left out.

    Returns:
        `[{"sample": index into batch.samples, "reward", "response", "advantages": [...], "values": [...] | None,
        "returns": [...] | None}]` in sample order, at most `limit` of them.

    Raises:
        ValueError: the batch has no advantages yet.
    """
    packs, adv = getattr(batch, "packs", None), getattr(batch, "advantages", None)
    if packs is None or adv is None:
        raise ValueError("the batch has no advantages: run trainer.step() (or trainer.compute_advantages(batch)) "
                         "first and pass trainer.last_rollout")
    values, returns = getattr(batch, "values", None), getattr(batch, "returns", None)
    offset, out = 0, {}
    for s, step_packs in enumerate(packs):
        for m, pack in enumerate(step_packs):
            start = 0
            for sid, length in zip(pack.sample_ids, pack.response_lengths):
                span = slice(start, start + length)
                keep = pack.loss_mask[span].detach().cpu() > 0
                index = offset + sid
                sample = batch.samples[index]
                out[index] = {"sample": index, "reward": float(sample.reward), "response": sample.response,
                              "advantages": _tokens(adv, s, m, span, keep), "values": _tokens(values, s, m, span, keep),
                              "returns": _tokens(returns, s, m, span, keep)}
                start += length
        offset += len({i for p in step_packs for i in p.sample_ids})
    rows = [out[i] for i in sorted(out)]
    return rows[:limit] if limit is not None else rows


def _tokens(arrays, s: int, m: int, span: slice, keep) -> list[float] | None:
    """The trained tokens of one sample's span in pack `m` of step `s` (None when the arrays were not computed)."""
    return None if arrays is None else arrays[s][m][span].detach().cpu()[keep].double().tolist()


def token_trace_figure(trace: Mapping[str, Any]) -> go.Figure:
    """One sample's tokens: value and return (when a critic ran) and the advantage, against the token position."""
    xs = list(range(len(trace["advantages"])))
    fig = make_subplots(rows=1, cols=2, subplot_titles=["value V(s_t) vs return G_t", "advantage A_t"])
    if trace.get("values") is not None:
        fig.add_trace(go.Scatter(x=xs, y=trace["values"], name="value", mode="lines+markers",
                                 line=dict(color=COLORS[0])), row=1, col=1)
        fig.add_trace(go.Scatter(x=xs, y=trace["returns"], name="return", mode="lines+markers",
                                 line=dict(color=COLORS[1], dash="dot")), row=1, col=1)
    fig.add_trace(go.Bar(x=xs, y=trace["advantages"], name="advantage", marker_color=COLORS[2]), row=1, col=2)
    fig.update_layout(height=300, template="plotly_white", margin=dict(l=50, r=10, t=60, b=30),
                      title=f"sample {trace['sample']}: reward {trace['reward']:.3g}, {trace['response']!r}")
    fig.update_xaxes(title_text="response token")
    return fig


class TokenTraceView(WidgetMixin):
    """`token_trace_figure` of one sample at a time; an IntSlider picks which of `traces`."""

    def __init__(self, traces: Sequence[Mapping[str, Any]], *, backend: str = "auto") -> None:
        if not traces:
            raise ValueError("TokenTraceView needs at least one trace (token_traces(trainer.last_rollout))")
        self.traces = list(traces)
        self.slider = widgets.IntSlider(value=0, min=0, max=len(self.traces) - 1, description="sample")
        self.view = FigureView(token_trace_figure(self.traces[0]), backend=backend)
        self.slider.observe(lambda _: self.show(self.slider.value), names="value")
        self.widget = widgets.VBox([self.slider, self.view.widget])

    def show(self, i: int) -> None:
        self.view.figure = token_trace_figure(self.traces[i])
        self.view.refresh()


def kl_figure(runs: Mapping[str, Iterable[Mapping[str, Any]]], *, target: float | None = None) -> go.Figure:
    """Per step: the batch's KL to the reference (`rollout/reward_kl`) against `target`, and the KL-in-reward
    coefficient β (`rollout/kl_coef`) that the controller set, one line per run."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["KL(π_old ‖ π_ref) per sample", "β (kl_coef)"])
    last_step = 1.0
    for i, (name, history) in enumerate(runs.items()):
        history = list(history)
        for col, key in ((1, "rollout/reward_kl"), (2, "rollout/kl_coef")):
            xs, ys = step_series(history, key)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name, legendgroup=name,
                                     showlegend=col == 1, **run_style(i)), row=1, col=col)
            last_step = max(last_step, *xs) if xs else last_step
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", line_color="gray", annotation_text="target", row=1, col=1)
    fig.update_layout(height=300, template="plotly_white", margin=dict(l=50, r=10, t=40, b=30))
    fig.update_xaxes(title_text="step", dtick=step_dtick(last_step), tick0=0)
    return fig


def eval_figure(runs: Mapping[str, Iterable[Mapping[str, Any]]], keys: Sequence[str], *,
                titles: Mapping[str, str] | None = None) -> go.Figure:
    """Held-out records of several runs: one subplot per key, x = the record's `rollout/id` (0: before training)."""
    titles = titles or {}
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=[titles.get(k, k) for k in keys])
    last = 1.0
    for i, (name, evals) in enumerate(runs.items()):
        evals = [e for e in evals if "rollout/id" in e]
        for j, key in enumerate(keys):
            pts = [(e["rollout/id"], e[key]) for e in evals if key in e]
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                     legendgroup=name, showlegend=j == 0, **run_style(i)),
                          row=1, col=j + 1)
            last = max(last, *(p[0] for p in pts)) if pts else last
    fig.update_layout(height=300, template="plotly_white", margin=dict(l=50, r=10, t=40, b=30))
    fig.update_xaxes(title_text="rollout", dtick=step_dtick(last), tick0=0)
    return fig
