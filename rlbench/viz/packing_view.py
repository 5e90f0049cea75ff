"""PackingInspector: packs as stacked bars, with sliders for max_tokens_per_gpu, dp and cp that re-pack live.

Figures are pure functions of a `PackingPlan` (`packs_figure`, `cp_figure`); the widget only
re-plans on a control change and redraws. A control setting the library rejects (e.g. a sequence
longer than the budget) shows the library's error message instead of a figure.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from rlbench.viz._display import FigureView, WidgetMixin
from rlbench.viz.packing_plan import PACKERS, PackingPlan, cp_segments, plan_packing, samples_of

PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
           "#9d755d", "#bab0ac")
PAD_COLOR = "#d0d0d0"
GROUPINGS = ("rank", "micro-batch")


def _slots(plan: PackingPlan, group_by: str) -> list[tuple[int, int]]:
    """(rank, micro-batch) pairs in x-axis order: rank-major or micro-batch-major."""
    r_m = [(r, m) for r in range(plan.dp_size) for m in range(plan.n_micro_batches)]
    return r_m if group_by == "rank" else sorted(r_m, key=lambda p: (p[1], p[0]))


def _segments(plan: PackingPlan, r: int, m: int) -> list[tuple[int, int, int | None]]:
    """(start, end, position in lengths | None for padding) of pack m of rank r, in pack order."""
    pack, out = plan.packs[r][m], []
    cu, n = pack.cu_seqlens.tolist(), pack.seq_lengths.tolist()
    for j, i in enumerate(pack.sample_ids):
        out.append((cu[j], cu[j] + n[j], plan.positions[r][i]))
        if cu[j + 1] > cu[j] + n[j]:
            out.append((cu[j] + n[j], cu[j + 1], None))  # alignment pad of this slot
    if pack.pad_length:
        out.append((cu[-1], pack.num_tokens, None))  # trailing pad pseudo-sequence
    return out


def packs_figure(plan: PackingPlan, group_by: str = "rank") -> go.Figure:
    """One stacked bar per (DP rank, micro-batch): a segment per sequence, grey padding, the budget line."""
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by={group_by!r} is not one of {GROUPINGS}")
    seq: dict[str, list] = {"x": [], "base": [], "y": [], "color": [], "hover": []}
    pad: dict[str, list] = {"x": [], "base": [], "y": []}
    for r, m in _slots(plan, group_by):
        if m >= len(plan.packs[r]):
            continue  # this rank has fewer packs (naive first-fit): an idle lockstep slot
        label = f"r{r}·mb{m}" if group_by == "rank" else f"mb{m}·r{r}"
        for start, end, pos in _segments(plan, r, m):
            part = seq if pos is not None else pad
            part["x"].append(label)
            part["base"].append(start)
            part["y"].append(end - start)
            if pos is not None:
                sid = plan.sample_ids[pos]
                seq["color"].append(PALETTE[sid % len(PALETTE)])
                seq["hover"].append(f"sample {sid}<br>length {end - start}<br>cu_seqlens [{start}, {end})"
                                    f"<br>rank {r}, micro-batch {m}")
    fig = go.Figure()
    fig.add_trace(go.Bar(x=seq["x"], y=seq["y"], base=seq["base"], hovertext=seq["hover"], hoverinfo="text",
                         marker=dict(color=seq["color"], line=dict(color="white", width=1)), name="sequences"))
    fig.add_trace(go.Bar(x=pad["x"], y=pad["y"], base=pad["base"], marker_color=PAD_COLOR, name="padding",
                         hovertemplate="padding %{y}<extra></extra>"))
    fig.add_hline(y=plan.capacity, line_dash="dash", line_color="#c00",
                  annotation_text=f"budget {plan.capacity} = max_tokens_per_gpu×cp")
    fig.update_layout(barmode="overlay", height=360, template="plotly_white", showlegend=False,
                      margin=dict(l=50, r=10, t=40, b=40), yaxis_title="tokens",
                      title=f"{plan.packer}: {plan.n_micro_batches} micro-batches × {plan.dp_size} DP ranks")
    return fig


def cp_figure(plan: PackingPlan, rank: int = 0, micro_batch: int = 0) -> go.Figure:
    """The library's zig-zag CP layout of one pack: a row per CP rank, its runs of positions coloured by sequence."""
    pack = plan.packs[rank][micro_batch]
    ys, widths, bases, colors, hover = [], [], [], [], []
    for cp_rank, start, end, j in cp_segments(pack, plan.cp_size):
        pos = plan.positions[rank][pack.sample_ids[j]] if j is not None else None
        ys.append(f"cp rank {cp_rank}")
        widths.append(end - start)
        bases.append(start)
        colors.append(PALETTE[plan.sample_ids[pos] % len(PALETTE)] if pos is not None else PAD_COLOR)
        name = f"sample {plan.sample_ids[pos]}" if pos is not None else "padding"
        hover.append(f"{name}<br>positions [{start}, {end})")
    fig = go.Figure(go.Bar(y=ys, x=widths, base=bases, orientation="h", hovertext=hover, hoverinfo="text",
                           marker=dict(color=colors, line=dict(color="white", width=1))))
    fig.update_layout(barmode="overlay", height=120 + 40 * plan.cp_size, template="plotly_white",
                      margin=dict(l=80, r=10, t=40, b=40), xaxis_title="position in pack",
                      yaxis=dict(categoryorder="category descending"),
                      title=f"zig-zag CP of pack r{rank}·mb{micro_batch} ({pack.num_tokens} tokens, cp={plan.cp_size})")
    return fig


def summary_html(plan: PackingPlan) -> str:
    s = plan.summary()
    return ("<span class='rlbench-packing-summary'>"
            f"{s['sequences']} seqs · {s['tokens']} tokens · <b>{s['n_micro_batches']}</b> micro-batches/rank · "
            f"pad {s['pad_tokens']} tok · rank imbalance {s['rank_imbalance']:.3f} · "
            f"pack imbalance {s['pack_imbalance']:.3f} · "
            f"lockstep idle {100 * s['lockstep_idle']:.1f}% · budget fill {100 * s['budget_fill']:.1f}%</span>")


def _divisors(n: int, limit: int = 8) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0] or [1]


class PackingInspector(WidgetMixin):
    """Live view of how one step's sequences are packed, per DP rank / micro-batch and per CP rank.

    Args:
        source: a list of lengths, a RolloutBatch / Sample list, or a trainer (uses `.last_rollout`).
        max_tokens_per_gpu: initial budget; defaults to the longest sequence (the smallest valid value).
        dp_size, cp_size: initial DP and CP sizes.
        backend: plotting backend for `FigureView`.
    """

    def __init__(self, source: Any, *, max_tokens_per_gpu: int | None = None, dp_size: int = 1,
                 cp_size: int = 1, backend: str = "auto") -> None:
        self.lengths, self.samples = self._read(source)
        if not self.lengths:
            raise ValueError("PackingInspector needs at least one sequence; run a rollout first")
        longest, total = max(self.lengths), sum(self.lengths)
        budget = max_tokens_per_gpu or longest
        self.max_tokens = widgets.IntSlider(value=budget, min=1, max=max(total, budget), step=1,
                                            description="max_tokens_per_gpu", continuous_update=False,
                                            style={"description_width": "initial"})
        dps = _divisors(len(self.lengths))
        self.dp = widgets.SelectionSlider(options=dps, value=dp_size if dp_size in dps else 1, description="dp")
        self.cp = widgets.SelectionSlider(options=[1, 2, 4, 8], value=cp_size, description="cp")
        self.packer = widgets.ToggleButtons(options=PACKERS, value=PACKERS[0], description="packer")
        self.group_by = widgets.ToggleButtons(options=GROUPINGS, value="rank", description="group by")
        self.cp_pack = widgets.Dropdown(description="CP view of", options=[])
        self.summary = widgets.HTML()
        self.plan: PackingPlan | None = None
        self.error: str | None = None
        self.packs_view = FigureView(go.Figure(), backend=backend)
        self.cp_view = FigureView(go.Figure(), backend=backend)
        for w in (self.max_tokens, self.dp, self.cp, self.packer):
            w.observe(lambda _: self.repack(), names="value")
        self.group_by.observe(lambda _: self._draw_packs(), names="value")
        self.cp_pack.observe(lambda _: self._draw_cp(), names="value")
        controls = widgets.VBox([widgets.HBox([self.max_tokens, self.dp, self.cp]),
                                 widgets.HBox([self.packer, self.group_by])])
        self.widget = widgets.VBox([controls, self.summary, self.packs_view.widget, self.cp_pack,
                                    self.cp_view.widget])
        self.repack()

    @staticmethod
    def _read(source: Any) -> tuple[list[int], list | None]:
        """(lengths, Samples or None): plain lengths are packed as zero-token sequences of those lengths."""
        if isinstance(source, Sequence) and all(isinstance(n, int) for n in source):
            return [int(n) for n in source], None
        samples = samples_of(source)
        return [s.total_length for s in samples], samples

    def set_lengths(self, source: Any) -> None:
        """Inspect new lengths (or a new rollout) with the current controls."""
        self.lengths, self.samples = self._read(source)
        self.dp.options = _divisors(len(self.lengths))
        self.max_tokens.max = max(sum(self.lengths), self.max_tokens.value)
        self.repack()

    def repack(self) -> PackingPlan | None:
        """Re-plans with the current control values and redraws; a rejected setting shows the library's error."""
        try:
            source = {"samples": self.samples} if self.samples is not None else {"lengths": self.lengths}
            self.plan = plan_packing(max_tokens_per_gpu=self.max_tokens.value, dp_size=self.dp.value,
                                     cp_size=self.cp.value, packer=self.packer.value, **source)
            self.error = None
        except ValueError as exc:  # the library explains what is wrong with this setting
            self.plan, self.error = None, str(exc)
            self.summary.value = f"<span class='rlbench-packing-error' style='color:#c00'>{html.escape(str(exc))}</span>"
            return None
        self.summary.value = summary_html(self.plan)
        options = [(f"rank {r} · mb {m}", (r, m)) for r in range(self.plan.dp_size)
                   for m in range(len(self.plan.packs[r]))]
        keep = self.cp_pack.value if self.cp_pack.value in [v for _, v in options] else options[0][1]
        self.cp_pack.options = options
        self.cp_pack.value = keep
        self._draw_packs()
        self._draw_cp()
        return self.plan

    def _draw_packs(self) -> None:
        if self.plan is not None:
            self.packs_view.figure = packs_figure(self.plan, self.group_by.value)
            self.packs_view.refresh()

    def _draw_cp(self) -> None:
        if self.plan is not None and self.cp_pack.value is not None:
            self.cp_view.figure = cp_figure(self.plan, *self.cp_pack.value)
            self.cp_view.refresh()
