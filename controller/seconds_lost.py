"""Seconds lost to slow ranks (``GET /jobs/{id}/stragglers``): the per-step figures the aggregator stores
(``job_step_stats.lost_s``, ``rank_step_stats.lost_s``; the model: :mod:`controller.step_stats`,
:func:`~controller.step_stats.seconds_lost`) summed per rank and per node, against the job's wall time.
The same sums feed the goodput's ``slow_ranks`` cause and Prometheus' ``vigil_rank_seconds_lost``.
"""

from __future__ import annotations

import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.models import Job, JobStepStat, RankStepStat
from vigil.contract.schemas import NodeLost, RankLost, SecondsLostPublic


def wall_time(job: Job, now: float) -> float:
    """From the job's start to its end (or ``now``); 0 before it started."""
    if job.started_at is None:
        return 0.0
    end = job.finished_at.timestamp() if job.finished_at is not None else now
    return max(0.0, end - job.started_at.timestamp())


def job_lost_s(session: Session, job_id: str) -> float:
    """The job's seconds lost to slow ranks over its aggregated steps."""
    return float(session.scalar(select(func.sum(JobStepStat.lost_s)).where(JobStepStat.job_id == job_id)) or 0.0)


def rank_totals(session: Session, job_id: str) -> dict[int, tuple[float, int]]:
    """rank -> (seconds lost, steps charged) over the job's aggregated steps."""
    R = RankStepStat
    rows = session.execute(
        select(R.rank, func.sum(R.lost_s), func.count().filter(R.lost_s > 0))
        .where(R.job_id == job_id, R.lost_s.is_not(None)).group_by(R.rank)
    ).all()
    return {rank: (float(lost or 0.0), int(charged)) for rank, lost, charged in rows}


def _share(x: float, wall: float) -> float | None:
    return x / wall if wall > 0 else None


def job_seconds_lost(session: Session, job: Job, max_points: int = 2000, now: float | None = None) -> SecondsLostPublic:
    """The job's seconds lost to slow ranks, per rank, per node and per step (module docstring)."""
    R = RankStepStat
    wall = wall_time(job, time.time() if now is None else now)
    totals = rank_totals(session, job.id)
    # Each rank's node and share at its newest counted step; a node's total sums its rows (a rank that
    # moved after a restart is charged to the node it ran on at the time).
    newest = select(R.rank, func.max(R.step).label("step")).where(R.job_id == job.id, R.lost_s.is_not(None)) \
        .group_by(R.rank).subquery()
    latest = {r.rank: (r.node_id, r.lost_s) for r in session.execute(
        select(R.rank, R.node_id, R.lost_s).join(newest, (R.rank == newest.c.rank) & (R.step == newest.c.step))
        .where(R.job_id == job.id)).all()}
    per_node: dict[str, tuple[float, set[int]]] = {}
    for node, rank, lost in session.execute(
        select(R.node_id, R.rank, func.sum(R.lost_s)).where(R.job_id == job.id, R.lost_s.is_not(None))
        .group_by(R.node_id, R.rank)
    ).all():
        total, ranks = per_node.get(node, (0.0, set()))
        per_node[node] = (total + float(lost or 0.0), ranks | {rank})
    ranks = [RankLost(rank=r, node_id=latest.get(r, ("", None))[0], seconds_lost=lost,
                      share_of_wall=_share(lost, wall), steps_charged=charged, last_step_lost_s=latest.get(r, ("", None))[1])
             for r, (lost, charged) in totals.items()]
    ranks.sort(key=lambda x: (-x.seconds_lost, x.rank))
    nodes = sorted((NodeLost(node_id=n, seconds_lost=lost, share_of_wall=_share(lost, wall), ranks=sorted(rs))
                    for n, (lost, rs) in per_node.items()), key=lambda x: (-x.seconds_lost, x.node_id))
    J = JobStepStat
    counted = select(J.step, J.lost_s).where(J.job_id == job.id, J.lost_s.is_not(None))
    n_steps = int(session.scalar(select(func.count()).select_from(counted.subquery())) or 0)
    series = list(reversed(session.execute(counted.order_by(J.step.desc()).limit(max_points)).all()))
    total = job_lost_s(session, job.id)
    return SecondsLostPublic(job_id=job.id, wall_s=wall, seconds_lost=total, share_of_wall=_share(total, wall),
                             steps=n_steps, ranks=ranks, nodes=nodes, step=[r.step for r in series],
                             lost_s=[float(r.lost_s) for r in series])


__all__ = ["job_lost_s", "job_seconds_lost", "rank_totals", "wall_time"]
