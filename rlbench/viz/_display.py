"""Display plumbing shared by the widgets: notebook repr delegation and a redrawable plotly view.

`FigureView` keeps a plain `go.Figure` as the state that widgets mutate, and pushes it to the page
on `refresh()`. With `anywidget` installed it shows a `go.FigureWidget` and sends only what changed
(the x/y of the traces that grew, the layout when it changed) in one `batch_update`, so the page
restyles the plot in place; without it, it re-renders the figure inside an `ipywidgets.Output`.
Every figure is drawn at its layout's fixed height (never "responsive"), so a page reload, which
re-creates the views before they are laid out, does not draw them 0 px tall. Streaming updates
(`refresh(throttle=True)`, one per training step) reach the page at most every `MIN_INTERVAL_S`;
the last one always lands (a timer flushes it). Updates are trait assignments, safe from a worker thread.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import threading
import time
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

PLOTLY_MIME = "application/vnd.plotly.v1+json"
BACKENDS = ("auto", "output", "figurewidget")
MIN_INTERVAL_S = 0.5  # streaming updates: a 9-panel restyle per 0.5 s keeps the page responsive
DEFAULT_HEIGHT = 400  # px, for a figure whose layout names no height


class WidgetMixin:
    """Renders `self.widget` when the object is the last expression of a notebook cell."""

    widget: widgets.Widget

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def has_anywidget() -> bool:
    """True when plotly's `FigureWidget` can be built (plotly>=6 needs the anywidget package)."""
    return importlib.util.find_spec("anywidget") is not None


def resolve_backend(backend: str) -> str:
    """Maps "auto" to "figurewidget" when anywidget is importable, else "output"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; pass one of them")
    if backend == "auto":
        return "figurewidget" if has_anywidget() else "output"
    if backend == "figurewidget" and not has_anywidget():
        raise ValueError("backend='figurewidget' needs the anywidget package; pip install anywidget")
    return backend


def plotly_bundle(fig: go.Figure) -> dict:
    """The mime bundle JupyterLab's plotly renderer draws: JSON data/layout plus a text fallback."""
    spec = json.loads(fig.to_json())
    spec["config"] = {"displaylogo": False, "responsive": False}
    spec.setdefault("layout", {}).setdefault("height", DEFAULT_HEIGHT)
    return {PLOTLY_MIME: spec, "text/plain": f"<plotly figure: {len(fig.data)} traces>"}


class FigureView:
    """A plotly figure on the page that follows `self.figure` after each `refresh()`.

    Args:
        figure: the figure to show; mutate it (traces, layout) or replace it, then call `refresh()`.
        backend: "auto", "output" (re-render in an Output widget) or "figurewidget" (needs anywidget).
        min_interval_s: the shortest time between two throttled pushes to the page.
    """

    def __init__(self, figure: go.Figure, backend: str = "auto", *, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.figure = figure
        self.backend = resolve_backend(backend)
        self.min_interval_s = min_interval_s
        self.pushes = 0  # how many times the page was updated (tests and the browser check read it)
        self._lock = threading.RLock()
        self._last_push = -float("inf")
        self._timer: threading.Timer | None = None
        self._pushed_layout: dict | None = None
        if self.backend == "figurewidget":
            self.widget: widgets.DOMWidget = go.FigureWidget(layout={"height": DEFAULT_HEIGHT})
        else:
            self.widget = widgets.Output(layout=widgets.Layout(width="100%"))
        self.refresh()

    def refresh(self, *, throttle: bool = False) -> None:
        """Pushes the current state of `self.figure` to the page.

        `throttle=True` (streaming updates): pushes now if the last push is `min_interval_s` old, else
        leaves it to a timer that pushes the newest state once the interval is over.
        """
        with self._lock:
            wait = self._last_push + self.min_interval_s - time.monotonic()
            if throttle and wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._push()

    def flush(self) -> None:
        """Pushes a pending throttled update now (no-op when none is pending)."""
        with self._lock:
            if self._timer is not None:
                self._push()

    def _push(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last_push = time.monotonic()
        self.pushes += 1
        fig = self.figure
        if fig.layout.height is None:
            fig.layout.height = DEFAULT_HEIGHT
        if self.backend == "output":
            self.widget.outputs = (
                {"output_type": "display_data", "data": plotly_bundle(fig), "metadata": {}},
            )
            return
        fw = self.widget
        layout = fig.layout.to_plotly_json()
        with fw.batch_update():
            if [(t.type, t.name) for t in fw.data] != [(t.type, t.name) for t in fig.data]:
                fw.data = ()  # the traces changed (a re-pack, a new run): rebuild them
                fw.add_traces(list(fig.data))
            else:  # the same traces: send only the arrays that grew or changed
                for dst, src in zip(fw.data, fig.data):
                    for prop in ("x", "y", "text", "visible"):
                        if prop in src and src[prop] != dst[prop]:
                            dst[prop] = src[prop]
            if layout != self._pushed_layout:
                fw.layout = fig.layout
        # plotly stores a FigureWidget's state for new views (a page reload) only when it is built or displayed
        # itself, never inside a VBox; the messages above reach only the views open now. Store what they show.
        fw._widget_data = copy.deepcopy(fw._data)
        if layout != self._pushed_layout:
            fw._widget_layout = copy.deepcopy(fw._layout_obj._props)
            self._pushed_layout = layout
