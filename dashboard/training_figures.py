"""The job page's Training tab: job-wide training and validation loss with the job's markers
(restarts, evictions, incidents, checkpoints, faults) on the x axis, and throughput with the number
of ranks reporting, built by pure functions from the controller's overview
(:class:`JobOverviewPublic`). Trace order is fixed (see each function) so that the page can extend
the figures in place with ``dash.Patch`` (:mod:`dashboard.job_views`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from controller.schemas import MARKER_KINDS, JobMarker, JobOverviewPublic
from dashboard.plotting import base_layout, empty_figure, round_sig

MARKER_STYLE: dict[str, dict[str, Any]] = {
    "restart": {"symbol": "triangle-up", "color": "#d62728", "level": 0.04},
    "eviction": {"symbol": "x", "color": "#ff7f0e", "level": 0.10},
    "incident": {"symbol": "diamond", "color": "#9467bd", "level": 0.16},
    "checkpoint": {"symbol": "square", "color": "#2ca02c", "level": 0.22},
    "fault": {"symbol": "star", "color": "#8c564b", "level": 0.28},
}
"""How each kind of :class:`JobMarker` is drawn on the loss curve (``level``: height above the x axis,
as a fraction of the plot)."""
MARKER_TRACE0 = 2
"""Index of the first marker trace in :func:`overview_loss_figure` (after train and validation loss)."""


def val_points(ov: JobOverviewPublic) -> tuple[list[int], list[float]]:
    """The steps that have a validation loss, and those losses."""
    pairs = [(s, v) for s, v in zip(ov.step, ov.val_loss, strict=False) if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


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


def overview_loss_figure(ov: JobOverviewPublic | None) -> go.Figure:
    """Job-wide training loss (mean over ranks) and validation loss against step, with the job's
    markers on the x axis: traces ``[train loss, validation loss, *one per MARKER_KINDS]`` in that
    order, always present (possibly empty) so the page can extend them. The markers sit on a hidden
    second y axis spanning the plot (0..1), near its bottom; clicking one gives its ``customdata``."""
    if ov is None or not ov.step:
        return empty_figure("Loss")
    vx, vy = val_points(ov)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(ov.step), y=[round_sig(v, 6) for v in ov.loss], mode="lines", name="train loss",
                             connectgaps=False, line={"color": "#1f77b4"}))
    fig.add_trace(go.Scatter(x=vx, y=[round_sig(v, 6) for v in vy], mode="lines+markers", name="validation loss",
                             line={"color": "#ff7f0e"}, showlegend=bool(vx)))
    for kind in MARKER_KINDS:
        style = MARKER_STYLE[kind]
        pts = marker_points(ov.markers, kind)
        fig.add_trace(go.Scatter(
            **pts, mode="markers", name=kind, yaxis="y2", showlegend=bool(pts["x"]),
            marker={"symbol": style["symbol"], "color": style["color"], "size": 11,
                    "line": {"width": 1, "color": "white"}},
            hovertemplate="%{text}<br>step %{x}<extra>" + kind + "</extra>",
        ))
    return base_layout(fig, "Loss", "step", "loss", ov.job_id,
                   yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True},
                   hovermode="closest")


def overview_throughput_figure(ov: JobOverviewPublic | None) -> go.Figure:
    """Tokens per second summed over ranks, and the number of ranks that reported each step (right
    axis): traces ``[tokens / s, ranks reporting]``."""
    if ov is None or not ov.step:
        return empty_figure("Throughput")
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(ov.step), y=[round_sig(v) for v in ov.tokens_per_s], mode="lines",
                             name="tokens / s (all ranks)", line={"color": "#1f77b4"}))
    fig.add_trace(go.Scatter(x=list(ov.step), y=list(ov.reporting), mode="lines", name="ranks reporting",
                             yaxis="y2", line={"color": "#888", "dash": "dot", "shape": "hv"}))
    return base_layout(fig, "Throughput", "step", "tokens / s", ov.job_id,
                   yaxis={"title": {"text": "tokens / s"}, "rangemode": "tozero"},
                   yaxis2={"overlaying": "y", "side": "right", "title": {"text": "ranks"}, "rangemode": "tozero"})
