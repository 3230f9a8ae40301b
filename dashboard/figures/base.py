"""What every figure of the dashboard shares: the empty "waiting for data" figure, margins, the common
layout (title, axis titles, ``uirevision``) and the graph component a page places a figure in.

Empty input gives an empty figure whose only content is a message (by default "waiting for data"),
never an exception: a job or node that has not reported yet is a normal state, not an error. Values
are rounded to a few significant digits (:func:`dashboard.format.round_sig`) before they go into a
figure, which keeps its JSON small.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import dcc

WAITING_TEXT = "waiting for data"
MARGIN = {"l": 60, "r": 20, "t": 50, "b": 45}
"""Plot margins (pixels) of every figure."""
GRAPH_CONFIG = {"displaylogo": False}
"""Plotly's mode bar without its logo, on every graph."""


def empty_figure(title: str = "", message: str = WAITING_TEXT) -> go.Figure:
    """A figure with no traces and ``message`` centred in it (axes hidden)."""
    fig = go.Figure()
    fig.update_layout(
        title={"text": title},
        margin=MARGIN,
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[
            {
                "text": message,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "showarrow": False,
                "font": {"size": 16, "color": "#888"},
            }
        ],
    )
    return fig


def base_layout(fig: go.Figure, title: str, x_title: str, y_title: str, revision: str | None,
                **extra: Any) -> go.Figure:
    """``fig`` with its title, axis titles, the common margins and ``uirevision`` ``revision`` (keeps
    the user's zoom and hidden traces across refreshes); ``extra`` layout keys override these."""
    base: dict[str, Any] = {
        "title": {"text": title},
        "margin": MARGIN,
        "xaxis": {"title": {"text": x_title}},
        "yaxis": {"title": {"text": y_title}},
        "uirevision": revision,
    }
    fig.update_layout(**{**base, **extra})
    return fig


def graph(component_id: str, title: str, height: str, message: str = WAITING_TEXT) -> dcc.Graph:
    """A page's graph ``component_id``, ``height`` high, showing the empty figure until a callback fills it."""
    return dcc.Graph(id=component_id, figure=empty_figure(title, message), style={"height": height},
                     config=GRAPH_CONFIG)
