"""``recovery.policy: adapt``: a degraded link answered by communicating less, eviction only when cheaper.

The policy (:class:`controller.recovery.policy.AdaptPolicy`) answers a ``nic_degraded`` finding, or a
``communication-slow`` straggler behind one, with :data:`~controller.recovery.policy.Action.ADAPT`; this module
carries it out and follows it, each step of it on the incident's ``evidence["adapt"]`` and as an event:

1. **requested** (:func:`request`): the next *version* of the job's setting, ``recovery.adapt.params`` (e.g. a
   local-step method's ``tau`` 12 -> 48: a quarter of the synchronisations), is written to every rank's adapt
   file by its node's agent (``vigil.contract.settings.adapt_file_path``: every version so far, oldest first).
   The wall pace (seconds per step) of the steps before (``step_s_before``; read again at 3, over the steps
   between the request and the switch, once their aggregates are written) and the healthy pace before the link
   degraded (``step_s_healthy``) are kept. The incident stays OPEN: nothing is restarted, no step is lost.
2. **switched** (:func:`record_switch`): the ranks take the newest version every one of them has read, all
   at the same checkpoint boundary (``vigil.rank.adapt``), and say so (a ``FaultSample`` of kind ``adapt``
   whose ``fault_id`` is the version): ``switched_step``.
3. **measured** (:func:`follow`, every monitor pass): ``MEASURE_STEPS`` steps later the adapted pace
   (``step_s_after``) is known. If the job is still slower than it was healthy by more than an eviction
   would cost over the steps left (:func:`eviction_worth`), the finding goes back to the policy as
   ``adapted`` and the node is evicted as under ``evict_restart`` (the spec's own setting is asked for
   first, so the restarted group runs it).
4. **reverted**: once the node has had no NIC finding for ``CLEAR_S`` seconds, the spec's own setting
   (version params ``{}``) is asked for the same way; when the ranks have switched back the incident is
   CLOSED with the whole story in its evidence.

A rank that restarts meanwhile starts from the spec's setting and takes the file's newest version again at
its first checkpoint boundary (the controller's intent is the file's newest version).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.jobs import record_event
from controller.models import Incident, Job, JobStepStat
from controller.recovery import commands, incidents, reads
from controller.recovery.detectors import Finding
from controller.recovery.nic import NicFinding
from vigil.contract.schemas import CommandKind, FaultSample, IncidentKind, IncidentStatus, JobCreate

log = logging.getLogger(__name__)

MEASURE_STEPS = 20
"""Steps after a switch over which the adapted pace is measured."""
HEALTHY_STEPS = 40
"""Steps before the finding's detection window over which the healthy pace is measured."""
CLEAR_S = 20.0
"""Seconds the node must go without a NIC finding before the spec's own setting is asked for again."""
ADAPT_KIND = "adapt"
"""The ``fault_kind`` of a rank's report that it switched (``fault_id``: the version)."""


def _adapt_incidents(s: Session, job_id: str) -> list[Incident]:
    rows = s.scalars(select(Incident).where(Incident.job_id == job_id).order_by(Incident.id)).all()
    return [i for i in rows if isinstance((i.evidence or {}).get("adapt"), dict)]


def versions(s: Session, job_id: str) -> list[dict[str, Any]]:
    """Every version of the job's setting asked for so far, oldest first (what each adapt file holds)."""
    out = []
    for inc in _adapt_incidents(s, job_id):
        a = inc.evidence["adapt"]
        out.append({"version": a["version"], "params": a["params"]})
        if isinstance(a.get("revert"), dict):
            out.append({"version": a["revert"]["version"], "params": {}})
    return sorted(out, key=lambda v: v["version"])


def pace(s: Session, job_id: str, lo: int, hi: int) -> float | None:
    """Wall seconds per step over the job's aggregated steps ``lo < step <= hi``: the time between the ends of
    the first and the last of them over the steps between. None until the aggregates reach ``hi`` (a step
    still forming has no row yet: a pace read then would stop short of the newest, slowest steps) or with
    fewer than two. The job's own pace, whatever part of a step a degraded link slows: a local-step method
    synchronises once every ``tau`` steps, and the step times a rank reports leave out where it waits (seen
    in the first ``vigil bench adapt`` runs: the median, then the mean, of the ranks' step times did not move
    when the link was cut, the wall pace did)."""
    rows = s.execute(select(JobStepStat.step, JobStepStat.ts).where(
        JobStepStat.job_id == job_id, JobStepStat.step > lo, JobStepStat.step <= hi)
        .order_by(JobStepStat.step)).all()
    if len(rows) < 2 or rows[-1].step < hi:
        return None
    return round((rows[-1].ts - rows[0].ts) / (rows[-1].step - rows[0].step), 5)


def _healthy(s: Session, job_id: str, inc: Incident, last: int) -> float | None:
    """The pace over the ``HEALTHY_STEPS`` steps before the finding's detection window (which ended at ``last``)."""
    window = int((inc.evidence or {}).get("window_steps") or 20)
    return pace(s, job_id, last - window - HEALTHY_STEPS, last - window)


def _set(inc: Incident, **changes: Any) -> None:
    """Change the incident's ``evidence["adapt"]`` (a new dict: the JSON column sees the change)."""
    inc.evidence = {**inc.evidence, "adapt": {**inc.evidence["adapt"], **changes}}


def _write(s: Session, job: Job, inc: Incident) -> int:
    """Every version so far to every located rank's adapt file; the number of ranks written to."""
    body = {"versions": versions(s, job.id)}
    locs = reads.rank_locations(s, job.id)
    for rank, loc in sorted(locs.items()):
        commands.enqueue(s, loc.node_id, CommandKind.WRITE_FAULT_FILE,
                         {"job_id": job.id, "rank": rank, "file": "adapt", "fault": body},
                         job_id=job.id, incident_id=inc.id)
    return len(locs)


def request(s: Session, job: Job, inc: Incident, params: dict[str, Any], now: float) -> int:
    """Ask the ranks for ``params`` (``recovery.adapt.params``) as the job's next version; the version."""
    version = max((v["version"] for v in versions(s, job.id)), default=0) + 1
    last = job.last_step or 0
    inc.evidence = {**(inc.evidence or {}), "adapt": {
        "version": version, "params": dict(params), "requested_at": now, "requested_step": last,
        "step_s_before": pace(s, job.id, last - 20, last),
        "step_s_healthy": _healthy(s, job.id, inc, last),
        "switched_step": None, "step_s_after": None, "clear_since": None, "revert": None}}
    ranks = _write(s, job, inc)
    record_event(s, "adapt_requested", f"{job.id}: {params} asked of {ranks} rank(s) as version {version} "
                 f"(link of {inc.node_id} degraded), taken at the next checkpoint boundary", job_id=job.id,
                 node_id=inc.node_id, data={"incident_id": inc.id, "version": version, "params": params})
    return version


def _revert(s: Session, job: Job, inc: Incident, now: float, why: str) -> None:
    version = max(v["version"] for v in versions(s, job.id)) + 1
    _set(inc, revert={"version": version, "requested_at": now, "requested_step": job.last_step, "why": why,
                      "switched_step": None})
    _write(s, job, inc)
    record_event(s, "adapt_reverted", f"{job.id}: the spec's own setting asked for as version {version} ({why})",
                 job_id=job.id, node_id=inc.node_id, data={"incident_id": inc.id, "version": version})


def record_switch(s: Session, sample: FaultSample) -> None:
    """A rank's report that it took ``sample.fault_id`` (a version) at ``sample.step``: the first report wins."""
    for inc in _adapt_incidents(s, sample.job_id):
        a = inc.evidence["adapt"]
        if a["version"] == sample.fault_id and a.get("switched_step") is None:
            _set(inc, switched_step=sample.step)
            record_event(s, "adapt_switched", f"{sample.job_id}: {a['params']} in force from step {sample.step}",
                         job_id=sample.job_id, node_id=inc.node_id, data={"incident_id": inc.id, "step": sample.step})
        rev = a.get("revert")
        if isinstance(rev, dict) and rev["version"] == sample.fault_id and rev.get("switched_step") is None:
            _set(inc, revert={**rev, "switched_step": sample.step})
            if inc.status == IncidentStatus.OPEN.value:  # (ACTING: evicted, the restart settles it)
                incidents.close(inc, f"adapted {a['params']} from step {a.get('switched_step')} to step {sample.step}; "
                                f"back to the spec's setting ({rev['why']})")


def eviction_worth(a: dict[str, Any], steps_left: int, restart_s: float) -> dict[str, Any]:
    """Whether evicting the node beats running on adapted: the slowdown left (``step_s_after`` over
    ``step_s_healthy``) over the steps left against a restart's cost, with every number used."""
    after, healthy = a.get("step_s_after"), a.get("step_s_healthy")
    excess = max(0.0, after - healthy) if after is not None and healthy is not None else 0.0
    projected = excess * steps_left
    return {"excess_per_step_s": round(excess, 5), "steps_left": steps_left, "projected_lost_s": round(projected, 3),
            "restart_s": restart_s, "worth": projected > restart_s}


def follow(s: Session, job: Job, spec: JobCreate, found: list[NicFinding], now: float,
           escalate: Callable[[Finding], object]) -> list[NicFinding]:
    """One monitor pass over the job's adaptations (module docstring, 3 and 4); the NIC findings left to
    judge (those on a node whose adaptation is under way are this module's)."""
    flagged = {f.node_id for f in found}
    held: set[str] = set()
    for inc in _adapt_incidents(s, job.id):
        if inc.status != IncidentStatus.OPEN.value:
            continue
        held.add(inc.node_id or "")
        a = inc.evidence["adapt"]
        if a.get("switched_step") is not None and a.get("step_s_after") is None:
            _measure(s, job, spec, inc, now, escalate)
        if a.get("revert") is None:
            _watch_link(s, job, inc, inc.node_id in flagged, now)
    return [f for f in found if f.node_id not in held]


def _measure(s: Session, job: Job, spec: JobCreate, inc: Incident, now: float,
             escalate: Callable[[Finding], object]) -> None:
    """``MEASURE_STEPS`` steps after the switch, once their aggregates are written: the adapted pace, and the
    pace on the sick link (``step_s_before``) read again over the steps from the request to the switch (they
    ran the spec's setting on the degraded link; at the request their aggregates were often not written
    yet, which made the request's figure the healthy pace)."""
    a = inc.evidence["adapt"]
    start, last = a["switched_step"], job.last_step or 0
    after = pace(s, job.id, start, start + MEASURE_STEPS) if last >= start + MEASURE_STEPS else None
    if after is None:
        return
    sick = pace(s, job.id, a["requested_step"], start)
    _set(inc, step_s_after=after, step_s_before=sick if sick is not None else a.get("step_s_before"),
         step_s_healthy=a.get("step_s_healthy") or _healthy(s, job.id, inc, a["requested_step"]))
    a = inc.evidence["adapt"]
    verdict = eviction_worth(a, max(0, spec.steps - last), spec.recovery.thresholds.fail_slow_restart_s)
    _set(inc, eviction=verdict)
    incidents.note(inc, f"adapt: step {a['step_s_before']} s before, {a['step_s_after']} s after the switch "
                   f"(healthy {a['step_s_healthy']} s); " + ("evicting: still slower than an eviction costs"
                                                              if verdict["worth"] else "eviction not worth it"))
    record_event(s, "adapt_measured", f"{job.id}: step time {a['step_s_before']} s -> {a['step_s_after']} s with "
                 f"{a['params']}", job_id=job.id, node_id=inc.node_id, data={"incident_id": inc.id, **verdict})
    if verdict["worth"]:
        _revert(s, job, inc, now, "the node is evicted")
        escalate(Finding(IncidentKind(inc.kind), job.id, inc.node_id, inc.rank,
                         {**inc.evidence, "adapted": True}, step=last, incident_id=inc.id))


def _watch_link(s: Session, job: Job, inc: Incident, flagged: bool, now: float) -> None:
    a = inc.evidence["adapt"]
    if flagged:
        if a.get("clear_since") is not None:
            _set(inc, clear_since=None)
        return
    if a.get("clear_since") is None:
        _set(inc, clear_since=now)
    elif now - a["clear_since"] >= CLEAR_S:
        _revert(s, job, inc, now, f"no NIC finding on {inc.node_id} for {CLEAR_S:.0f} s")


__all__ = ["ADAPT_KIND", "CLEAR_S", "MEASURE_STEPS", "eviction_worth", "follow", "pace", "record_switch", "request",
           "versions"]
