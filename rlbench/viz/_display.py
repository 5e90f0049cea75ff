"""Display plumbing shared by the widgets: notebook repr delegation and a redrawable plotly view.

`FigureView` keeps a plain `go.Figure` as the state that widgets mutate, and pushes it to the page
on `refresh()`. With `anywidget` installed it shows a `go.FigureWidget` updated in place; without
it, it re-renders the figure inside an `ipywidgets.Output` (the JupyterLab plotly mime renderer
draws it). Both updates are trait assignments, so they are safe to call from a worker thread.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

PLOTLY_MIME = "application/vnd.plotly.v1+json"
BACKENDS = ("auto", "output", "figurewidget")


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
    spec["config"] = {"displaylogo": False, "responsive": True}
    return {PLOTLY_MIME: spec, "text/plain": f"<plotly figure: {len(fig.data)} traces>"}


class FigureView:
    """A plotly figure on the page that follows `self.figure` after each `refresh()`.

    Args:
        figure: the figure to show; mutate it (traces, layout) and call `refresh()`.
        backend: "auto", "output" (re-render in an Output widget) or "figurewidget" (needs anywidget).
    """

    def __init__(self, figure: go.Figure, backend: str = "auto") -> None:
        self.figure = figure
        self.backend = resolve_backend(backend)
        if self.backend == "figurewidget":
            self.widget: widgets.DOMWidget = go.FigureWidget(figure)
        else:
            self.widget = widgets.Output(layout=widgets.Layout(width="100%"))
        self.refresh()

    def refresh(self) -> None:
        """Pushes the current state of `self.figure` to the page."""
        if self.backend == "output":
            self.widget.outputs = (
                {"output_type": "display_data", "data": plotly_bundle(self.figure), "metadata": {}},
            )
            return
        fw = self.widget
        with fw.batch_update():  # rebuild: the trace count changes when a widget re-packs
            fw.data = ()
            fw.add_traces(list(self.figure.data))
            fw.layout = self.figure.layout
