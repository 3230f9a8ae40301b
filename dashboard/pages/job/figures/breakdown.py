"""The job page's Step breakdown tab: where a step's time goes (data, forward+backward, optimizer,
communication, waiting in collectives, other), stacked per step (job-wide or one rank's) and per
rank, built by pure functions from a bounded window of the ranks' steps (:class:`JobStepsPublic`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from dashboard.figures.base import base_layout, empty_figure
from dashboard.format import round_sig
from vigil.contract.schemas import JobStepsPublic, RankStepsPublic

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
    return base_layout(fig, title, x_title, "seconds", revision, barmode="stack", bargap=0.1, **extra)


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
