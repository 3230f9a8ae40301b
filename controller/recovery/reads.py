"""The detectors' read layer: every query the recovery code runs against stored telemetry, nodes and
incidents. Read-only; each function takes the session and returns rows or plain values.

Kept in one place so that what the detectors look at (and how much of it, per pass) can be read at a
glance, and so that detectors stay pure functions over what these return.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from controller.locate import RankLocation
from controller.locate import rank_deaths as _rank_deaths
from controller.locate import rank_locations as _rank_locations
from controller.models import (
    Checkpoint,
    CollectiveMetric,
    Incident,
    Job,
    Node,
    RankProgress,
    StackDump,
    StepMetric,
)
from vigil.contract.schemas import IncidentKind, IncidentStatus, JobStatus, NodeState

UNDER_WAY = (IncidentStatus.OPEN.value, IncidentStatus.ACTING.value)
"""Statuses of an incident that is still under way (not ``live``: that word is ``recovery.policy: live``,
torchft's live recovery, alone)."""


def _ts(value: datetime) -> float:
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


# -- jobs, nodes -----------------------------------------------------------------------------------------


def running_jobs(s: Session) -> Sequence[Job]:
    return s.scalars(select(Job).where(Job.status == JobStatus.RUNNING.value)).all()


def alive_nodes(s: Session) -> Sequence[Node]:
    return s.scalars(select(Node).where(Node.state == NodeState.ALIVE.value)).all()


def rank_locations(s: Session, job_id: str) -> dict[int, RankLocation]:
    """Where each rank of the job runs (node, pid, alive), from the newest heartbeats."""
    return _rank_locations(s, job_id)


def rank_deaths(s: Session, job_id: str) -> list[tuple[int, RankLocation]]:
    """Every dead rank process of the job the heartbeats report, those with a successor included."""
    return _rank_deaths(s, job_id)


# -- incidents -------------------------------------------------------------------------------------------


def under_way(s: Session, job_id: str, kind: IncidentKind) -> Incident | None:
    """An incident of ``kind`` of the job that is still under way (OPEN or ACTING), if any."""
    return s.scalar(select(Incident).where(Incident.job_id == job_id, Incident.kind == kind.value,
                                           Incident.status.in_(UNDER_WAY)).limit(1))


def closed_since(s: Session, job_id: str, kind: IncidentKind, node_id: str | None, since: float) -> Incident | None:
    """The newest incident of ``kind`` on ``node_id`` of the job, CLOSED and detected at ``since`` or later."""
    return s.scalar(select(Incident).where(
        Incident.job_id == job_id, Incident.kind == kind.value, Incident.node_id == node_id,
        Incident.status == IncidentStatus.CLOSED.value,
        Incident.detected_at >= datetime.fromtimestamp(since, UTC)).order_by(Incident.id.desc()).limit(1))


def recovering(s: Session, job_id: str, *, observe: bool = False) -> bool:
    """Whether the job has an incident under way other than a loss spike (which never acts). ``observe``
    (the job's policy): only an incident Vigil acts on (ACTING) counts; under observe an incident stays
    OPEN for good, and must not mute the other detectors for the rest of the job."""
    statuses = (IncidentStatus.ACTING.value,) if observe else UNDER_WAY
    return s.scalar(select(Incident.id).where(Incident.job_id == job_id, Incident.status.in_(statuses),
                                              Incident.kind != IncidentKind.LOSS_SPIKE.value).limit(1)) is not None


def acting(s: Session, job_id: str) -> Sequence[Incident]:
    return s.scalars(select(Incident).where(Incident.job_id == job_id,
                                            Incident.status == IncidentStatus.ACTING.value)).all()


def open_node_losses(s: Session) -> Sequence[Incident]:
    return s.scalars(select(Incident).where(Incident.kind == IncidentKind.NODE_LOST.value,
                                            Incident.status == IncidentStatus.OPEN.value)).all()


def death_seen(s: Session, job_id: str, rank: int, pid: int) -> bool:
    """Whether this rank's death (this pid) is already a ``rank_died`` incident."""
    return s.scalar(select(Incident.id).where(
        Incident.job_id == job_id, Incident.kind == IncidentKind.RANK_DIED.value,
        Incident.rank == rank, Incident.evidence["pid"].as_integer() == pid)) is not None


def last_action_ts(s: Session, job_id: str) -> float:
    """When Vigil last acted on one of the job's incidents (0 if never)."""
    ts = s.scalar(select(func.max(Incident.acted_at)).where(Incident.job_id == job_id))
    return 0.0 if ts is None else _ts(ts)


def last_recovered_ts(s: Session, job_id: str) -> float:
    """When one of the job's incidents was last RECOVERED (0 if never)."""
    ts = s.scalar(select(func.max(Incident.recovered_at)).where(Incident.job_id == job_id))
    return 0.0 if ts is None else _ts(ts)


def stack_dumps(s: Session, incident_id: int) -> Sequence[StackDump]:
    return s.scalars(select(StackDump).where(StackDump.incident_id == incident_id)).all()


# -- steps -----------------------------------------------------------------------------------------------


def rank_progress(s: Session, job_id: str) -> dict[int, dict[str, Any]]:
    """Each rank's newest collective progress report, of the newest run attempt that sent any."""
    rows = s.scalars(select(RankProgress).where(RankProgress.job_id == job_id)).all()
    if not rows:
        return {}
    newest = max(r.attempt for r in rows)
    return {r.rank: {"step": r.step, "idle_s": r.idle_s, "ts": r.ts, "attempt": r.attempt, "state": r.state}
            for r in rows if r.attempt == newest}


def current_attempt(s: Session, job_id: str, window: int = 256) -> int:
    """The run attempt of the job's ranks now: the newest among its latest samples (0: none, or samples
    without one). The detectors judge the current worker group alone: after a restart, the old group's
    samples (late, or replayed by an agent) would mix a dead group's steps with the new one's."""
    newest = select(StepMetric.attempt).where(StepMetric.job_id == job_id).order_by(StepMetric.id.desc()).limit(window)
    return int(s.scalar(select(func.max(newest.subquery().c.attempt))) or 0)


def attempt_started(s: Session, job_id: str, attempt: int) -> float | None:
    """When the worker group of ``attempt`` started its first step (rank 0's samples), None if unknown."""
    if attempt <= 0:
        return None
    return s.scalar(select(func.min(StepMetric.ts - StepMetric.step_time_s)).where(
        StepMetric.job_id == job_id, StepMetric.rank == 0, StepMetric.attempt == attempt))


def recent_losses(s: Session, job_id: str, limit: int = 200) -> Sequence[Row[Any]]:
    """(rank, step, loss, ts) of the newest step samples of the current attempt, newest first."""
    return s.execute(select(StepMetric.rank, StepMetric.step, StepMetric.loss, StepMetric.ts)
                     .where(StepMetric.job_id == job_id, StepMetric.attempt == current_attempt(s, job_id))
                     .order_by(StepMetric.id.desc()).limit(limit)).all()


def ranks_reporting_loss(s: Session, job_id: str, limit: int = 1000) -> set[int]:
    """Ranks with a finite loss in at least half of their steps among the job's newest ``limit`` step samples,
    of any run attempt (ranks that report a loss at every step; not a Ray Train function's sparse reports)."""
    newest = (select(StepMetric.rank, StepMetric.loss).where(StepMetric.job_id == job_id)
              .order_by(StepMetric.id.desc()).limit(limit).subquery())
    rows = s.execute(select(newest.c.rank, func.count(), func.count(newest.c.loss)).group_by(newest.c.rank)).all()
    return {rank for rank, steps, with_loss in rows if with_loss * 2 >= steps}


def last_step_ts(s: Session, job_id: str) -> float | None:
    return s.scalar(select(func.max(StepMetric.ts)).where(StepMetric.job_id == job_id))


def recent_step_times(s: Session, job_id: str, limit: int = 100) -> Sequence[float]:
    return s.scalars(select(StepMetric.step_time_s).where(StepMetric.job_id == job_id)
                     .order_by(StepMetric.id.desc()).limit(limit)).all()


def recent_compute(s: Session, job_id: str, limit: int) -> Sequence[Row[Any]]:
    """(rank, step, fwd_bwd_s, step_time_s, cpu_wait_s, ts) of the newest step samples of the current attempt,
    newest first."""
    return s.execute(select(StepMetric.rank, StepMetric.step, StepMetric.fwd_bwd_s, StepMetric.step_time_s,
                            StepMetric.cpu_wait_s, StepMetric.ts)
                     .where(StepMetric.job_id == job_id, StepMetric.attempt == current_attempt(s, job_id))
                     .order_by(StepMetric.id.desc()).limit(limit)).all()


def compute_history(s: Session, job_id: str, rank: int, before_step: int, limit: int = 50) -> Sequence[float]:
    """The rank's forward+backward times of the ``limit`` steps before ``before_step``, newest first."""
    return s.scalars(select(StepMetric.fwd_bwd_s).where(
        StepMetric.job_id == job_id, StepMetric.rank == rank, StepMetric.step < before_step,
        StepMetric.fwd_bwd_s.is_not(None)).order_by(StepMetric.step.desc()).limit(limit)).all()


def work_rows(s: Session, job_id: str, steps: list[int]) -> Sequence[Row[Any]]:
    """(rank, step, step_time_s, comm_s) of the given steps in the current attempt, newest sample first."""
    return s.execute(select(StepMetric.rank, StepMetric.step, StepMetric.step_time_s, StepMetric.comm_s)
                     .where(StepMetric.job_id == job_id, StepMetric.step.in_(steps),
                            StepMetric.attempt == current_attempt(s, job_id))
                     .order_by(StepMetric.id.desc())).all()


def work_history(s: Session, job_id: str, rank: int, before_step: int, limit: int = 50) -> list[float]:
    """The rank's work outside collectives (step time - comm) of the ``limit`` steps before ``before_step``."""
    return [t - (c or 0.0) for t, c in s.execute(
        select(StepMetric.step_time_s, StepMetric.comm_s).where(
            StepMetric.job_id == job_id, StepMetric.rank == rank, StepMetric.step < before_step)
        .order_by(StepMetric.step.desc()).limit(limit)).all()]


def collective_calls(s: Session, job_id: str, steps: list[int], limit: int) -> Sequence[Row[Any]]:
    """(rank, step, seq, duration_s) of the collectives of the given steps, at most ``limit`` rows."""
    return s.execute(select(CollectiveMetric.rank, CollectiveMetric.step, CollectiveMetric.seq,
                            CollectiveMetric.duration_s)
                     .where(CollectiveMetric.job_id == job_id, CollectiveMetric.step.in_(steps),
                            CollectiveMetric.attempt == current_attempt(s, job_id))
                     .limit(limit)).all()


def checkpoint_times(s: Session, job_id: str) -> dict[int, float]:
    """Step -> when the checkpoint taken at that step completed (unix time)."""
    return {step: _ts(c) for step, c in s.execute(
        select(Checkpoint.step, Checkpoint.created_at).where(Checkpoint.job_id == job_id)).all()}


def newest_valid_step(s: Session, job_id: str) -> int:
    """The step of the job's newest checkpoint reported valid (-1: none): where a restart of the worker
    group resumes from, as far as the controller has heard (rank 0 reports each complete one)."""
    step = s.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id, Checkpoint.valid.is_(True)))
    return -1 if step is None else int(step)


def rank0_max_step_until(s: Session, job_id: str, until: float) -> int | None:
    return s.scalar(select(func.max(StepMetric.step)).where(StepMetric.job_id == job_id, StepMetric.rank == 0,
                                                            StepMetric.ts <= until))


def rank0_steps_after(s: Session, job_id: str, since: float) -> Sequence[Row[Any]]:
    """(step, ts) of rank 0's samples after ``since``, oldest first."""
    return s.execute(select(StepMetric.step, StepMetric.ts).where(
        StepMetric.job_id == job_id, StepMetric.rank == 0, StepMetric.ts > since).order_by(StepMetric.ts)).all()


def last_step_ts_by_rank(s: Session, job_id: str) -> dict[int, float]:
    """Rank -> time of its newest step sample in the current attempt (live recovery: ranks step on their own)."""
    rows = s.execute(select(StepMetric.rank, func.max(StepMetric.ts)).where(
        StepMetric.job_id == job_id, StepMetric.attempt == current_attempt(s, job_id)).group_by(StepMetric.rank)).all()
    return {int(r): float(ts) for r, ts in rows}


def rank_step_times_around(s: Session, job_id: str, rank: int | None, since: float) -> Sequence[Row[Any]]:
    """(rank, ts) of the samples of ``rank`` (every rank: None) from the last one at or before ``since`` on,
    oldest first."""
    where = [StepMetric.job_id == job_id]
    if rank is not None:
        where.append(StepMetric.rank == rank)
    before = select(StepMetric.rank, func.max(StepMetric.ts).label("ts")).where(*where, StepMetric.ts <= since) \
        .group_by(StepMetric.rank)
    after = select(StepMetric.rank, StepMetric.ts).where(*where, StepMetric.ts > since)
    return s.execute(before.union_all(after).order_by("ts")).all()


def first_heal_after(s: Session, job_id: str, rank: int | None, since: float) -> Row[Any] | None:
    """(rank, ts) of the first ``heal`` record (live recovery: a replacement received a peer's state) of
    ``rank`` (any rank: None) after ``since``."""
    where = [CollectiveMetric.job_id == job_id, CollectiveMetric.op == "heal", CollectiveMetric.ts > since]
    if rank is not None:
        where.append(CollectiveMetric.rank == rank)
    return s.execute(select(CollectiveMetric.rank, CollectiveMetric.ts).where(*where)
                     .order_by(CollectiveMetric.ts).limit(1)).first()


def first_step_from(s: Session, job_id: str, rank: int, since: float) -> float | None:
    """Time of ``rank``'s first step sample at or after ``since``."""
    return s.scalar(select(func.min(StepMetric.ts)).where(StepMetric.job_id == job_id, StepMetric.rank == rank,
                                                          StepMetric.ts >= since))


def last_recovery_before(s: Session, job_id: str, ts: float) -> float | None:
    """When the job's newest incident RECOVERED before ``ts`` was (a heal before it was that recovery's)."""
    at = s.scalar(select(func.max(Incident.recovered_at)).where(
        Incident.job_id == job_id, Incident.recovered_at.is_not(None),
        Incident.recovered_at < datetime.fromtimestamp(ts, UTC)))
    return at.replace(tzinfo=at.tzinfo or UTC).timestamp() if at is not None else None

