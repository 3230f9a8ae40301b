"""Incidents: the one module that creates them and changes their status.

An incident is a finding on record: its kind, suspect node and/or rank, evidence, and the times it
was detected, acted on and recovered. Its life::

    OPEN --> ACTING --> RECOVERED      (the job resumed after Vigil's action, or then succeeded)
      |         |-----> FAILED / CLOSED (recovery gave up / the job ended)
      |-------> CLOSED / FAILED         (nothing to do: observed only, node heard again, job ended)

:func:`transition` is the only place ``Incident.status`` changes and refuses any other move
(:class:`IllegalIncidentTransition`); the functions below are the moves the monitor and the API make,
each with its event. RECOVERED, FAILED and CLOSED are terminal.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.jobs import record_event
from controller.models import Incident, Job
from controller.recovery import heal_timeline
from controller.recovery.detectors import Finding, rejoin_seen
from controller.recovery.reads import UNDER_WAY
from vigil.contract.schemas import IncidentKind, IncidentStatus, JobStatus, RecoveryPolicy

log = logging.getLogger(__name__)

_S = IncidentStatus
ALLOWED: dict[IncidentStatus, frozenset[IncidentStatus]] = {
    _S.OPEN: frozenset({_S.ACTING, _S.CLOSED, _S.FAILED}),
    _S.ACTING: frozenset({_S.RECOVERED, _S.FAILED, _S.CLOSED}),
    _S.RECOVERED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CLOSED: frozenset(),
}
TERMINAL = frozenset(s for s, moves in ALLOWED.items() if not moves)


class IllegalIncidentTransition(ValueError):
    """A status change the incident life cycle does not allow (e.g. CLOSED -> ACTING)."""


def is_terminal(status: IncidentStatus) -> bool:
    return status in TERMINAL


def can_move(old: IncidentStatus, new: IncidentStatus) -> bool:
    return new in ALLOWED[old]


def transition(inc: Incident, new: IncidentStatus) -> bool:
    """Move ``inc`` to ``new``: the only place an incident's status changes.

    False (nothing changes) when it is already ``new``; :class:`IllegalIncidentTransition` for a move
    the life cycle forbids.
    """
    old = IncidentStatus(inc.status)
    if old == new:
        return False
    if not can_move(old, new):
        raise IllegalIncidentTransition(f"incident {inc.id}: illegal status change {old.value} -> {new.value}")
    inc.status = new.value
    return True


def open_incident(s: Session, finding: Finding, now: float, *, announce: bool = True) -> Incident:
    """A new OPEN incident for ``finding``; ``announce``: record an ``incident`` event and log it."""
    inc = Incident(job_id=finding.job_id, kind=finding.kind.value, status=IncidentStatus.OPEN.value,
                   node_id=finding.node_id, rank=finding.rank, evidence=finding.evidence,
                   step_at_detect=finding.step, detected_at=datetime.fromtimestamp(now, UTC))
    s.add(inc)
    s.flush()
    if announce:
        node_id, rank = finding.node_id, finding.rank
        where = ", ".join(x for x in (f"node {node_id}" if node_id else "", f"rank {rank}" if rank is not None else "")
                          if x)
        record_event(s, "incident", f"{finding.kind.value} detected" + (f" ({where})" if where else ""),
                     job_id=finding.job_id, node_id=node_id, data={"incident_id": inc.id, "evidence": finding.evidence})
        log.warning("incident %s: %s job=%s node=%s rank=%s %s", inc.id, finding.kind.value, finding.job_id, node_id,
                    rank, finding.evidence)
    return inc


def annotate(inc: Incident, finding: Finding) -> None:
    """Take a diagnosis's evidence and suspect (a hang's stacks and odd rank out) onto its incident."""
    inc.evidence = finding.evidence
    inc.rank = finding.rank
    inc.node_id = finding.node_id


def note(inc: Incident, action: str) -> None:
    """Record what is (or is not) being done, without a status change."""
    inc.action = action


def act(s: Session, inc: Incident, action: str, now: float) -> None:
    """OPEN -> ACTING: Vigil acted (``action`` says how); followed until the job resumes."""
    transition(inc, IncidentStatus.ACTING)
    inc.action = action
    inc.acted_at = datetime.fromtimestamp(now, UTC)
    record_event(s, "recovery_action", f"{inc.kind}: {action}", job_id=inc.job_id, node_id=inc.node_id,
                 data={"incident_id": inc.id})


def close(inc: Incident, action: str | None = None) -> None:
    """-> CLOSED: nothing more to do (``action``, if given, says why)."""
    transition(inc, IncidentStatus.CLOSED)
    if action is not None:
        inc.action = action


def fail(s: Session, inc: Incident, why: str) -> None:
    """OPEN/ACTING -> FAILED: the recovery gave up (``why``); the job's detectors judge it afresh."""
    transition(inc, IncidentStatus.FAILED)
    inc.action = f"{inc.action}; {why}" if inc.action else why
    record_event(s, "incident_failed", f"{inc.kind}: {why}", job_id=inc.job_id, node_id=inc.node_id,
                 data={"incident_id": inc.id})


def recover(s: Session, inc: Incident, at: float, restarts: int) -> None:
    """ACTING -> RECOVERED: the job resumed (at ``at``) after its ``restarts``-th restart."""
    transition(inc, IncidentStatus.RECOVERED)
    inc.recovered_at = datetime.fromtimestamp(at, UTC)
    record_event(s, "incident_recovered", f"{inc.kind}: job resumed after restart {restarts}",
                 job_id=inc.job_id, node_id=inc.node_id, data={"incident_id": inc.id})


def close_for_ended_jobs(s: Session) -> None:
    """Incidents still under way whose job ended: RECOVERED when Vigil was acting and the job then
    succeeded, else CLOSED."""
    rows = s.scalars(select(Incident).join(Job, Job.id == Incident.job_id).where(
        Incident.status.in_(UNDER_WAY), Job.status.in_([x.value for x in JobStatus if x.is_terminal()]))).all()
    for inc in rows:
        job = s.get(Job, inc.job_id)
        succeeded = job is not None and job.status == JobStatus.SUCCEEDED.value
        if succeeded and inc.status == IncidentStatus.ACTING.value and _replaced_live(job, inc):
            # Under live recovery the survivors finish on their own: the job's success says nothing of the
            # replacement. RECOVERED only if it stepped again (seen now: the job ended before a monitor pass
            # saw it), else CLOSED.
            rejoined = (rejoin_seen(s, job.id, inc.rank, inc.acted_at.timestamp(), inc.detected_at.timestamp())
                        if inc.acted_at else None)
            if rejoined is not None:
                recover(s, inc, rejoined, job.restarts)
                inc.evidence = {**(inc.evidence or {}), "timeline": heal_timeline.build(s, inc)}
                continue
            transition(inc, IncidentStatus.CLOSED)
            who = f"rank {inc.rank}'s replacement" if inc.rank is not None else "the replacement"
            why = f"the job finished before {who} trained with the others"
            inc.action = f"{inc.action}; {why}" if inc.action else why
        elif succeeded and inc.status == IncidentStatus.ACTING.value:
            transition(inc, IncidentStatus.RECOVERED)
            inc.recovered_at = inc.recovered_at or job.finished_at
        else:
            transition(inc, IncidentStatus.CLOSED)


def _replaced_live(job: Job, inc: Incident) -> bool:
    """Whether ``inc`` is a live job's replica replacement (a NaN rollback restarts every replica from disk)."""
    policy = ((job.spec or {}).get("recovery") or {}).get("policy")
    return policy == RecoveryPolicy.LIVE.value and inc.kind != IncidentKind.NAN_LOSS.value
