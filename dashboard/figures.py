"""Figures of the dashboard, built by pure functions.

The per-rank line figures (``loss_figure`` ... ``step_time_heatmap``, from :class:`JobMetrics`) suit
a handful of ranks; the job page's diagnosis views (second half of this module) are built from the
controller's derived views and bounded windows, so they stay small and readable for 10,000 ranks.

Every function takes wire-schema objects (:mod:`controller.schemas`) and returns a
``plotly.graph_objects.Figure``; nothing here fetches data or knows about Dash, so each figure is
unit-tested without a browser. Empty input gives an empty figure whose only content is a
"waiting for data" annotation, never an exception: a job that has not reported a step yet is a
normal state, not an error.

Steps can repeat within one rank's series (a restart from a checkpoint replays the steps since
that checkpoint). Line plots keep the series in the order the controller returned it, so a
rollback shows as the line stepping back; the heatmap keeps the latest value per (rank, step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import plotly.graph_objects as go

from controller.schemas import (
    LOST_CAUSES,
    MARKER_KINDS,
    CheckpointPublic,
    GoodputPublic,
    IncidentPublic,
    JobCollectivesPublic,
    JobMarker,
    JobMetrics,
    JobOverviewPublic,
    JobStepsPublic,
    RankSeries,
    RankStepsPublic,
    StepHeatmapPublic,
)
from dashboard.collectives_view import estimated_tags, mark_estimated

WAITING_TEXT = "waiting for data"
HEATMAP_MAX_STEPS = 1000
"""The heatmap shows at most this many most recent steps; wider ones are unreadable and slow."""

_MARGIN = {"l": 60, "r": 20, "t": 50, "b": 45}


def empty_figure(title: str = "", message: str = WAITING_TEXT) -> go.Figure:
    """A figure with no traces and ``message`` centred in it (axes hidden)."""
    fig = go.Figure()
    fig.update_layout(
        title={"text": title},
        margin=_MARGIN,
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


def _ranks_with_data(metrics: JobMetrics | None) -> list[RankSeries]:
    if metrics is None:
        return []
    return sorted((r for r in metrics.ranks if r.step), key=lambda r: r.rank)


def _rank_lines(
    series: Sequence[RankSeries], field: str, title: str, y_title: str, revision: str
) -> go.Figure:
    """One line per rank: x = step, y = ``field`` of :class:`RankSeries` (``None`` leaves a gap)."""
    fig = go.Figure()
    for rs in series:
        fig.add_trace(
            go.Scatter(
                x=list(rs.step),
                y=list(getattr(rs, field)),
                mode="lines+markers" if len(rs.step) <= 1 else "lines",
                name=f"rank {rs.rank}",
                connectgaps=False,
            )
        )
    fig.update_layout(
        title={"text": title},
        margin=_MARGIN,
        xaxis={"title": {"text": "step"}},
        yaxis={"title": {"text": y_title}},
        legend={"title": {"text": "rank"}},
        # Keeps the user's zoom and hidden traces across the periodic refreshes of one job.
        uirevision=revision,
    )
    return fig


def loss_figure(metrics: JobMetrics | None) -> go.Figure:
    """Training loss per rank against step; one trace per rank that has reported a step.

    Non-finite losses arrive as ``None`` and are drawn as gaps.
    """
    series = _ranks_with_data(metrics)
    if not series:
        return empty_figure("Training loss")
    assert metrics is not None
    return _rank_lines(series, "loss", "Training loss", "loss", metrics.job_id)


def step_time_figure(metrics: JobMetrics | None) -> go.Figure:
    """Wall-clock time of each step per rank (seconds) against step; one trace per rank."""
    series = _ranks_with_data(metrics)
    if not series:
        return empty_figure("Step time")
    assert metrics is not None
    return _rank_lines(series, "step_time_s", "Step time", "seconds", metrics.job_id)


def throughput_figure(metrics: JobMetrics | None) -> go.Figure:
    """Tokens per second per rank against step; one trace per rank, plus a ``total`` trace.

    ``total`` sums, for every step, the ranks that reported that step (last value per rank wins
    when a step repeats); it is added only when there is more than one rank.
    """
    series = _ranks_with_data(metrics)
    if not series:
        return empty_figure("Throughput")
    assert metrics is not None
    fig = _rank_lines(series, "tokens_per_s", "Throughput", "tokens / s", metrics.job_id)
    if len(series) > 1:
        per_step: dict[int, dict[int, float]] = {}
        for rs in series:
            for step, tps in zip(rs.step, rs.tokens_per_s, strict=False):
                per_step.setdefault(step, {})[rs.rank] = tps
        steps = sorted(per_step)
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=[sum(per_step[s].values()) for s in steps],
                mode="lines",
                name="total",
                line={"dash": "dot", "color": "#444"},
            )
        )
    return fig


def step_time_heatmap(metrics: JobMetrics | None, max_steps: int = HEATMAP_MAX_STEPS) -> go.Figure:
    """Rank x step heatmap of step time (seconds), over the latest ``max_steps`` steps.

    Rows are ranks (ascending), columns the union of the ranks' steps; a rank that did not report
    a step leaves an empty cell. A straggler shows as a hot row, a job-wide stall as a hot column.
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    series = _ranks_with_data(metrics)
    if not series:
        return empty_figure("Step time per rank")
    assert metrics is not None
    cells: dict[int, dict[int, float]] = {}
    all_steps: set[int] = set()
    for rs in series:
        row = cells.setdefault(rs.rank, {})
        for step, seconds in zip(rs.step, rs.step_time_s, strict=False):
            row[step] = seconds  # the latest report of a repeated step wins
            all_steps.add(step)
    steps = sorted(all_steps)[-max_steps:]
    ranks = sorted(cells)
    z = [[cells[r].get(s) for s in steps] for r in ranks]
    fig = go.Figure(
        go.Heatmap(
            x=steps,
            y=[f"rank {r}" for r in ranks],
            z=z,
            colorscale="Viridis",
            colorbar={"title": {"text": "s"}},
            hoverongaps=False,
            hovertemplate="%{y}, step %{x}: %{z:.3f} s<extra></extra>",
        )
    )
    fig.update_layout(
        title={"text": "Step time per rank"},
        margin=_MARGIN,
        xaxis={"title": {"text": "step"}},
        yaxis={"title": {"text": "rank"}, "type": "category", "autorange": "reversed"},
        uirevision=metrics.job_id,
    )
    return fig


# ==================================================================================================
# The job page's diagnosis views: built from the controller's derived views (overview, binned
# heatmap, goodput) and the step / collective series of a bounded window, never one trace per rank
# beyond LINES_MAX_RANKS. Trace order is fixed (see each function) so that the page can extend the
# line figures in place with ``dash.Patch`` (:mod:`dashboard.job_views`).
# ==================================================================================================

LINES_MAX_RANKS = 8
"""Up to this many ranks, step time is drawn as one line per rank; beyond, as percentile bands."""
STRAGGLER_RATIO = 1.2
"""A rank whose mean step time is at least this many times the median rank's is highlighted."""
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
BREAKDOWN_PARTS: tuple[tuple[str, str, str], ...] = (
    ("data", "data", "#8c564b"),
    ("fwd_bwd", "forward+backward", "#1f77b4"),
    ("optim", "optimizer", "#2ca02c"),
    ("transfer", "communication", "#ff7f0e"),
    ("wait", "waiting in collectives", "#d62728"),
    ("other", "other", "#c7c7c7"),
)
"""The parts of a step, in stacking order: key, legend name, colour. ``transfer`` is the time inside
collectives minus the wait in them; ``other`` what the step time leaves unexplained."""
PHASES: tuple[tuple[str, str, str], ...] = (
    ("fault", "fault", "#8c564b"),
    ("detected", "detected", "#9467bd"),
    ("acted", "acted", "#ff7f0e"),
    ("recovered", "recovered", "#2ca02c"),
)
"""An incident's timeline: when the fault fired, when Vigil detected it, acted, and the job recovered."""


def round_sig(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded to ``digits`` significant digits (smaller JSON; ``None`` and non-finite as ``None``)."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def _layout(fig: go.Figure, title: str, x_title: str, y_title: str, revision: str | None, **extra: Any) -> go.Figure:
    base: dict[str, Any] = {
        "title": {"text": title},
        "margin": _MARGIN,
        "xaxis": {"title": {"text": x_title}},
        "yaxis": {"title": {"text": y_title}},
        "uirevision": revision,
    }
    fig.update_layout(**{**base, **extra})
    return fig


# -- Training -------------------------------------------------------------------------------------


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
    return _layout(fig, "Loss", "step", "loss", ov.job_id,
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
    return _layout(fig, "Throughput", "step", "tokens / s", ov.job_id,
                   yaxis={"title": {"text": "tokens / s"}, "rangemode": "tozero"},
                   yaxis2={"overlaying": "y", "side": "right", "title": {"text": "ranks"}, "rangemode": "tozero"})


def slowest_title(ov: JobOverviewPublic, n: int = 3) -> str:
    """``Step time over 12 ranks · slowest: rank 5 (4.9x median)``: the stragglers of the window (at
    least :data:`STRAGGLER_RATIO` x the median rank, at most ``n``), else the slowest rank."""
    named = [r for r in ov.slowest_ranks if r.vs_median >= STRAGGLER_RATIO][:n] or ov.slowest_ranks[:1]
    text = ", ".join(f"rank {r.rank} ({r.vs_median:.1f}x median)" for r in named)
    return f"Step time over {ov.ranks} ranks" + (f" · slowest: {text}" if text else "")


def step_time_bands_figure(ov: JobOverviewPublic | None) -> go.Figure:
    """Step time percentiles over ranks against step: traces ``[p50, p90, max]``, the p50..p90 band
    filled; the max's hover and ``customdata`` name the slowest rank of each step, and the title names
    the slowest ranks of the window. One trace per percentile whatever the number of ranks."""
    if ov is None or not ov.step:
        return empty_figure("Step time")
    x = list(ov.step)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[round_sig(v) for v in ov.step_time_p50_s], mode="lines", name="p50",
                             line={"color": "#1f77b4"}))
    fig.add_trace(go.Scatter(x=x, y=[round_sig(v) for v in ov.step_time_p90_s], mode="lines", name="p90",
                             fill="tonexty", fillcolor="rgba(31,119,180,0.2)", line={"color": "#6baed6"}))
    fig.add_trace(go.Scatter(
        x=x, y=[round_sig(v) for v in ov.step_time_max_s], mode="lines", name="max (slowest rank)",
        customdata=list(ov.slowest_rank), line={"color": "#d62728", "dash": "dot"},
        hovertemplate="step %{x}: %{y:.3f} s, rank %{customdata}<extra>max</extra>",
    ))
    return _layout(fig, slowest_title(ov), "step", "seconds", ov.job_id, hovermode="x unified")


def rank_lines_figure(steps: JobStepsPublic | None, highlight: Sequence[int] = ()) -> go.Figure:
    """Step time of each rank against step, one line per rank (for jobs of at most
    :data:`LINES_MAX_RANKS` ranks: ``steps`` should hold no more); ``highlight`` ranks drawn thick
    and red. Raises ``ValueError`` for more ranks: the page draws bands then."""
    data = [r for r in (steps.data if steps else []) if r.step]
    if not data:
        return empty_figure("Step time per rank")
    if len(data) > LINES_MAX_RANKS:
        raise ValueError(f"{len(data)} ranks: at most {LINES_MAX_RANKS} are drawn as lines")
    assert steps is not None
    fig = go.Figure()
    hot = set(highlight)
    for r in sorted(data, key=lambda r: r.rank):
        style = {"color": "#d62728", "width": 3} if r.rank in hot else {"width": 1.5}
        fig.add_trace(go.Scatter(x=list(r.step), y=[round_sig(v) for v in r.step_time_s], mode="lines",
                                 name=f"rank {r.rank}" + (" (slow)" if r.rank in hot else ""), line=style,
                                 customdata=[r.rank] * len(r.step)))
    return _layout(fig, "Step time per rank", "step", "seconds", steps.job_id)


# -- Ranks: the binned heatmap ---------------------------------------------------------------------


def bin_label(lo: int, hi: int, noun: str = "rank") -> str:
    """``rank 5`` for a bin of one, ``ranks 8-15`` for a wider one."""
    return f"{noun} {lo}" if lo == hi else f"{noun}s {lo}-{hi}"


def binned_heatmap_figure(hm: StepHeatmapPublic | None, highlight: Sequence[int] = ()) -> go.Figure:
    """The controller's binned rank x step heatmap of step time: rows are rank bins (``rank 5`` or
    ``ranks 8-15``, ascending from the top), columns step bins (x at each bin's middle step); a cell
    is the max over its bin, so a straggler's row stays hot. Rows holding a ``highlight`` rank are
    labelled in bold red with a ``▶``."""
    if hm is None or not hm.z or not hm.step_lo:
        return empty_figure("Step time per rank")
    labels = [bin_label(lo, hi) for lo, hi in zip(hm.rank_lo, hm.rank_hi, strict=True)]
    hot = set(highlight)
    tick = [
        f"<b style='color:#d62728'>▶ {lab}</b>" if any(lo <= h <= hi for h in hot) else lab
        for lab, lo, hi in zip(labels, hm.rank_lo, hm.rank_hi, strict=True)
    ]
    x = [(lo + hi) / 2 for lo, hi in zip(hm.step_lo, hm.step_hi, strict=True)]
    fig = go.Figure(go.Heatmap(
        x=x, y=labels, z=[[round_sig(v, 3) for v in row] for row in hm.z], colorscale="Viridis",
        colorbar={"title": {"text": "s"}}, hoverongaps=False,
        hovertemplate="%{y}, step ~%{x}: %{z:.3f} s (max of the bin)<extra></extra>",
    ))
    return _layout(fig, "Step time per rank (max per bin)", "step", "rank", hm.job_id,
                   yaxis={"title": {"text": "rank"}, "type": "category", "autorange": "reversed",
                          "tickvals": labels, "ticktext": tick})


# -- Step breakdown ----------------------------------------------------------------------------------


def step_parts(step_time: float | None, data: float | None, fwd_bwd: float | None, optim: float | None,
               comm: float | None, wait: float | None) -> dict[str, float]:
    """One rank's step split into :data:`BREAKDOWN_PARTS` (seconds; an unreported part counts 0,
    ``other`` is what the step time leaves, never below 0). The wait inside collectives is part of
    the communication time, so ``transfer`` is ``comm - wait``."""
    w = wait or 0.0
    parts = {"data": data or 0.0, "fwd_bwd": fwd_bwd or 0.0, "optim": optim or 0.0,
             "transfer": max((comm or 0.0) - w, 0.0), "wait": w}
    parts["other"] = max((step_time or 0.0) - sum(parts.values()), 0.0)
    return parts


def _rank_parts(r: RankStepsPublic, i: int) -> dict[str, float]:
    return step_parts(r.step_time_s[i], r.data_s[i], r.fwd_bwd_s[i], r.optim_s[i], r.comm_s[i], r.comm_wait_s[i])


def breakdown_by_step(steps: JobStepsPublic | None, rank: int | None = None) -> tuple[list[int], dict[str, list[float]]]:
    """Per step, the mean over the ranks in ``steps`` (or ``rank``'s own) of each part of the step."""
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for r in steps.data if steps else []:
        if rank is not None and r.rank != rank:
            continue
        for i, s in enumerate(r.step):
            acc = sums.setdefault(s, dict.fromkeys((k for k, _, _ in BREAKDOWN_PARTS), 0.0))
            for k, v in _rank_parts(r, i).items():
                acc[k] += v
            counts[s] = counts.get(s, 0) + 1
    xs = sorted(sums)
    return xs, {k: [sums[s][k] / counts[s] for s in xs] for k, _, _ in BREAKDOWN_PARTS}


def breakdown_by_rank(steps: JobStepsPublic | None) -> tuple[list[int], dict[str, list[float]]]:
    """Per rank in ``steps`` (ascending), the mean over its steps of each part of the step."""
    ranks: list[int] = []
    out: dict[str, list[float]] = {k: [] for k, _, _ in BREAKDOWN_PARTS}
    for r in sorted(steps.data if steps else [], key=lambda r: r.rank):
        if not r.step:
            continue
        ranks.append(r.rank)
        parts = [_rank_parts(r, i) for i in range(len(r.step))]
        for k, values in out.items():
            values.append(sum(p[k] for p in parts) / len(parts))
    return ranks, out


def _stacked(x: Sequence[Any], parts: dict[str, list[float]], title: str, x_title: str, revision: str | None,
             customdata: Sequence[Any] | None = None, **extra: Any) -> go.Figure:
    fig = go.Figure()
    for key, name, color in BREAKDOWN_PARTS:
        fig.add_trace(go.Bar(x=list(x), y=[round_sig(v) for v in parts[key]], name=name, marker={"color": color},
                             customdata=list(customdata) if customdata is not None else None))
    return _layout(fig, title, x_title, "seconds", revision, barmode="stack", bargap=0.1, **extra)


def breakdown_step_figure(steps: JobStepsPublic | None, rank: int | None = None, sampled: int | None = None
                          ) -> go.Figure:
    """Where each step's time goes, stacked per step (one bar trace per :data:`BREAKDOWN_PARTS`):
    ``rank``'s own, or the mean over the ranks in ``steps`` (``sampled``: how many of the job's ranks
    those are, said in the title when not all)."""
    title = f"Step breakdown: rank {rank}" if rank is not None else "Step breakdown: mean over ranks"
    if rank is None and sampled:
        title += f" ({sampled} ranks sampled)"
    xs, parts = breakdown_by_step(steps, rank)
    if not xs:
        return empty_figure(title)
    assert steps is not None
    return _stacked(xs, parts, title, "step", f"{steps.job_id}:{rank}")


def breakdown_rank_figure(steps: JobStepsPublic | None, highlight: Sequence[int] = ()) -> go.Figure:
    """Where each rank's time goes (mean over the window's steps), stacked per rank: the "where does
    the time go" view. x: ``rank N`` labels (``highlight`` ranks marked ``▶``), ``customdata`` the rank."""
    ranks, parts = breakdown_by_rank(steps)
    if not ranks:
        return empty_figure("Time per rank")
    assert steps is not None
    hot = set(highlight)
    labels = [f"▶ rank {r}" if r in hot else f"rank {r}" for r in ranks]
    return _stacked(labels, parts, "Time per rank (mean step)", "rank", steps.job_id, customdata=ranks,
                    xaxis={"title": {"text": "rank"}, "type": "category"})


# -- Communication -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KindStats:
    """One kind of collective (op, group, tag) over the fetched window of steps."""

    op: str
    group: str
    tag: str
    steps: int
    calls_per_step: float
    p50_s: float
    """Mean over steps of the median rank's time in this kind per step."""
    max_s: float
    """Max over steps of the slowest rank's time."""
    slowest_rank: int | None
    """The rank most often the slowest."""
    transfer_s: float
    """Mean per step of the transfer time (the fastest rank's duration, summed over calls)."""
    wait_p50_s: float
    wait_max_s: float
    payload_bytes_per_rank: float
    """Mean per step and rank of the bytes handed to the collectives."""
    wire_bytes_per_rank: float
    """Mean per step and rank of the bytes put on the wire."""
    bandwidth_bytes_per_s: float | None
    """Wire bytes per rank over the transfer time (None: no transfer time)."""
    bits_per_element: float | None
    """Wire bits per model element communicated (None: no elements reported)."""
    estimated: bool = False
    """Bytes estimated from the op and sizes (captured from torch), not counted: the label says so."""

    @property
    def label(self) -> str:
        base = f"{self.op}/{self.tag}" if self.tag else self.op
        return mark_estimated(base if self.group in ("", "world") else f"{base} [{self.group}]", self.estimated)


def collective_stats(coll: JobCollectivesPublic | None) -> list[KindStats]:
    """Each kind of collective of ``coll`` summarised over its steps (ordered by total time, most first)."""
    out = []
    for c in coll.data if coll else []:
        n = len(c.step)
        if n == 0:
            continue
        wire_pr = [w / max(r, 1) for w, r in zip(c.wire_bytes, c.ranks, strict=False)]
        transfer = sum(c.transfer_s)
        elements = sum(c.elements)
        counts: dict[int, int] = {}
        for r in c.slowest_rank:
            counts[r] = counts.get(r, 0) + 1
        out.append(KindStats(
            op=c.op, group=c.group, tag=c.tag, steps=n, calls_per_step=sum(c.calls) / n,
            p50_s=sum(c.p50_s) / n, max_s=max(c.max_s), slowest_rank=max(counts, key=lambda r: counts[r]) if counts else None,
            transfer_s=transfer / n, wait_p50_s=sum(c.wait_p50_s) / n, wait_max_s=max(c.wait_max_s),
            payload_bytes_per_rank=sum(p / max(r, 1) for p, r in zip(c.payload_bytes, c.ranks, strict=False)) / n,
            wire_bytes_per_rank=sum(wire_pr) / n,
            bandwidth_bytes_per_s=sum(wire_pr) / transfer if transfer > 0 else None,
            bits_per_element=sum(c.wire_bytes) * 8 / elements if elements > 0 else None, estimated=c.estimated,
        ))
    return sorted(out, key=lambda k: -(k.p50_s * k.steps))


def collective_time_figure(stats: Sequence[KindStats], revision: str | None = None) -> go.Figure:
    """Per kind of collective: its median rank's time per step (p50) and the slowest rank's (max)."""
    if not stats:
        return empty_figure("Time in collectives")
    labels = [k.label for k in stats]
    fig = go.Figure([
        go.Bar(x=labels, y=[round_sig(k.p50_s) for k in stats], name="p50 per step", marker={"color": "#1f77b4"}),
        go.Bar(x=labels, y=[round_sig(k.max_s) for k in stats], name="max (slowest rank)", marker={"color": "#d62728"},
               customdata=[k.slowest_rank for k in stats],
               hovertemplate="%{x}: %{y:.4f} s, mostly rank %{customdata}<extra>max</extra>"),
    ])
    return _layout(fig, "Time in collectives per step", "collective (op/tag)", "seconds", revision, barmode="group")


def collective_wait_figure(stats: Sequence[KindStats], revision: str | None = None) -> go.Figure:
    """Per kind: the transfer time and the median rank's wait for the others, stacked (what a faster
    network would save against what a straggler costs), and a marker at the transfer plus the most
    waiting rank's wait."""
    if not stats:
        return empty_figure("Wait vs transfer")
    labels = [k.label for k in stats]
    fig = go.Figure([
        go.Bar(x=labels, y=[round_sig(k.transfer_s) for k in stats], name="transfer", marker={"color": "#ff7f0e"}),
        go.Bar(x=labels, y=[round_sig(k.wait_p50_s) for k in stats], name="wait (p50 rank)", marker={"color": "#d62728"}),
        go.Scatter(x=labels, y=[round_sig(k.transfer_s + k.wait_max_s) for k in stats], mode="markers",
                   name="transfer + wait (max rank)", customdata=[round_sig(k.wait_max_s) for k in stats],
                   marker={"symbol": "line-ew-open", "size": 24, "color": "#7f0000", "line": {"width": 3}},
                   hovertemplate="%{x}: the most waiting rank waited %{customdata} s<extra></extra>"),
    ])
    return _layout(fig, "Wait vs transfer per step", "collective (op/tag)", "seconds", revision, barmode="stack")


def collective_bandwidth_figure(stats: Sequence[KindStats], revision: str | None = None) -> go.Figure:
    """Per kind: achieved bandwidth per rank, wire bytes over transfer time (GB/s)."""
    shown = [k for k in stats if k.bandwidth_bytes_per_s is not None]
    if not shown:  # collectives without a transfer time are data, not a wait for it
        return empty_figure("Achieved bandwidth", "no transfer time measured" if stats else WAITING_TEXT)
    fig = go.Figure(go.Bar(x=[k.label for k in shown], y=[round_sig(k.bandwidth_bytes_per_s / 1e9) for k in shown],
                           name="GB/s per rank", marker={"color": "#17becf"}))
    return _layout(fig, "Achieved bandwidth (wire bytes / transfer time)", "collective (op/tag)", "GB/s per rank",
                   revision)


def bits_per_element_by_tag(coll: JobCollectivesPublic | None) -> dict[str, tuple[list[int], list[float]]]:
    """Per tag (ops summed), per step: wire bits per model element, ``wire_bytes * 8 / elements``
    (steps without elements left out). 32 for fp32 sent as is; less is what compression saves."""
    acc: dict[str, dict[int, list[int]]] = {}
    for c in coll.data if coll else []:
        per = acc.setdefault(c.tag or c.op, {})
        for s, w, e in zip(c.step, c.wire_bytes, c.elements, strict=False):
            cell = per.setdefault(s, [0, 0])
            cell[0] += w
            cell[1] += e
    out = {}
    for tag, per in sorted(acc.items()):
        xs = [s for s in sorted(per) if per[s][1] > 0]
        if xs:
            out[tag] = (xs, [per[s][0] * 8 / per[s][1] for s in xs])
    return out


def bits_per_element_figure(coll: JobCollectivesPublic | None) -> go.Figure:
    """Wire bits per parameter per step, one line per tag (grads, weights, push, ...), with fp32 (32)
    as the reference: what the compressed optimizers save. A tag whose bytes are estimated is named so."""
    series = bits_per_element_by_tag(coll)
    if not series:
        return empty_figure("Bits per parameter", "no parameter counts reported" if coll and coll.data else WAITING_TEXT)
    assert coll is not None
    est = estimated_tags(coll)
    fig = go.Figure([go.Scatter(x=xs, y=[round_sig(v) for v in ys], mode="lines+markers" if len(xs) == 1 else "lines",
                                name=mark_estimated(tag, tag in est)) for tag, (xs, ys) in series.items()])
    fig.add_hline(y=32, line={"dash": "dot", "color": "#888"}, annotation_text="fp32")
    return _layout(fig, "Wire bits per parameter per step, by tag", "step", "bits / parameter", coll.job_id,
                   yaxis={"title": {"text": "bits / parameter"}, "rangemode": "tozero"},
                   showlegend=True)  # a lone tag is named too (estimated or not)


# -- Incidents ---------------------------------------------------------------------------------------


def incident_label(inc: IncidentPublic) -> str:
    """``#3 hang``"""
    return f"#{inc.id} {inc.kind.value}"


def incident_timeline_figure(timelines: Sequence[tuple[IncidentPublic, Mapping[str, datetime]]]) -> go.Figure:
    """Each incident as a row: a line through its phases and one marker trace per phase of
    :data:`PHASES` (fault fired, detected, acted, recovered; those it reached). ``timelines``: each
    incident with its phase times (see :func:`dashboard.job_views.incident_phases`)."""
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
    return _layout(fig, "Incident timelines", "time (UTC)", "", None,
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
    return _layout(fig, "Checkpoints", "step", "size (MB)", revision, yaxis={"title": {"text": "size (MB)"},
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
    ettr = "–" if gp.ettr is None else f"{gp.ettr:.3f}"
    return _layout(fig, f"Where the {gp.wall_s:.0f} s went · ETTR {ettr}", "", "seconds", gp.job_id)
