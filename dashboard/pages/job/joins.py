"""The joins between the controller's records that the job page draws: the incident under way, which
injected fault caused an incident and when each of its phases happened, why a checkpoint is invalid
and which checkpoint each restart restored.

Pure functions of wire-schema objects, unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

from vigil.contract.schemas import (
    CheckpointPublic,
    EventPublic,
    FaultPublic,
    FaultStatus,
    IncidentPublic,
    IncidentStatus,
    JobMarker,
)

LIVE_INCIDENT = (IncidentStatus.OPEN, IncidentStatus.ACTING)
FAULT_CAUSE_WINDOW = timedelta(minutes=30)
"""A fault fired at most this long before an incident's detection may be its cause."""


def live_incident(incidents: Iterable[IncidentPublic]) -> IncidentPublic | None:
    """The newest incident still OPEN or ACTING."""
    live = [i for i in incidents if i.status in LIVE_INCIDENT]
    return max(live, key=lambda i: (i.detected_at, i.id)) if live else None


# -- Incidents -------------------------------------------------------------------------------------


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def cause_fault(inc: IncidentPublic, faults: Iterable[FaultPublic],
                window: timedelta = FAULT_CAUSE_WINDOW) -> FaultPublic | None:
    """The injected fault that most likely caused ``inc``: the newest fault of the job fired at most
    ``window`` before the detection, on the incident's rank or node when it names one (a fault naming
    neither matches any incident)."""
    detected = _utc(inc.detected_at)
    best: FaultPublic | None = None
    for f in faults:
        if f.fired_at is None or f.status not in (FaultStatus.FIRED, FaultStatus.CLEARED):
            continue
        fired = _utc(f.fired_at)
        if not detected - window <= fired <= detected:
            continue
        if inc.rank is not None and f.rank is not None and f.rank != inc.rank:
            continue
        if inc.node_id is not None and f.node_id is not None and f.node_id != inc.node_id and f.rank is None:
            continue
        if best is None or fired > _utc(best.fired_at or fired):
            best = f
    return best


def incident_phases(inc: IncidentPublic, fault: FaultPublic | None) -> dict[str, datetime]:
    """When each phase of :data:`dashboard.pages.job.figures.recovery.PHASES` the incident reached happened (UTC)."""
    phases: dict[str, datetime] = {}
    if fault is not None and fault.fired_at is not None:
        phases["fault"] = _utc(fault.fired_at)
    phases["detected"] = _utc(inc.detected_at)
    if inc.acted_at is not None:
        phases["acted"] = _utc(inc.acted_at)
    if inc.recovered_at is not None:
        phases["recovered"] = _utc(inc.recovered_at)
    return phases


# -- Checkpoints -----------------------------------------------------------------------------------


def invalid_reasons(events: Iterable[EventPublic]) -> dict[str, str]:
    """Why each checkpoint found invalid was, by path (the ``checkpoint_invalid`` events; the newest wins)."""
    out: dict[str, str] = {}
    for e in sorted((e for e in events if e.kind == "checkpoint_invalid"), key=lambda e: (e.ts, e.id)):
        path = str(e.data.get("path", ""))
        out[path] = str(e.data.get("reason") or e.message)
    return out


def restored_checkpoint(marker: JobMarker, ckpts: Sequence[CheckpointPublic],
                        invalid_at: Mapping[str, datetime] | None = None) -> CheckpointPublic | None:
    """The checkpoint a restart marker most likely restored.

    The controller does not record the restore itself (a restart marker's ``ref`` is the incident it
    ended, if any, and its step the first step run after it); a restart resumes from the newest
    checkpoint that was valid then. So: the newest checkpoint written before the restart, at or below
    its step, that is valid now or was found invalid only after the restart (``invalid_at``: when each
    path was found invalid).
    """
    at = datetime.fromtimestamp(marker.ts, UTC)
    bad = invalid_at or {}
    best = None
    for c in ckpts:
        if _utc(c.created_at) > at or (marker.step is not None and c.step > marker.step):
            continue
        if not c.valid and (c.path not in bad or _utc(bad[c.path]) <= at):
            continue
        if best is None or c.step > best.step:
            best = c
    return best


def invalid_times(events: Iterable[EventPublic]) -> dict[str, datetime]:
    """When each checkpoint path was first found invalid."""
    out: dict[str, datetime] = {}
    for e in events:
        if e.kind == "checkpoint_invalid":
            path = str(e.data.get("path", ""))
            ts = _utc(e.ts)
            if path not in out or ts < out[path]:
                out[path] = ts
    return out


def restores(markers: Iterable[JobMarker], ckpts: Sequence[CheckpointPublic],
             events: Iterable[EventPublic] = ()) -> list[tuple[JobMarker, CheckpointPublic | None]]:
    """Each restart marker (oldest first) with the checkpoint it restored (:func:`restored_checkpoint`)."""
    bad = invalid_times(events)
    return [(m, restored_checkpoint(m, ckpts, bad))
            for m in sorted((m for m in markers if m.kind == "restart"), key=lambda m: m.ts)]
