"""What every figure of the dashboard shares: the empty "waiting for data" figure, margins, rounding
and the common layout (title, axis titles, ``uirevision``).

Empty input gives an empty figure whose only content is a message (by default "waiting for data"),
never an exception: a job or node that has not reported yet is a normal state, not an error. Values
are rounded to a few significant digits before they go into a figure, which keeps its JSON small.
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go

WAITING_TEXT = "waiting for data"
MARGIN = {"l": 60, "r": 20, "t": 50, "b": 45}
"""Plot margins (pixels) of every figure."""


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


def round_sig(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded to ``digits`` significant digits (smaller JSON; ``None`` and non-finite as ``None``)."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


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
