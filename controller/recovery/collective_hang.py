"""A hang found from the collective, in seconds rather than after the hang floor.

The time-based detector (:func:`controller.recovery.detectors.hang`) waits ``hang_floor_s`` (15 s) of silence
because a step may legitimately be long. Inside a collective there is a better yardstick: the job's own
history of that process group's collectives. When the ranks' watchers (:mod:`vigil.rank.watch`) report that a
rank has waited inside collective *n* for longer than ``collective_hang_k`` times the longest collective of
that group the job has recorded (and than ``collective_hang_floor_s``), and the peers' reports confirm it (a
rank of the group never entered *n*, or a rank sends no report at all: stopped, frozen or dead before its
watcher could speak), the job hangs: the finding names that rank when it is the only one, and the usual
diagnosis follows (py-spy stacks, the collectives lined up).

A wait with every rank inside the collective (a transport stall) is left to the time-based detector, as is
a rank silent outside any collective, and a wait while a rank reports step 0 (it ran no step in its process
yet: starting, restoring from a checkpoint, or a live replacement healing from a peer while the survivors
wait for it inside their all-reduce). The longest collective of the history is the yardstick, not a median:
a job whose rank 0 works alone every N steps (an evaluation, a save) while the others wait has long waits on
record, and they raise the limit (the first such wait, before any is on record, is what
``collective_hang_floor_s`` is for).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.models import CollectiveMetric, Job, StepMetric
from controller.recovery import collectives, reads
from controller.recovery.detectors import Finding
from vigil.contract.schemas import LIVE_OPS, IncidentKind, RecoveryThresholds

HISTORY = 2000
"""The newest collective records of the job read for the group's longest collective."""
FRESH_S = 15.0
"""A progress report older than this is not judged (a stalled rank's watcher sends every 5 s)."""
SETTLED_STEPS = 3
"""Steps every rank must have run in the current attempt before its collectives are judged: at a start or
a restart the ranks reach their first collectives apart (one restores a checkpoint from object storage, or
imports more, while its peers wait: 5.3 s seen in the multi-host e2e test after a node loss)."""


def longest(s: Session, job_id: str, group: str) -> float:
    """The longest of the job's newest :data:`HISTORY` collectives of ``group`` (0 with none recorded); live
    recovery's heals and quorums are not collectives of the training (a heal moves the whole state)."""
    newest = (select(CollectiveMetric.duration_s).where(CollectiveMetric.job_id == job_id,
                                                        CollectiveMetric.group == group,
                                                        CollectiveMetric.op.notin_(LIVE_OPS))
              .order_by(CollectiveMetric.id.desc()).limit(HISTORY)).subquery()
    return float(s.scalar(select(func.max(newest.c.duration_s))) or 0.0)


def settled(s: Session, job_id: str, ranks: set[int], attempt: int) -> bool:
    """Whether each of ``ranks`` has run :data:`SETTLED_STEPS` steps in run attempt ``attempt`` (the reports'
    own: a restarted group reports before its first step, while the newest steps are the old group's)."""
    counts = dict(s.execute(select(StepMetric.rank, func.count()).where(
        StepMetric.job_id == job_id, StepMetric.attempt == attempt).group_by(StepMetric.rank)).all())
    return bool(ranks) and all(counts.get(r, 0) >= SETTLED_STEPS for r in ranks)


def _oldest_wait(reports: dict[int, dict[str, Any]], group: str, seq: int) -> float | None:
    """When the first rank entered collective ``seq`` of ``group`` (its ``enqueued_ts``), None if unknown."""
    starts = [float(ref["enqueued_ts"]) for rep in reports.values() for ref in rep["state"].get("in_flight") or ()
              if ref.get("group") == group and int(ref.get("seq", -1)) == seq and ref.get("enqueued_ts")]
    return min(starts) if starts else None


def detect(s: Session, job: Job, th: RecoveryThresholds, now: float) -> list[Finding]:
    """The job's hang, if its ranks' collective reports show one (module docstring); else nothing. Only reports
    sent since the job's newest step and within :data:`FRESH_S` count: a report stays stored after its stall
    ended (the watcher stops sending once steps flow again)."""
    last_step_ts = reads.last_step_ts(s, job.id) or 0.0
    reports = {r: rep for r, rep in reads.rank_progress(s, job.id).items()
               if rep["ts"] >= last_step_ts and now - rep["ts"] <= FRESH_S}
    if any(not rep.get("step") for rep in reports.values()):
        return []  # a rank that ran no step in its process yet (starting, restoring, a live replica healing)
    locations = reads.rank_locations(s, job.id)
    found = collectives.analyse(reports, [r for r, loc in locations.items() if loc.alive])
    if found is None:
        return []
    where = found["waiting_in"]
    began = _oldest_wait(reports, where["group"], where["seq"])
    if began is None:
        return []
    usual = longest(s, job.id, where["group"])
    limit = max(th.collective_hang_k * usual, th.collective_hang_floor_s)
    waited = now - began
    if waited <= limit:
        return []
    silent = found["silent"]
    suspects = sorted(set(found["not_entered"]) | set(silent))
    if not suspects:
        return []  # every rank is inside it: a transport stall, judged by time
    attempt = max(int(rep.get("attempt") or 0) for rep in reports.values())
    if not settled(s, job.id, set(reports) | set(silent), attempt):
        return []  # the attempt's first steps: ranks arrive apart, judged by time
    # Named at once only when one rank that reported never entered; a silent rank may only be late with its
    # report: the diagnosis (stacks, every rank's report or stack_wait_s) names it then.
    rank = found["not_entered"][0] if len(found["not_entered"]) == 1 and not silent else None
    loc = locations.get(rank) if rank is not None else None
    evidence = {"found_by": "collective", "waited_s": round(waited, 2), "limit_s": round(limit, 2),
                "longest_collective_s": round(usual, 4), "suspects": suspects, "silent_ranks": silent,
                "at_detection": collectives.summary(found), "last_step": job.last_step}
    return [Finding(IncidentKind.HANG, job.id, loc.node_id if loc is not None else None, rank, evidence,
                    step=job.last_step)]


__all__ = ["FRESH_S", "HISTORY", "SETTLED_STEPS", "detect", "longest", "settled"]
