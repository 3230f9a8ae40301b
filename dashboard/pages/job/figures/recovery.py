"""The job page's Incidents, Checkpoints and Goodput tabs: incident timelines (fault, detected,
acted, recovered), checkpoints against step with the restarts that restored them, and where the
wall time went; built by pure functions from wire-schema objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

import plotly.graph_objects as go

from dashboard.figures.base import base_layout, empty_figure
from dashboard.format import DASH, round_sig
from vigil.contract.schemas import LOST_CAUSES, CheckpointPublic, GoodputPublic, IncidentPublic, JobMarker

PHASES: tuple[tuple[str, str, str], ...] = (
    ("fault", "fault", "#8c564b"),
    ("detected", "detected", "#9467bd"),
    ("acted", "acted", "#ff7f0e"),
    ("recovered", "recovered", "#2ca02c"),
)
"""An incident's timeline: when the fault fired, when Vigil detected it, acted, and the job recovered."""


# -- Incidents ---------------------------------------------------------------------------------------


def incident_label(inc: IncidentPublic) -> str:
    """``#3 hang``"""
    return f"#{inc.id} {inc.kind.value}"


def incident_timeline_figure(timelines: Sequence[tuple[IncidentPublic, Mapping[str, datetime]]]) -> go.Figure:
    """Each incident as a row: a line through its phases and one marker trace per phase of
    :data:`PHASES` (fault fired, detected, acted, recovered; those it reached). ``timelines``: each
    incident with its phase times (see :func:`dashboard.pages.job.joins.incident_phases`)."""
    if not timelines:
        return empty_figure("Incidents", "no incidents")
    fig = go.Figure()
    for inc, phases in timelines:
        times = [phases[k] for k, _, _ in PHASES if k in phases]
        fig.add_trace(go.Scatter(x=times, y=[incident_label(inc)] * len(times), mode="lines",
                                 line={"color": "#bbb", "width": 6}, showlegend=False, hoverinfo="skip"))
    for key, name, color in PHASES:
        pts = [(inc, ph[key]) for inc, ph in timelines if key in ph]
        fig.add_trace(go.Scatter(
            x=[t for _, t in pts], y=[incident_label(i) for i, _ in pts], mode="markers", name=name,
            marker={"color": color, "size": 12}, customdata=[i.id for i, _ in pts],
            hovertemplate="%{y}: " + name + " at %{x}<extra></extra>",
        ))
    return base_layout(fig, "Incident timelines", "time (UTC)", "", None,
                   yaxis={"type": "category", "autorange": "reversed"},
                   height=max(220, 90 + 40 * len(timelines)))


# -- Checkpoints -------------------------------------------------------------------------------------


def checkpoint_figure(ckpts: Sequence[CheckpointPublic], restores: Sequence[tuple[JobMarker, CheckpointPublic | None]],
                      revision: str | None = None) -> go.Figure:
    """Checkpoints against step: size (MB), valid ones as green squares, invalid ones as red crosses;
    each restart a dashed vertical line at its step, labelled with the checkpoint it restored."""
    if not ckpts and not restores:
        return empty_figure("Checkpoints", "no checkpoints yet")
    fig = go.Figure()
    for valid, name, symbol, color in ((True, "valid", "square", "#2ca02c"), (False, "invalid", "x", "#d62728")):
        cs = [c for c in ckpts if c.valid is valid]
        fig.add_trace(go.Scatter(
            x=[c.step for c in cs], y=[round_sig(c.bytes / 1e6) for c in cs], mode="markers", name=name,
            marker={"symbol": symbol, "color": color, "size": 12}, text=[c.path for c in cs],
            hovertemplate="step %{x}: %{y} MB<br>%{text}<extra>" + name + "</extra>",
        ))
    for marker, restored in restores:
        if marker.step is None:
            continue
        what = f"restored step {restored.step}" if restored is not None else "restored: unknown"
        fig.add_vline(x=marker.step, line={"dash": "dash", "color": "#d62728"},
                      annotation_text=f"restart: {what}", annotation_position="top")
    return base_layout(fig, "Checkpoints", "step", "size (MB)", revision, yaxis={"title": {"text": "size (MB)"},
                                                                               "rangemode": "tozero"})


# -- Goodput -----------------------------------------------------------------------------------------


def goodput_figure(gp: GoodputPublic | None) -> go.Figure:
    """Where the wall time went: productive time and the time lost per cause (seconds), one bar each
    (causes in :data:`LOST_CAUSES` order, then any other the controller reports)."""
    if gp is None or gp.wall_s <= 0:
        return empty_figure("Goodput", "the job has not started")
    causes = [c for c in LOST_CAUSES if c in gp.lost_s] + sorted(c for c in gp.lost_s if c not in LOST_CAUSES)
    x = ["productive", *(f"lost: {c.replace('_', ' ')}" for c in causes)]
    y = [gp.productive_s, *(gp.lost_s[c] for c in causes)]
    colors = ["#2ca02c", *(["#d62728"] * len(causes))]
    fig = go.Figure(go.Bar(x=x, y=[round_sig(v) for v in y], marker={"color": colors},
                           text=[f"{100 * v / gp.wall_s:.1f}%" for v in y], textposition="outside",
                           hovertemplate="%{x}: %{y:.1f} s<extra></extra>"))
    ettr = DASH if gp.ettr is None else f"{gp.ettr:.3f}"
    return base_layout(fig, f"Where the {gp.wall_s:.0f} s went · ETTR {ettr}", "", "seconds", gp.job_id)
