"""Derived read views (schemas: :mod:`vigil.contract.schemas.views`): job overview, binned heatmap, node
host history (goodput: :mod:`controller.goodput`). Pure reads; nothing here writes.

**Where the numbers come from.** A settled step is read from its aggregates
(:mod:`controller.aggregation`: one ``job_step_stats`` row per step holds the job-wide figures, one
``rank_step_stats`` row per rank the rank's), so the overview of a 10,000-rank job reads one row per
step, not 10,000. The steps still forming (the newest :data:`~controller.step_read.MAX_FORMING_STEPS`
dirty ones: :mod:`controller.step_read`, the one reader of per-step aggregates) are computed from their
raw samples with the aggregator's own definitions (``final`` False); an older dirty step shows its
earlier aggregate if it has one, and otherwise cuts the overview short just before it, so that a client
polling with ``since_step = last_step + 1`` never skips it. Ranks are
folded in SQL wherever the view is a sum, a max or a count (slowest ranks, heatmap cells); Python
sees one row per rank or per cell. A re-run step (restart from a checkpoint) shows its latest
attempt: the latest sample of each rank wins, as in the aggregates.

**Overview.** Per step: mean loss over the finite ones, mean validation loss, summed throughput,
nearest-rank p50 / p90 / max of the step time over ranks, the slowest rank, the ranks that reported,
wire bytes; decimated to ``max_points`` with :func:`controller.series.decimate` (first, last, and the
slowest step of each run: a spike of ``step_time_max_s`` survives). ``slowest_ranks``: the ``top_k``
ranks by mean step time over the job's last ``rank_window`` steps (by step number), ``vs_median``
against the median (nearest-rank) of the ranks' means; ``ranks`` counts the ranks seen in that
window. ``markers``: the job's markers, rules in :mod:`controller.view_markers`.

**Heatmap.** Rows: ``ceil(n / max_ranks)`` consecutive ranks each (``n`` = highest rank - lowest + 1);
columns: ``ceil(m / max_steps)`` consecutive steps each, over the ``m`` steps from the first with data at
or after ``since_step`` to the last; a cell is the max step time in its bin (to the microsecond), None
where no rank of the bin reported.

**Goodput** (ETTR: effective training time ratio). ``wall_s`` runs from the job's ``started_at`` to its
``finished_at`` (or now); every moment of it is counted exactly once, so ``productive_s +
sum(lost_s) == wall_s``:

1. Each step has a *kept* attempt (its latest; ``[start_ts, ts]`` over its ranks) and maybe earlier
   ones (``reruns``). A kept attempt that a later attempt of a lower step ended after (by more than
   its own duration) has been rolled back, e.g. while a restarted job re-runs steps: it counts as an
   earlier attempt. ``productive_s`` is the union of the kept attempts; what the earlier attempts
   add to it is ``lost_steps``.
2. Every stretch in which no attempt ran is one gap, between the attempt that ended at its start
   (``prev``) and the one that starts at its end (``next``). Its causes, in order:

   * ``checkpoint``: when a checkpoint of ``prev``'s step exists: the whole gap, or, when the gap
     also holds a restart or a hang, up to the checkpoint's completion;
   * ``hang``: when a ``hang`` incident was detected in the gap: from the end of ``prev`` (or of the
     checkpoint) to the detection;
   * ``restart``: the rest, when the gap holds a restart: ``next`` runs a step at or below ``prev``'s
     (the step went back), or it is the gap just before an incident's ``recovered_at`` (the monitor
     saw the job restart there), or Vigil acted on an incident inside it (``acted_at``);
   * ``startup``: the rest of the gap before the first attempt (with a restart there: up to the first
     action);
   * ``lost_steps``: the rest of a gap between two earlier attempts (inside a thrown-away run);
   * ``other``: the rest.

``restarts`` is the larger of the job's restart counter (restarts the monitor followed) and the gaps
found to hold one; ``steps_rerun`` counts the steps with earlier attempts. ``ettr`` = productive /
wall, None before the job started.

**Node history** reads ``node_host_samples`` (:mod:`controller.host_history`), oldest first, and
decimates to ``max_points``: the first and last samples as they are, and each run in between as one
point at the run's last time holding each measure's max over the run (a spike in any measure
survives).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.host_history import HOST_FIELDS
from controller.models import (
    Job,
    JobStepStat,
    NodeHostSample,
    RankStepStat,
)
from controller.series import decimate
from controller.step_read import (
    JobSteps,
    StepRecord,
    cut_before_unshown,
    forming_rows,
    read_steps,
    step_records,
)
from controller.step_stats import p50
from controller.view_markers import job_markers
from vigil.contract.schemas import (
    JobOverviewPublic,
    NodeHistoryPublic,
    RankSummary,
    StepHeatmapPublic,
)

# --------------------------------------------------------------------------------------------------
# Overview
# --------------------------------------------------------------------------------------------------


def job_overview(session: Session, job: Job, *, since_step: int | None = None, top_k: int = 10,
                 rank_window: int = 50, max_points: int = 2000) -> JobOverviewPublic:
    """The job-wide figures per step from ``since_step``, the window's slowest ranks and the markers
    (module docstring). The steps are :func:`controller.step_read.step_records`, named as the API names them."""
    job_id = job.id
    st = read_steps(session, job_id)  # the whole job's: the slowest ranks and the markers use the forming rows too
    records = cut_before_unshown(session, st, step_records(session, st, since_step), since_step)
    ordered = [records[s] for s in sorted(records)]
    kept = decimate(ordered, max_points, key=lambda r: r.step_time_max_s)
    last_job_step = max([r.step for r in ordered] + [_last_step(session, job_id, st)])
    ranks, slowest = _slowest_ranks(session, job_id, st, last_job_step, rank_window, top_k)
    columns = {f: [getattr(r, f) for r in kept] for f in _OVERVIEW_SERIES}
    return JobOverviewPublic(
        job_id=job_id, ranks=ranks, **columns, slowest_ranks=slowest, markers=job_markers(session, job, st),
        last_step=ordered[-1].step if ordered else None,
    )


_OVERVIEW_SERIES = tuple(f for f in StepRecord._fields if f in JobOverviewPublic.model_fields)
"""The per-step lists of the overview: the record's fields the API has, by the same names."""


def _last_step(session: Session, job_id: str, st: JobSteps) -> int:
    """The job's newest step (-1: none)."""
    agg = session.scalar(select(func.max(JobStepStat.step)).where(
        JobStepStat.job_id == job_id, JobStepStat.step_time_max_s.is_not(None)))
    return max([agg if agg is not None else -1, *st.forming])


@dataclass
class _RankAcc:
    steps: int = 0
    total: float = 0.0
    max: float = 0.0
    wait: float = 0.0
    waits: int = 0

    def add(self, steps: int, total: float, mx: float, wait: float | None, waits: int) -> None:
        self.steps += steps
        self.total += total
        self.max = max(self.max, mx)
        self.wait += wait or 0.0
        self.waits += waits


def _slowest_ranks(session: Session, job_id: str, st: JobSteps, last: int | None, window: int,
                   top_k: int) -> tuple[int, list[RankSummary]]:
    """(ranks seen in the job's last ``window`` steps, the ``top_k`` slowest of them by mean step time); the
    forming steps from their latest raw rows."""
    if last is None or last < 0:
        return 0, []
    lo = last - window + 1
    acc: dict[int, _RankAcc] = defaultdict(_RankAcc)
    R = RankStepStat
    for rank, n, total, mx, wait, waits in session.connection().execute(
        select(R.rank, func.count(R.step_time_s), func.sum(R.step_time_s), func.max(R.step_time_s),
               func.sum(R.comm_wait_s), func.count(R.comm_wait_s))
        .where(R.job_id == job_id, R.step >= lo, R.step <= last, R.step_time_s.is_not(None),
               R.step.not_in(st.forming)).group_by(R.rank)
    ).all():
        acc[rank].add(int(n), float(total), float(mx), wait, int(waits))
    nodes: dict[int, tuple[int, str]] = {}
    forming = forming_rows(session, st)
    for step in sorted(s for s in forming if lo <= s <= last):  # ascending: the newest step's node wins
        for rank, r in forming[step].rows.items():  # inline: this loop runs once per rank and forming step
            a = acc[rank]
            t, w = r.step_time_s, r.comm_wait_s
            a.steps += 1
            a.total += t
            a.max = max(a.max, t)
            if w is not None:
                a.wait += w
                a.waits += 1
            nodes[rank] = (step, r.node_id)
    means = {rank: a.total / a.steps for rank, a in acc.items() if a.steps}
    if not means:
        return 0, []
    median = p50(list(means.values()))
    top = sorted(means, key=lambda r: (-means[r], r))[:top_k]
    node_of = _rank_nodes(session, job_id, [r for r in top if r not in nodes], lo, last, st)
    node_of.update({r: nodes[r][1] for r in top if r in nodes})
    return len(means), [
        RankSummary(rank=r, node_id=node_of.get(r, ""), steps=acc[r].steps, step_time_mean_s=means[r],
                    step_time_max_s=acc[r].max, vs_median=means[r] / median if median > 0 else 1.0,
                    comm_wait_mean_s=acc[r].wait / acc[r].waits if acc[r].waits else None)
        for r in top
    ]


def _rank_nodes(session: Session, job_id: str, ranks: list[int], lo: int, last: int, st: JobSteps) -> dict[int, str]:
    """The node of each rank's newest settled step in ``lo..last``."""
    best: dict[int, tuple[int, str]] = {}
    if not ranks:
        return {}
    R = RankStepStat
    for rank, step, node in session.connection().execute(
        select(R.rank, R.step, R.node_id).where(R.job_id == job_id, R.rank.in_(ranks), R.step >= lo, R.step <= last,
                                                R.step.not_in(st.forming))
    ).all():
        if rank not in best or step > best[rank][0]:
            best[rank] = (step, node)
    return {r: node for r, (_, node) in best.items()}


# --------------------------------------------------------------------------------------------------
# Heatmap
# --------------------------------------------------------------------------------------------------


def job_heatmap(session: Session, job_id: str, *, since_step: int | None = None, max_ranks: int = 128,
                max_steps: int = 200) -> StepHeatmapPublic:
    """Step time rank x step, binned (module docstring).

    Settled steps are binned by the database (``GROUP BY`` of the bin numbers over ``rank_step_stats``);
    the forming ones are read as (step, rank, step time) rows, the latest per rank.
    """
    st = read_steps(session, job_id, since_step)
    R, J = RankStepStat, JobStepStat
    lo_step = since_step if since_step is not None else 0
    # Bounds of the settled steps: steps from the job rows (one per step), ranks by a min/max seek per
    # step in the rank rows' primary key (job_id, step, rank), never a scan of them.
    r_min = select(func.min(R.rank)).where(R.job_id == J.job_id, R.step == J.step).scalar_subquery()
    r_max = select(func.max(R.rank)).where(R.job_id == J.job_id, R.step == J.step).scalar_subquery()
    bounds = [session.execute(select(func.min(J.step), func.max(J.step), func.min(r_min), func.max(r_max)).where(
        J.job_id == job_id, J.step >= lo_step, J.step_time_max_s.is_not(None), J.step.not_in(st.forming))).one()]
    cells = [(step, rank, r.step_time_s) for step, f in forming_rows(session, st).items() for rank, r in f.rows.items()]
    if cells:
        bounds.append((min(c[0] for c in cells), max(c[0] for c in cells), min(c[1] for c in cells),
                       max(c[1] for c in cells)))
    present = [b for b in bounds if b[0] is not None and b[2] is not None]
    if not present:
        return StepHeatmapPublic(job_id=job_id, rank_lo=[], rank_hi=[], step_lo=[], step_hi=[], z=[])
    s0 = min(b[0] for b in present)  # the first step with data at or after since_step
    s1 = max(b[1] for b in present)
    r0, r1 = min(b[2] for b in present), max(b[3] for b in present)
    rb = -(-(r1 - r0 + 1) // max_ranks)
    sb = -(-(s1 - s0 + 1) // max_steps)
    n_rows = -(-(r1 - r0 + 1) // rb)
    n_cols = -(-(s1 - s0 + 1) // sb)
    z: list[list[float | None]] = [[None] * n_cols for _ in range(n_rows)]

    def put(i: int, j: int, v: float | None) -> None:
        if v is not None and (z[i][j] is None or v > z[i][j]):  # type: ignore[operator]
            z[i][j] = v

    rbin = ((R.rank - r0) // rb).label("rbin")
    sbin = ((R.step - s0) // sb).label("sbin")
    for i, j, v in session.connection().execute(select(rbin, sbin, func.max(R.step_time_s)).where(
            R.job_id == job_id, R.step >= s0, R.step <= s1, R.step_time_s.is_not(None), R.step.not_in(st.forming))
            .group_by("rbin", "sbin")).all():
        put(i, j, v)
    for step, rank, v in cells:
        if s0 <= step <= s1:
            put((rank - r0) // rb, (step - s0) // sb, v)
    # Microseconds are plenty for a picture, and halve the answer (25,600 cells at the defaults).
    z = [[None if v is None else round(v, 6) for v in row] for row in z]
    return StepHeatmapPublic(
        job_id=job_id,
        rank_lo=[r0 + i * rb for i in range(n_rows)], rank_hi=[min(r1, r0 + (i + 1) * rb - 1) for i in range(n_rows)],
        step_lo=[s0 + j * sb for j in range(n_cols)], step_hi=[min(s1, s0 + (j + 1) * sb - 1) for j in range(n_cols)],
        z=z,
    )


# --------------------------------------------------------------------------------------------------
# Node history
# --------------------------------------------------------------------------------------------------


def node_history(session: Session, node_id: str, *, since_ts: float | None = None,
                 max_points: int = 2000) -> NodeHistoryPublic:
    """The node's host samples from ``since_ts``, oldest first, decimated (module docstring)."""
    H = NodeHostSample
    q = select(H.ts, *(getattr(H, f) for f in HOST_FIELDS)).where(H.node_id == node_id)
    if since_ts is not None:
        q = q.where(H.ts >= since_ts)
    rows = [tuple(r) for r in session.execute(q.order_by(H.ts)).all()]
    if len(rows) > max_points >= 3:
        inner = rows[1:-1]
        size = -(-len(inner) // (max_points - 2))
        merged = [rows[0]]
        for i in range(0, len(inner), size):
            chunk = inner[i:i + size]
            merged.append((chunk[-1][0], *(
                max((v for v in col if v is not None), default=None) for col in list(zip(*chunk, strict=True))[1:])))
        merged.append(rows[-1])
        rows = merged
    cols = list(zip(*rows, strict=True)) if rows else [()] * (len(HOST_FIELDS) + 1)
    return NodeHistoryPublic(node_id=node_id, ts=list(cols[0]),
                             **{f: list(cols[i + 1]) for i, f in enumerate(HOST_FIELDS)})


__all__ = [
    "job_heatmap", "job_overview", "node_history",
]
