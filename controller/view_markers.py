"""The markers of a job's overview (:func:`job_markers`, for :func:`controller.views.job_overview`):
all of the job's, oldest first, the newest :data:`MAX_MARKERS`:

* ``incident``: every incident of the job, at ``step_at_detect``;
* ``checkpoint``: every checkpoint the job reported, at its step (``(invalid)`` when found bad);
* ``fault``: every ``fault_fired`` event, at the step the fault hit (its ``hit_step``, else the step it records);
* ``restart``: every ``incident_recovered`` event (the monitor counts a restart there), placed at the
  incident's ``recovered_at`` (the first step after the restart); and the first step of every run of
  re-run steps that no such event covers (a restart Ray made on its own);
* ``eviction``: every ``node_evicted`` event, while the job ran, of a node that held its ranks (an
  incident of the job names it, its heartbeat lists the job's ranks, or its ranks reported one of
  the 20 steps before).

An event without a step is placed at the job's step at that time: the step running then (its kept
attempt ``[start_ts, ts]`` holds it), else the step that ended last before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.models import (
    Checkpoint,
    Event,
    Fault,
    Incident,
    Job,
    JobStepStat,
    Node,
    RankStepStat,
    StepMetric,
)
from controller.step_read import JobSteps, forming_rows, forming_spans, read_steps
from vigil.contract.schemas import JobMarker

MAX_MARKERS = 2000
"""Markers returned per overview, the newest."""
EVICTION_LOOKBACK_STEPS = 20
"""An evicted node counts as the job's when its ranks reported one of this many steps before the eviction."""


def _step_at(session: Session, job_id: str, t: float, forming: dict[int, tuple[float, float]]) -> int | None:
    """The job's step at time ``t``: the one running then (the first to end at or after ``t`` among
    those started by then), else the one that ended last before it (None: none had). ``forming``:
    step -> (start, end) of the forming steps."""
    J = JobStepStat
    spans = dict(forming)
    nxt = session.execute(select(J.step, J.start_ts, J.ts, J.step_time_max_s).where(J.job_id == job_id, J.ts >= t)
                          .order_by(J.ts).limit(1)).first()
    if nxt is not None:
        spans.setdefault(nxt.step, (nxt.start_ts if nxt.start_ts is not None else nxt.ts - (nxt.step_time_max_s or 0.0),
                                    nxt.ts))
    prev = session.execute(select(J.step, J.ts).where(J.job_id == job_id, J.ts <= t)
                           .order_by(J.ts.desc()).limit(1)).first()
    if prev is not None:
        spans.setdefault(prev.step, (prev.ts, prev.ts))
    running = [(end, step) for step, (start, end) in spans.items() if start <= t <= end]
    if running:
        return min(running)[1]
    ended = [(end, step) for step, (_, end) in spans.items() if end <= t]
    return max(ended)[1] if ended else None


def job_markers(session: Session, job: Job, st: JobSteps | None = None) -> list[JobMarker]:
    """The job's markers, oldest first (module docstring); ``st``: the job's steps as the caller read them."""
    job_id = job.id
    st = st or read_steps(session, job_id)
    spans = forming_spans(session, st)
    out: list[JobMarker] = []

    def step_at(t: float) -> int | None:
        return _step_at(session, job_id, t, spans)

    incidents = session.scalars(select(Incident).where(Incident.job_id == job_id)).all()
    by_id = {inc.id: inc for inc in incidents}
    for inc in incidents:
        where = ", ".join(x for x in (f"node {inc.node_id}" if inc.node_id else "",
                                      f"rank {inc.rank}" if inc.rank is not None else "") if x)
        label = f"{inc.kind} detected" + (f" ({where})" if where else "") + (f": {inc.action}" if inc.action else "")
        t = inc.detected_at.timestamp()
        out.append(JobMarker(kind="incident", step=inc.step_at_detect if inc.step_at_detect is not None else step_at(t),
                             ts=t, label=label, ref=str(inc.id)))
    for ck in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all():
        out.append(JobMarker(kind="checkpoint", step=ck.step, ts=ck.created_at.timestamp(),
                             label=f"checkpoint at step {ck.step}" + ("" if ck.valid else " (invalid)"), ref=str(ck.id)))
    restart_steps: set[int] = set()
    rerun = _rerun_starts(session, job_id, st)
    runs = rerun_runs(rerun)
    for ev in session.scalars(select(Event).where(
            Event.job_id == job_id, Event.kind.in_(["fault_fired", "incident_recovered"]))).all():
        data = ev.data or {}
        if ev.kind == "fault_fired":
            step = data.get("step")
            t = ev.ts.timestamp()
            fault = session.get(Fault, data["fault_id"]) if isinstance(data.get("fault_id"), int) else None
            if fault is not None and fault.hit_step is not None:
                step = fault.hit_step  # the step it really hit (the rank's report, or the agent's)
            elif fault is not None and isinstance(step, int):
                # Not reported yet: a fault the rank fires itself is armed at once and hits at its own
                # step; one the agent carries out fires once the job has reached it.
                step = max(step, fault.step)
            out.append(JobMarker(kind="fault", step=step if isinstance(step, int) else step_at(t), ts=t,
                                 label=ev.message, ref=str(data["fault_id"]) if "fault_id" in data else None))
        else:
            inc = by_id.get(data.get("incident_id")) if isinstance(data.get("incident_id"), int) else None
            # The incident's recovered_at: when the ranks ran their first step after the restart.
            t = (inc.recovered_at if inc is not None and inc.recovered_at is not None else ev.ts).timestamp()
            step = step_at(t)
            if step is not None:
                step = snap_to_run(step, runs)  # the first re-run step, when the restart caused a re-run
                restart_steps.add(step)
            out.append(JobMarker(kind="restart", step=step, ts=t, label=ev.message,
                                 ref=str(inc.id) if inc is not None else None))
    out += [JobMarker(kind="restart", step=step, ts=rerun[step], label=f"steps from {step} on re-run after a restart")
            for step in uncovered_runs(rerun, restart_steps)]
    out += _evictions(session, job, {inc.node_id for inc in incidents if inc.node_id}, step_at)
    out.sort(key=lambda m: (m.ts, m.kind))
    return out[-MAX_MARKERS:]


def _rerun_starts(session: Session, job_id: str, st: JobSteps) -> dict[int, float]:
    """Steps run more than once -> when their kept attempt started."""
    J = JobStepStat
    starts: dict[int, float] = {}
    for step, start, ts in session.execute(
        select(J.step, J.start_ts, J.ts).where(J.job_id == job_id, J.reruns.is_not(None), J.step.not_in(st.forming))
    ).all():
        starts[step] = start if start is not None else ts
    for step, f in forming_rows(session, st).items():
        if f.reruns:
            starts[step] = f.start
    return starts


def rerun_runs(rerun: Iterable[int]) -> list[list[int]]:
    """Runs of consecutive re-run steps, ascending."""
    runs: list[list[int]] = []
    for step in sorted(rerun):
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def snap_to_run(step: int, runs: Sequence[Sequence[int]]) -> int:
    """A recorded restart is placed by its time, which can land a step or so into the re-run it caused (or
    just before it): the run's first step then, else ``step``."""
    return next((run[0] for run in runs if run[0] - 1 <= step <= run[-1]), step)


def uncovered_runs(rerun: Iterable[int], covered: set[int]) -> list[int]:
    """The first step of each run of consecutive re-run steps that no recorded restart falls in (the re-run
    then gets a restart marker of its own)."""
    return [run[0] for run in rerun_runs(rerun) if not any(run[0] - 1 <= c <= run[-1] for c in covered)]


def _evictions(session: Session, job: Job, incident_nodes: set[str], step_at: Any) -> list[JobMarker]:
    since = job.started_at or job.created_at
    q = select(Event).where(Event.kind == "node_evicted", Event.ts >= since)
    if job.finished_at is not None:
        q = q.where(Event.ts <= job.finished_at)
    out = []
    for ev in session.scalars(q).all():
        t = ev.ts.timestamp()
        step = step_at(t)
        if ev.node_id is None or not _held_ranks(session, job.id, ev.node_id, step, incident_nodes):
            continue
        out.append(JobMarker(kind="eviction", step=step, ts=t, label=ev.message, ref=ev.node_id))
    return out


def _held_ranks(session: Session, job_id: str, node_id: str, step: int | None, incident_nodes: set[str]) -> bool:
    """Whether ``node_id`` held ranks of the job around ``step`` (module docstring)."""
    if node_id in incident_nodes:
        return True
    node = session.get(Node, node_id)
    if node is not None and any(isinstance(r, dict) and r.get("job_id") == job_id for r in node.ranks or []):
        return True
    if step is None:
        return False
    R = RankStepStat
    if session.scalar(select(R.rank).where(R.job_id == job_id, R.step >= step - EVICTION_LOOKBACK_STEPS,
                                           R.step <= step, R.node_id == node_id).limit(1)) is not None:
        return True
    S = StepMetric
    return session.scalar(select(S.rank).where(S.job_id == job_id, S.node_id == node_id,
                                               S.step >= step - EVICTION_LOOKBACK_STEPS, S.step <= step)
                          .limit(1)) is not None


__all__ = ["EVICTION_LOOKBACK_STEPS", "MAX_MARKERS", "job_markers", "rerun_runs", "snap_to_run", "uncovered_runs"]
