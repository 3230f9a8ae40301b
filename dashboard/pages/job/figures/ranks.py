"""The job page's Ranks tab: step time percentiles over ranks (whatever their number), one line per
rank for small jobs, and the controller's binned rank x step heatmap, with the stragglers named and
highlighted, and the ranks that cost the job the most seconds (``GET /jobs/{id}/stragglers``); built by
pure functions from the overview, a bounded window of steps, the binned heatmap and the seconds lost,
never one trace per rank beyond :data:`LINES_MAX_RANKS`.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dashboard.figures.base import base_layout, empty_figure
from dashboard.figures.series import Line, LineFigure
from dashboard.format import round_sig
from vigil.contract.schemas import JobOverviewPublic, JobStepsPublic, SecondsLostPublic, StepHeatmapPublic

LINES_MAX_RANKS = 8
"""Up to this many ranks, step time is drawn as one line per rank; beyond, as percentile bands."""
STRAGGLER_RATIO = 1.2
"""A rank whose mean step time is at least this many times the median rank's is highlighted."""


def slowest_title(ov: JobOverviewPublic, n: int = 3) -> str:
    """``Step time over 12 ranks · slowest: rank 5 (4.9x median)``: the stragglers of the window (at
    least :data:`STRAGGLER_RATIO` x the median rank, at most ``n``), else the slowest rank."""
    named = [r for r in ov.slowest_ranks if r.vs_median >= STRAGGLER_RATIO][:n] or ov.slowest_ranks[:1]
    text = ", ".join(f"rank {r.rank} ({r.vs_median:.1f}x median)" for r in named)
    return f"Step time over {ov.ranks} ranks" + (f" · slowest: {text}" if text else "")


STEP_TIME = LineFigure(
    lines=(
        Line("p50", "step_time_p50_s", style={"mode": "lines", "line": {"color": "#1f77b4"}}),
        Line("p90", "step_time_p90_s", style={"mode": "lines", "fill": "tonexty", "fillcolor": "rgba(31,119,180,0.2)",
                                               "line": {"color": "#6baed6"}}),
        Line("max (slowest rank)", "step_time_max_s", customdata="slowest_rank",
             style={"mode": "lines", "line": {"color": "#d62728", "dash": "dot"},
                    "hovertemplate": "step %{x}: %{y:.3f} s, rank %{customdata}<extra>max</extra>"}),
    ),
    title=slowest_title, empty_title="Step time", y_title="seconds", layout={"hovermode": "x unified"},
)
"""Step time percentiles over ranks against step, the p50..p90 band filled; the max's hover and
``customdata`` name the slowest rank of each step, the title the slowest ranks of the window."""


def step_time_bands_figure(ov: JobOverviewPublic | None) -> go.Figure:
    """Step time percentiles over ranks against step: traces ``[p50, p90, max]`` (:data:`STEP_TIME`).
    One trace per percentile whatever the number of ranks."""
    return STEP_TIME.figure(ov)


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
    return base_layout(fig, "Step time per rank", "step", "seconds", steps.job_id)


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
    return base_layout(fig, "Step time per rank (max per bin)", "step", "rank", hm.job_id,
                   yaxis={"title": {"text": "rank"}, "type": "category", "autorange": "reversed",
                          "tickvals": labels, "ticktext": tick})


LOST_BARS = 20
"""Ranks drawn in the seconds-lost bar, most first."""
NODE_COLORS = ("#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf")
"""The seconds-lost bars' colors, one per node in order of first appearance (cycled past ten nodes), so
that ranks of one bad node read as one color; the node is also written on each bar."""


def seconds_lost_figure(sl: SecondsLostPublic | None) -> go.Figure:
    """The ranks that cost the job the most time, ranked (``GET /jobs/{id}/stragglers``): one bar per rank
    that lost any (at most :data:`LOST_BARS`), colored and labelled by its node, ``customdata`` the rank
    (a click selects it); the job's total and its share of the wall time in the title. In words instead
    when the waits are not known yet (no step counted) or nothing was lost."""
    title = "Seconds lost to slow ranks"
    if sl is None or sl.steps == 0:
        return empty_figure(title, "not known yet: no step with its ranks' waits inside collectives")
    steps = f"{sl.steps} step{'s' if sl.steps != 1 else ''}"
    # The controller lists every rank it counted, the median and faster ones at 0 s: only the others cost.
    top = [r for r in sl.ranks if r.seconds_lost > 0][:LOST_BARS]
    if not top or sl.seconds_lost <= 0:
        return empty_figure(title, f"none: every step ran at the median rank's pace ({steps} counted)")
    share = f" ({100 * sl.share_of_wall:.1f}% of wall time)" if sl.share_of_wall is not None else ""
    nodes = list(dict.fromkeys(r.node_id for r in top))
    fig = go.Figure(go.Bar(
        x=[f"rank {r.rank}" for r in top], y=[round_sig(r.seconds_lost) for r in top],
        text=[r.node_id for r in top], textposition="outside", customdata=[r.rank for r in top],
        hovertext=[f"slower than the median rank in {r.steps_charged} steps" for r in top],
        marker={"color": [NODE_COLORS[nodes.index(r.node_id) % len(NODE_COLORS)] for r in top]},
        hovertemplate="%{x} on %{text}: %{y:.2f} s lost, %{hovertext}<extra></extra>"))
    return base_layout(fig, f"{title}: {sl.seconds_lost:.1f} s{share} over {steps}", "", "seconds", sl.job_id,
                       xaxis={"type": "category"})
