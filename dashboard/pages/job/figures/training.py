"""The job page's Training tab: job-wide training and validation loss with the job's markers
(restarts, evictions, incidents, checkpoints, faults) on the x axis, and throughput with the number
of ranks reporting, built from the controller's overview
(:class:`JobOverviewPublic`). Their lines are declared once (:data:`LOSS`, :data:`THROUGHPUT`:
:class:`dashboard.figures.series.LineFigure`), which gives both the whole figure and the ``dash.Patch``
that extends it (:mod:`dashboard.pages.job.figures.overview`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from dashboard.figures.series import Line, LineFigure
from vigil.contract.schemas import MARKER_KINDS, JobMarker, JobOverviewPublic

MARKER_STYLE: dict[str, dict[str, Any]] = {
    "restart": {"symbol": "triangle-up", "color": "#d62728", "level": 0.04},
    "eviction": {"symbol": "x", "color": "#ff7f0e", "level": 0.10},
    "incident": {"symbol": "diamond", "color": "#9467bd", "level": 0.16},
    "checkpoint": {"symbol": "square", "color": "#2ca02c", "level": 0.22},
    "fault": {"symbol": "star", "color": "#8c564b", "level": 0.28},
}
"""How each kind of :class:`JobMarker` is drawn on the loss curve (``level``: height above the x axis,
as a fraction of the plot)."""
LOSS = LineFigure(
    lines=(
        Line("train loss", "loss", digits=6,
             style={"mode": "lines", "connectgaps": False, "line": {"color": "#1f77b4"}}),
        Line("validation loss", "val_loss", digits=6, sparse=True,
             style={"mode": "lines+markers", "line": {"color": "#ff7f0e"}}),
    ),
    title="Loss", empty_title="Loss", y_title="loss",
    layout={"yaxis2": {"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True},
            "hovermode": "closest"},
)
"""Job-wide training loss (mean over ranks) and validation loss against step; the markers follow."""
MARKER_TRACE0 = len(LOSS.lines)
"""Index of the first marker trace in :func:`overview_loss_figure` (after train and validation loss)."""
THROUGHPUT = LineFigure(
    lines=(
        Line("tokens / s (all ranks)", "tokens_per_s", style={"mode": "lines", "line": {"color": "#1f77b4"}}),
        Line("ranks reporting", "reporting", digits=None,
             style={"mode": "lines", "yaxis": "y2", "line": {"color": "#888", "dash": "dot", "shape": "hv"}}),
    ),
    title="Throughput", empty_title="Throughput", y_title="tokens / s",
    layout={"yaxis": {"title": {"text": "tokens / s"}, "rangemode": "tozero"},
            "yaxis2": {"overlaying": "y", "side": "right", "title": {"text": "ranks"}, "rangemode": "tozero"}},
)
"""Tokens per second summed over ranks, and the number of ranks that reported each step (right axis)."""


def marker_points(markers: Sequence[JobMarker], kind: str) -> dict[str, list[Any]]:
    """``x`` (steps), ``y`` (the kind's level), ``text`` and ``customdata`` of the markers of ``kind``
    that have a step; ``customdata`` is ``[kind, step, label, ref, ts]`` (what a click shows)."""
    level = MARKER_STYLE.get(kind, {"level": 0.5})["level"]
    ms = [m for m in markers if m.kind == kind and m.step is not None]
    return {
        "x": [m.step for m in ms],
        "y": [level] * len(ms),
        "text": [m.label for m in ms],
        "customdata": [[m.kind, m.step, m.label, m.ref, m.ts] for m in ms],
    }


def marker_traces(markers: Sequence[JobMarker]) -> list[go.Scatter]:
    """One trace per :data:`MARKER_KINDS` (possibly empty, so the page can fill it), on a hidden second y
    axis spanning the plot (0..1), near its bottom; clicking one gives its ``customdata``."""
    traces = []
    for kind in MARKER_KINDS:
        style = MARKER_STYLE[kind]
        pts = marker_points(markers, kind)
        traces.append(go.Scatter(
            **pts, mode="markers", name=kind, yaxis="y2", showlegend=bool(pts["x"]),
            marker={"symbol": style["symbol"], "color": style["color"], "size": 11,
                    "line": {"width": 1, "color": "white"}},
            hovertemplate="%{text}<br>step %{x}<extra>" + kind + "</extra>",
        ))
    return traces


def overview_loss_figure(ov: JobOverviewPublic | None) -> go.Figure:
    """Job-wide training loss (mean over ranks) and validation loss against step, with the job's
    markers on the x axis: traces ``[train loss, validation loss, *one per MARKER_KINDS]`` in that
    order, always present (possibly empty) so the page can extend them."""
    return LOSS.figure(ov, marker_traces(ov.markers) if ov is not None else ())


def overview_throughput_figure(ov: JobOverviewPublic | None) -> go.Figure:
    """Tokens per second summed over ranks, and the number of ranks that reported each step (right
    axis): traces ``[tokens / s, ranks reporting]``."""
    return THROUGHPUT.figure(ov)
