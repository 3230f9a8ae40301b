"""Goodput of a job (``GET /jobs/{id}/goodput``): productive time against time lost per cause, and the
ETTR. The rules are in :class:`vigil.contract.schemas.GoodputPublic` and docs/RECOVERY.md ("Goodput");
the step timeline is read by the same reader as the overview (:func:`controller.step_read.step_records`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.models import Checkpoint, Incident, Job
from controller.seconds_lost import job_lost_s
from controller.step_read import read_steps, step_records
from vigil.contract.schemas import LOST_CAUSES, GoodputPublic


@dataclass(frozen=True)
class StepRun:
    """When one step ran: its kept (latest) attempt ``[start, end]`` and its earlier attempts."""

    step: int
    start: float
    end: float
    reruns: tuple[tuple[float, float], ...] = ()


@dataclass
class Timeline:
    """What goodput is computed from (:func:`goodput_from`); times are unix seconds."""

    started: float | None
    ended: float
    """``finished_at``, or now while the job runs."""
    steps: list[StepRun] = field(default_factory=list)
    checkpoints: dict[int, list[float]] = field(default_factory=dict)
    """Step -> completion times of its checkpoints."""
    hangs: list[float] = field(default_factory=list)
    """Detection times of ``hang`` incidents."""
    acted: list[float] = field(default_factory=list)
    """Times Vigil acted on an incident (a restart follows)."""
    recovered: list[float] = field(default_factory=list)
    """``recovered_at`` of incidents: the end of the first step after a restart."""
    restarts: int = 0
    """The job's restart counter."""
    slow_ranks: float = 0.0
    """Seconds the kept steps lost to slow ranks (:mod:`controller.seconds_lost`): out of the productive time."""


@dataclass(frozen=True)
class _Attempt:
    step: int
    start: float
    end: float
    kept: bool


@dataclass
class _Block:
    """Attempts that ran back to back (overlapping), as one stretch of computing."""

    start: float
    end: float
    first_step: int
    first_kept: bool
    last_step: int
    last_kept: bool


def _union_length(spans: Iterable[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def goodput_from(job_id: str, tl: Timeline) -> GoodputPublic:
    """Goodput of a job from its timeline (the rules: module docstring)."""
    lost = dict.fromkeys(LOST_CAUSES, 0.0)
    steps_rerun = sum(1 for s in tl.steps if s.reruns)
    if tl.started is None:
        return GoodputPublic(job_id=job_id, wall_s=0.0, productive_s=0.0, lost_s=lost, ettr=None,
                             restarts=tl.restarts, steps_rerun=steps_rerun)
    t0, t1 = tl.started, max(tl.ended, tl.started)

    # 1. Attempts: kept ones, rolled-back ones, earlier ones; clipped to the wall.
    attempts: list[_Attempt] = []
    lower_end = -math.inf  # the latest end among the lower steps' latest attempts
    for run in sorted(tl.steps, key=lambda r: r.step):
        rolled_back = lower_end > run.end + (run.end - run.start)
        attempts.append(_Attempt(run.step, run.start, run.end, kept=not rolled_back))
        attempts += [_Attempt(run.step, s, e, kept=False) for s, e in run.reruns]
        lower_end = max(lower_end, run.end)
    clipped = [_Attempt(a.step, max(a.start, t0), min(a.end, t1), a.kept) for a in attempts]
    clipped = [a for a in clipped if a.end > a.start]
    productive = _union_length((a.start, a.end) for a in clipped if a.kept)

    # 2. Blocks of computing, and the gaps between them.
    blocks: list[_Block] = []
    for a in sorted(clipped, key=lambda a: (a.start, a.end)):
        b = blocks[-1] if blocks else None
        if b is not None and a.start <= b.end:
            if a.end >= b.end:
                b.end, b.last_step, b.last_kept = a.end, a.step, a.kept
        else:
            blocks.append(_Block(a.start, a.end, a.step, a.kept, a.step, a.kept))
    lost["lost_steps"] += sum(b.end - b.start for b in blocks) - productive

    bounds = [t0] + [t for b in blocks for t in (b.start, b.end)] + [t1]
    restarts_seen = 0
    for i in range(len(blocks) + 1):
        x, y = bounds[2 * i], bounds[2 * i + 1]
        prev = blocks[i - 1] if i > 0 else None
        nxt = blocks[i] if i < len(blocks) else None
        if _gap(tl, x, y, prev, nxt, lost):
            restarts_seen += 1
    # Inside kept steps, the time they waited for ranks slower than the median one. The seconds lost are
    # per step; where the kept steps' ranges overlap (telemetry whose step times exceed the time between
    # steps) their sum exceeds the productive time they cover: scale by union / sum, and never more than it.
    spans = sum(a.end - a.start for a in clipped if a.kept)
    overlap = productive / spans if spans > productive > 0 else 1.0
    lost["slow_ranks"] = min(max(tl.slow_ranks, 0.0) * overlap, productive)
    productive -= lost["slow_ranks"]
    wall = t1 - t0
    return GoodputPublic(job_id=job_id, wall_s=wall, productive_s=productive, lost_s=lost,
                         ettr=productive / wall if wall > 0 else None, restarts=max(tl.restarts, restarts_seen),
                         steps_rerun=steps_rerun)


def _gap(tl: Timeline, x: float, y: float, prev: _Block | None, nxt: _Block | None, lost: dict[str, float]) -> bool:
    """Attribute the gap ``[x, y]`` (no attempt ran) to its causes in ``lost``; whether it holds a restart."""
    if y <= x:
        return False
    went_back = prev is not None and nxt is not None and nxt.first_step <= prev.last_step
    # The monitor's recovered_at is the end of the first step after the restart: the gap just before it.
    recovered = nxt is not None and any((y <= t <= nxt.end) for t in tl.recovered)
    acted = [t for t in tl.acted if x <= t < y]
    restart = went_back or recovered or bool(acted)
    hang = min((t for t in tl.hangs if x < t <= y), default=None)
    cur = x
    if prev is not None and tl.checkpoints.get(prev.last_step):
        if restart or hang is not None:
            done = [c for c in tl.checkpoints[prev.last_step] if x < c <= y]
            end = max(done, default=x)
        else:
            end = y
        lost["checkpoint"] += end - cur
        cur = end
    if hang is not None and hang > cur:
        lost["hang"] += hang - cur
        cur = hang
    if cur >= y:
        return restart
    if restart:
        if prev is None:  # before the first step: starting up, until the first action
            split = min([t for t in acted if t > cur] + [y]) if acted else cur
            lost["startup"] += split - cur
            cur = split
        lost["restart"] += y - cur
    elif prev is None:
        lost["startup"] += y - cur
    elif nxt is not None and not prev.last_kept and not nxt.first_kept:
        lost["lost_steps"] += y - cur
    else:
        lost["other"] += y - cur
    return restart


def job_timeline(session: Session, job: Job, now: float) -> Timeline:
    """Read a job's :class:`Timeline`: its steps' attempts (aggregates, and the forming steps' raw rows),
    checkpoints and incidents."""
    job_id = job.id
    runs = [StepRun(r.step, r.start_ts if r.start_ts is not None else r.ts - (r.step_time_max_s or 0.0), r.ts,
                    tuple((float(s), float(e)) for s, e in (r.reruns or ())))
            for r in step_records(session, read_steps(session, job_id)).values()]
    checkpoints: dict[int, list[float]] = defaultdict(list)
    for step, created in session.execute(select(Checkpoint.step, Checkpoint.created_at)
                                         .where(Checkpoint.job_id == job_id)).all():
        checkpoints[step].append(created.timestamp())
    hangs, acted, recovered = [], [], []
    for kind, detected, acted_at, recovered_at in session.execute(
        select(Incident.kind, Incident.detected_at, Incident.acted_at, Incident.recovered_at)
        .where(Incident.job_id == job_id)
    ).all():
        if kind == "hang":
            hangs.append(detected.timestamp())
        if acted_at is not None:
            acted.append(acted_at.timestamp())
        if recovered_at is not None:
            recovered.append(recovered_at.timestamp())
    return Timeline(
        started=_ts(job.started_at), ended=_ts(job.finished_at) or now, steps=sorted(runs, key=lambda r: r.step),
        checkpoints=dict(checkpoints), hangs=sorted(hangs), acted=sorted(acted), recovered=sorted(recovered),
        restarts=job.restarts or 0, slow_ranks=job_lost_s(session, job_id),
    )


def _ts(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def job_goodput(session: Session, job: Job, now: float) -> GoodputPublic:
    """Where the job's wall time went (module docstring)."""
    return goodput_from(job.id, job_timeline(session, job, now))




__all__ = ["StepRun", "Timeline", "goodput_from", "job_goodput", "job_timeline"]
