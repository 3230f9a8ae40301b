"""A live recovery, phase by phase: the timeline a ``live`` incident carries once it is RECOVERED.

Under ``recovery.policy: live`` the survivors train on while a replacement of the lost (or hung, or slow)
replica starts and heals from one of them (:mod:`vigil.live`). Where such a recovery spends its seconds is
what its users ask first (torchft's issues: a 948 s recovery understood only with py-spy). Everything needed
is already stored, so the timeline is read back from it when the incident is RECOVERED and kept in the
incident's ``evidence["timeline"]`` (the API returns it with the incident; the dashboard's Incidents tab
draws it). Each entry is ``{"phase", "ts", "after_s", "detail"}``, ``after_s`` counted from the detection
(negative: before it), oldest first:

- ``detected``: the incident opened (its detector, its evidence);
- ``acted``: Vigil's action (the replica killed, or left to Ray when its process is already gone);
- ``quorum_without``: the survivors formed a quorum without the lost replica (their first ``quorum``
  collective, tag ``reform``, in the window; often *before* the detection: a failed all-reduce is the
  first sign a peer is gone);
- ``heal_started`` and ``healed``: the replacement's ``heal`` record (from its first quorum request with
  a live peer to the state received: seconds and bytes);
- ``first_step_together``: the first step after the heal that every rank of the job reported;
- ``recovered``: when the monitor saw the replaced rank step with the others.

A phase with no record (a recovery that did not heal from a peer, a job that records no collectives) is
left out, never guessed. The ranks' records reach the controller through their own nodes' agents, so the
pass that saw the replaced rank step may come before the survivor's step of the same moment (or the heal
record) is stored: for :data:`SETTLE_S` after the recovery, :func:`settle` reads a timeline that lacks a
phase again (seen in the e2e live-hang test: ``first_step_together`` missing once in five runs).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.models import CollectiveMetric, Incident, StepMetric
from vigil.contract.schemas import IncidentStatus

LOOKBACK_S = 60.0
"""How long before the detection the survivors' quorum without the lost replica is looked for."""
SETTLE_S = 60.0
"""How long after a recovery a timeline that lacks a phase of a heal is read again (:func:`settle`)."""
HEAL_PHASES = frozenset({"heal_started", "healed", "first_step_together"})


def _phase(name: str, ts: float, detected: float, detail: str) -> dict[str, Any]:
    return {"phase": name, "ts": round(ts, 3), "after_s": round(ts - detected, 3), "detail": detail}


def _first_record(s: Session, job_id: str, op: str, lo: float, hi: float, *, rank: int | None = None,
                  not_rank: int | None = None) -> CollectiveMetric | None:
    q = select(CollectiveMetric).where(CollectiveMetric.job_id == job_id, CollectiveMetric.op == op,
                                       CollectiveMetric.ts >= lo, CollectiveMetric.ts <= hi)
    if rank is not None:
        q = q.where(CollectiveMetric.rank == rank)
    if not_rank is not None:
        q = q.where(CollectiveMetric.rank != not_rank)
    return s.scalars(q.order_by(CollectiveMetric.ts).limit(1)).first()


def _first_step_together(s: Session, job_id: str, from_step: int, since: float, world: int) -> tuple[int, float] | None:
    """The first step ``>= from_step`` that ``world`` ranks reported after ``since``: (step, when its last rank did)."""
    row = s.execute(select(StepMetric.step, func.max(StepMetric.ts)).where(
        StepMetric.job_id == job_id, StepMetric.step >= from_step, StepMetric.ts > since)
        .group_by(StepMetric.step).having(func.count(func.distinct(StepMetric.rank)) >= world)
        .order_by(StepMetric.step).limit(1)).first()
    return (int(row[0]), float(row[1])) if row is not None else None


def build(s: Session, inc: Incident) -> list[dict[str, Any]]:
    """The timeline of the live incident ``inc`` (RECOVERED: ``recovered_at`` set), oldest first."""
    assert inc.job_id is not None and inc.recovered_at is not None, inc.id
    job, det, rec = inc.job_id, inc.detected_at.timestamp(), inc.recovered_at.timestamp()
    out = [_phase("detected", det, det, f"{inc.kind}" + (f" of rank {inc.rank}" if inc.rank is not None else "")
                  + (f" on {inc.node_id}" if inc.node_id else ""))]
    acted = inc.acted_at.timestamp() if inc.acted_at is not None else det
    if inc.acted_at is not None:
        out.append(_phase("acted", acted, det, inc.action or ""))
    world = s.scalar(select(func.count(func.distinct(StepMetric.rank))).where(
        StepMetric.job_id == job, StepMetric.ts <= det)) or 0
    quorum = _first_record(s, job, "quorum", det - LOOKBACK_S, rec, not_rank=inc.rank)
    if quorum is not None:
        out.append(_phase("quorum_without", quorum.ts, det, f"rank {quorum.rank} and its peers re-formed their "
                          f"quorum without the lost replica in {quorum.duration_s:.2f} s"))
    heal = _first_record(s, job, "heal", det - LOOKBACK_S, rec + LOOKBACK_S, rank=inc.rank)
    if heal is not None:
        who = "replacement (a warm spare, started before the fault)" if heal.tag == "spare" else "replacement"
        out.append(_phase("heal_started", heal.ts - heal.duration_s, det,
                          f"rank {heal.rank}'s {who} asked for a quorum with a live peer"))
        out.append(_phase("healed", heal.ts, det, f"{heal.payload_bytes} bytes of state in {heal.duration_s:.2f} s, "
                          f"from step {heal.step - 1} on"))
        together = _first_step_together(s, job, heal.step, heal.ts, world) if world else None
        if together is not None:
            out.append(_phase("first_step_together", together[1], det,
                              f"step {together[0]}: all {world} ranks stepped together again"))
    out.append(_phase("recovered", rec, det, "the monitor saw the replaced rank step with the others"))
    return sorted(out, key=lambda p: p["ts"])


def settle(s: Session, now: float) -> int:
    """Read again the timelines of live incidents RECOVERED in the last :data:`SETTLE_S` that lack a phase of
    the heal (records that arrived after the recovery was seen); returns how many grew."""
    grown = 0
    rows = s.scalars(select(Incident).where(Incident.status == IncidentStatus.RECOVERED.value,
                                            Incident.recovered_at >= datetime.fromtimestamp(now - SETTLE_S, UTC))).all()
    for inc in rows:
        timeline = (inc.evidence or {}).get("timeline")
        if timeline is None or HEAL_PHASES <= {p["phase"] for p in timeline}:
            continue
        again = build(s, inc)
        if len(again) > len(timeline):
            inc.evidence = {**(inc.evidence or {}), "timeline": again}
            grown += 1
    return grown


__all__ = ["HEAL_PHASES", "LOOKBACK_S", "SETTLE_S", "build", "settle"]
