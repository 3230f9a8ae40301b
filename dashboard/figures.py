"""Per-rank figures of a job's raw metrics (:class:`JobMetrics`), built by pure functions: loss, step
time and throughput against step with one line per rank, and the rank x step heatmap of step time.

They suit a handful of ranks; the job page's diagnosis views, built from the controller's derived
views and bounded windows so that they stay small and readable for 10,000 ranks, are one module per
tab: :mod:`dashboard.training_figures`, :mod:`dashboard.rank_figures`,
:mod:`dashboard.breakdown_figures`, :mod:`dashboard.collective_figures` and
:mod:`dashboard.recovery_figures` (what they share is in :mod:`dashboard.plotting`).

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

from collections.abc import Sequence

import plotly.graph_objects as go

from controller.schemas import JobMetrics, RankSeries
from dashboard.plotting import MARGIN, empty_figure

HEATMAP_MAX_STEPS = 1000
"""The heatmap shows at most this many most recent steps; wider ones are unreadable and slow."""


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
        margin=MARGIN,
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
        margin=MARGIN,
        xaxis={"title": {"text": "step"}},
        yaxis={"title": {"text": "rank"}, "type": "category", "autorange": "reversed"},
        uirevision=metrics.job_id,
    )
    return fig
