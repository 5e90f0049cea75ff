"""Static plotly figures for the notebooks (pure: data in, `go.Figure` out)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def step_dtick(last_step: float, max_ticks: int = 10) -> int:
    """An integer tick spacing (1, 2, 5, 10, 20, 50, ...) giving at most `max_ticks` ticks up to `last_step`.

    Step axes use it so a short run is labelled 0, 1, 2 rather than 0, 0.5, 1, 1.5.
    """
    span = max(float(last_step), 1.0)
    for exp in range(0, 12):
        for base in (1, 2, 5):
            tick = base * 10 ** exp
            if math.ceil(span / tick) <= max_ticks:
                return tick
    raise ValueError(f"last_step={last_step} is too large for a step axis")


def length_histogram(lengths: Sequence[int], *, bins: int = 40) -> go.Figure:
    """Histogram of sequence lengths with the mean and the max marked."""
    mean = sum(lengths) / len(lengths)
    fig = go.Figure(go.Histogram(x=list(lengths), nbinsx=bins, marker_color="#4c78a8"))
    fig.add_vline(x=mean, line_dash="dash", annotation_text=f"mean {mean:.0f}")
    fig.add_vline(x=max(lengths), line_dash="dot", line_color="#c00", annotation_text=f"max {max(lengths)}")
    fig.update_layout(height=300, template="plotly_white", xaxis_title="tokens per sequence",
                      yaxis_title="sequences", margin=dict(l=50, r=10, t=30, b=40),
                      title=f"{len(lengths)} sequences, {sum(lengths)} tokens")
    return fig


def micro_batch_comparison(rows: Mapping[str, tuple[int, float]]) -> go.Figure:
    """Two bar panels per scheme: micro-batches (forward passes) and padded fraction of the tokens computed.

    Args:
        rows: scheme name -> (number of micro-batches, padding fraction in [0, 1]).
    """
    names = list(rows)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("micro-batches per step", "padding (% of tokens computed)"))
    fig.add_trace(go.Bar(x=names, y=[rows[n][0] for n in names], marker_color="#4c78a8",
                         text=[rows[n][0] for n in names], textposition="outside"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[100 * rows[n][1] for n in names], marker_color="#e45756",
                         text=[f"{100 * rows[n][1]:.1f}%" for n in names], textposition="outside"), row=1, col=2)
    fig.update_layout(height=340, template="plotly_white", showlegend=False, margin=dict(l=50, r=10, t=40, b=80))
    return fig
