"""The compare page's figures and what they draw: the jobs picked (``?jobs=``), each job's curves
(:class:`CompareTrace`: loss against step, wall time and cumulative bits sent) and the three figures,
one trace per job in each, the same colour per job across the three.

Nothing here fetches data: every function maps wire-schema objects (:class:`JobPublic`,
:class:`JobOverviewPublic`) to traces and Plotly figures, unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.colors
import plotly.graph_objects as go

from dashboard.figures.base import WAITING_TEXT, base_layout, empty_figure
from vigil.contract.schemas import JobOverviewPublic, JobPublic

MAX_COMPARED_JOBS = 8
"""The compare page shows at most this many jobs at once."""


def parse_job_ids(value: str | Sequence[str] | None) -> list[str]:
    """``"a,b, a"`` (``?jobs=``) or a list of ids -> ``["a", "b"]``: in order, without repeats or
    blanks, at most :data:`MAX_COMPARED_JOBS`."""
    parts = value.split(",") if isinstance(value, str) else list(value or [])
    out: list[str] = []
    for part in parts:
        part = str(part).strip()
        if part and part not in out:
            out.append(part)
    return out[:MAX_COMPARED_JOBS]


def cumulative_bits(steps: Sequence[int], wire_bytes: Sequence[int]) -> list[float]:
    """Bits put on the wire by the end of each step: the running sum of ``wire_bytes`` x 8.

    ``steps`` ascending. When the series is thinned (a gap of ``g`` steps between two points), the
    point stands for its gap: its bytes count ``g`` times, so the total stays an estimate of all
    steps rather than of the points shown; without gaps (the usual case) the sum is exact.
    """
    out: list[float] = []
    total = 0.0
    prev: int | None = None
    for step, nbytes in zip(steps, wire_bytes, strict=True):
        weight = 1 if prev is None else max(step - prev, 1)
        total += 8.0 * float(nbytes) * weight
        out.append(total)
        prev = step
    return out


def elapsed_s(ts: Sequence[float]) -> list[float]:
    """Seconds since the first point (the job's first reported step)."""
    if not ts:
        return []
    t0 = ts[0]
    return [t - t0 for t in ts]


@dataclass(frozen=True)
class CompareTrace:
    """One job's curves on the compare page."""

    job_id: str
    label: str
    step: list[int]
    loss: list[float | None]
    elapsed_s: list[float]
    bits: list[float]


def job_label(job: JobPublic) -> str:
    """``name (optimizer)``: how the compare page names a job's traces."""
    return f"{job.name} ({job.spec.optimizer.kind})"


def compare_traces(entries: Sequence[tuple[JobPublic, JobOverviewPublic | None]]) -> list[CompareTrace]:
    """A :class:`CompareTrace` per job, labelled ``name (optimizer)`` (and the id where two labels clash)."""
    labels = [job_label(job) for job, _ in entries]
    out = []
    for (job, ov), label in zip(entries, labels, strict=True):
        if labels.count(label) > 1:
            label = f"{label} {job.id}"
        if ov is None:
            out.append(CompareTrace(job.id, label, [], [], [], []))
            continue
        out.append(CompareTrace(job.id, label, list(ov.step), list(ov.loss), elapsed_s(ov.ts),
                                cumulative_bits(ov.step, ov.wire_bytes)))
    return out


COMPARE_AXES = (
    ("step", "Loss vs step", "step"),
    ("elapsed_s", "Loss vs wall time", "seconds since the first step"),
    ("bits", "Loss vs bits sent", "bits sent (cumulative, all ranks)"),
)
"""The compare page's three figures: (CompareTrace field on x, title, x-axis title)."""


def compare_figures(traces: Sequence[CompareTrace]) -> list[go.Figure]:
    """Loss against step, wall time and cumulative bits sent: one trace per job in each, same colour
    per job across the three."""
    figs = []
    palette = plotly.colors.qualitative.Plotly
    for x_field, title, x_title in COMPARE_AXES:
        with_data = [t for t in traces if t.step]
        if not with_data:
            figs.append(empty_figure(title, "pick jobs to compare" if not traces else WAITING_TEXT))
            continue
        fig = go.Figure()
        for i, t in enumerate(traces):
            if not t.step:
                continue
            fig.add_trace(go.Scatter(
                x=getattr(t, x_field), y=t.loss, mode="lines" if len(t.step) > 1 else "lines+markers",
                name=t.label, legendgroup=t.job_id, line={"color": palette[i % len(palette)]}, connectgaps=False,
                customdata=t.step, hovertemplate="%{fullData.name}<br>step %{customdata}: loss %{y:.4g}<extra></extra>",
            ))
        xaxis: dict[str, Any] = {"title": {"text": x_title}}
        if x_field == "bits":
            xaxis["tickformat"] = "~s"
        base_layout(fig, title, x_title, "loss", title, xaxis=xaxis, showlegend=True,
                    legend={"orientation": "h", "y": -0.3})
        if x_field == "bits" and not any(b for t in with_data for b in t.bits):
            fig.add_annotation(text="no collective traffic reported", xref="paper", yref="paper", x=0.5, y=0.95,
                               showarrow=False, font={"color": "#888"})
        figs.append(fig)
    return figs
