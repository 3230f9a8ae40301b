"""Fault injection: faults are stored, fired when their job reaches the step, and undone at the end.

Every fault is carried out for real by the target node's agent (signals to the rank's process, a
fault file the rank reads, bytes overwritten in a checkpoint, the raylet killed); the controller only
decides when and where. Not part of recovery (:mod:`controller.recovery`), which must find these faults
as it would find real ones: the monitor's pass only fires and clears them (:func:`fire_due`,
:func:`clear_for_ended_jobs`). Where ranks run comes from :mod:`controller.locate` (``rank_locations``
is re-exported here for the REST API).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import PurePosixPath

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db import take_write_lock
from controller.jobs import record_event
from controller.launcher import ClusterControl, LaunchError
from controller.locate import RankLocation, rank_locations
from controller.models import Fault, Job, Node
from controller.recovery import commands
from controller.recovery.checkpoints import newest_valid
from vigil.contract.schemas import (
    CommandKind,
    FaultCreate,
    FaultKind,
    FaultPublic,
    FaultStatus,
    JobStatus,
    NodeState,
)

__all__ = ["RankLocation", "clear_fault", "clear_for_ended_jobs", "create_fault", "fire_due", "rank_locations",
           "to_public"]

log = logging.getLogger(__name__)

NETWORK_KINDS = {FaultKind.DEGRADE_NIC, FaultKind.NIC_LATENCY, FaultKind.NIC_LOSS, FaultKind.FLAP_NIC,
                 FaultKind.PARTITION_NODE}


def create_fault(session: Session, job: Job, body: FaultCreate) -> Fault:
    if JobStatus(job.status).is_terminal():
        raise ValueError(f"job {job.id} already ended as {job.status}")
    f = Fault(job_id=job.id, kind=body.kind.value, rank=body.rank, node_id=body.node_id, step=body.step,
              params=dict(body.params), status=FaultStatus.PENDING.value)
    session.add(f)
    session.flush()
    record_event(session, "fault_created", f"{body.kind.value} at step {body.step}"
                 + (f" on rank {body.rank}" if body.rank is not None else "")
                 + (f" on node {body.node_id}" if body.node_id else ""), job_id=job.id, data={"fault_id": f.id})
    return f


def to_public(f: Fault) -> FaultPublic:
    return FaultPublic(id=f.id, job_id=f.job_id, kind=FaultKind(f.kind), rank=f.rank, node_id=f.node_id, step=f.step,
                       hit_step=f.hit_step, params=f.params, status=FaultStatus(f.status), message=f.message, created_at=f.created_at,
                       fired_at=f.fired_at, cleared_at=f.cleared_at)


def fire_due(session: Session, cluster: ClusterControl | None = None) -> int:
    """Fire every pending fault whose job has reached its step. Returns how many fired.

    Each fault fires on its own: one that cannot be carried out (whatever the reason, a stored row older
    than today's parameter checks included) is marked FAILED with the reason, and the others, and the rest
    of the monitor's pass, go on."""
    fired = 0
    rows = session.scalars(select(Fault).where(Fault.status == FaultStatus.PENDING.value).order_by(Fault.id)).all()
    for f in rows:
        job = session.get(Job, f.job_id)
        if job is None or JobStatus(job.status).is_terminal():
            _finish(session, f, FaultStatus.CLEARED, "job ended before the fault fired")
            continue
        try:
            kind = FaultKind(f.kind)
            # Faults in a fault file are armed at once: the rank itself fires them at the step (the file says which).
            if not _in_rank(f) and (job.last_step is None or job.last_step < f.step):
                continue
            take_write_lock(session)  # the savepoint reads, then writes (controller/db.py)
            with session.begin_nested():
                done = _fire(session, job, f, kind, cluster)
        except Exception as e:  # noqa: BLE001 - one bad fault never stops the monitor (docs/SECURITY.md)
            log.warning("fault %s of job %s cannot fire: %s: %s", f.id, f.job_id, type(e).__name__, e)
            _finish(session, f, FaultStatus.FAILED, f"cannot be carried out: {type(e).__name__}: {e}"[:1000])
            continue
        fired += done
    return fired


def _refusal(session: Session, job: Job, f: Fault, kind: FaultKind, node_id: str,
             locs: dict[int, RankLocation], cluster: ClusterControl | None) -> str | None:
    """Why a fault may not act on ``node_id``, or None: a node the caller named must hold a rank of the job;
    the Ray head (its GCS, every job's driver) is never killed."""
    if f.node_id is not None and node_id not in {loc.node_id for loc in locs.values()}:
        return f"node {node_id!r} holds no rank of job {job.id}: a fault acts only where its job runs"
    if kind == FaultKind.KILL_NODE and cluster is not None:
        try:
            head = any(n.is_head for n in cluster.nodes() if n.name == node_id)
        except LaunchError as e:
            return f"cannot tell whether node {node_id!r} is the Ray head ({e}): not killed"
        if head:
            return f"node {node_id!r} is the Ray head (GCS, every job's driver): kill_node never targets it"
    return None


SLOW_PERIOD_S = 0.02
"""slow_rank's default stop/run cycle: short next to a step's compute phase, so every phase of every
step is slowed alike. A cycle longer than the compute phase slows whichever phase the stop happens to
fall into (often the collective, where the peers then wait as long): a slow step, not a slow rank."""


def _fire(session: Session, job: Job, f: Fault, kind: FaultKind, cluster: ClusterControl | None = None) -> bool:
    locs = rank_locations(session, job.id)
    node_id = f.node_id
    loc = locs.get(f.rank) if f.rank is not None else None
    if f.rank is not None:
        if loc is None or not loc.alive:
            return False  # not placed yet (or restarting): try again next pass
        node_id = node_id or loc.node_id
    cmd: tuple[CommandKind, dict] | None = None
    if kind in (FaultKind.KILL_RANK, FaultKind.HANG_RANK) and _in_rank(f):
        cmd = (CommandKind.WRITE_FAULT_FILE, {"job_id": job.id, "rank": f.rank,
                                              "fault": {"kind": kind.value, "step": f.step, "fault_id": f.id}})
    elif kind == FaultKind.KILL_RANK:
        cmd = (CommandKind.KILL_PID, {"pid": loc.pid, "signal": 9})  # type: ignore[union-attr]
    elif kind == FaultKind.HANG_RANK:
        cmd = (CommandKind.STOP_PID, {"pid": loc.pid})  # type: ignore[union-attr]
    elif kind == FaultKind.SLOW_RANK and _in_rank(f):
        fault = {"kind": "slow_rank", "step": f.step, "factor": float(f.params.get("factor", 3.0)), "fault_id": f.id}
        if f.params.get("mode") == "comm":
            fault["mode"] = "comm"
        cmd = (CommandKind.WRITE_FAULT_FILE, {"job_id": job.id, "rank": f.rank, "fault": fault})
    elif kind == FaultKind.SLOW_RANK:
        factor = float(f.params.get("factor", 3.0))
        cmd = (CommandKind.THROTTLE_PID, {"pid": loc.pid, "factor": factor,  # type: ignore[union-attr]
                                          "period_s": float(f.params.get("period_s", SLOW_PERIOD_S))})
    elif kind == FaultKind.NAN_LOSS:
        cmd = (CommandKind.WRITE_FAULT_FILE, {"job_id": job.id, "rank": f.rank,
                                              "fault": {"kind": "nan_loss", "step": f.step, "fault_id": f.id}})
    elif kind == FaultKind.KILL_NODE:
        cmd = (CommandKind.KILL_NODE, {})
    elif kind == FaultKind.CORRUPT_CHECKPOINT:
        ck = newest_valid(session, job.id)
        if ck is None:
            return False  # wait for a checkpoint to exist
        node_id = node_id or (locs[0].node_id if 0 in locs else _any_alive_node(session))
        # The newest complete checkpoint on storage, which is what a restart reads: the newest one the
        # controller knows of may be older (a rank reports a checkpoint only at its next sync point).
        cmd = (CommandKind.CORRUPT_FILES, {"path": str(PurePosixPath(ck.path).parent), "newest_under": True,
                                           "known_step": ck.step})
    elif kind in NETWORK_KINDS:
        node_id = node_id or (loc.node_id if loc else None)
        cmd = (CommandKind.SHAPE_NIC, {"kind": kind.value, **f.params})
    if cmd is None or node_id is None:
        _finish(session, f, FaultStatus.FAILED, "no target node")
        return False
    refused = _refusal(session, job, f, kind, node_id, locs, cluster)
    if refused is not None:
        _finish(session, f, FaultStatus.FAILED, refused)
        return False
    commands.enqueue(session, node_id, cmd[0], cmd[1], job_id=job.id, fault_id=f.id)
    f.node_id = node_id
    f.status = FaultStatus.FIRED.value
    f.fired_at = datetime.now(UTC)
    f.message = f"{cmd[0].value} sent to {node_id}" + (f" (step {job.last_step})" if job.last_step is not None else "")
    record_event(session, "fault_fired", f"{kind.value}: {f.message}", job_id=job.id, node_id=node_id,
                 data={"fault_id": f.id, "step": job.last_step})
    return True


def _in_rank(f: Fault) -> bool:
    """Whether the rank itself carries the fault out (a fault file: at exactly its step) rather than its
    node's agent (once the controller has seen the job reach the step: later, by a poll or two)."""
    kind = FaultKind(f.kind)
    if kind in (FaultKind.KILL_RANK, FaultKind.HANG_RANK):
        return f.params.get("mode", "rank") == "rank"
    return kind == FaultKind.NAN_LOSS or (kind == FaultKind.SLOW_RANK and f.params.get("mode") in ("compute", "comm"))


def _any_alive_node(session: Session) -> str | None:
    return session.scalar(select(Node.id).where(Node.state == NodeState.ALIVE.value).limit(1))


UNDO = {FaultKind.HANG_RANK: CommandKind.CONT_PID, FaultKind.SLOW_RANK: CommandKind.UNTHROTTLE_PID}


def clear_fault(session: Session, f: Fault, why: str = "cleared") -> None:
    """Undo a fired fault where it can be undone (a stopped rank continues, a throttle ends)."""
    kind = FaultKind(f.kind)
    if f.status == FaultStatus.FIRED.value and f.node_id:
        if kind == FaultKind.SLOW_RANK and _in_rank(f) and f.rank is not None:
            # Back to normal speed from the next step (a process already gone took its slowness along).
            commands.enqueue(session, f.node_id, CommandKind.WRITE_FAULT_FILE, {
                "job_id": f.job_id, "rank": f.rank,
                "fault": {"kind": "slow_rank", "step": 0, "factor": 1.0, "fault_id": f.id}},
                job_id=f.job_id, fault_id=f.id)
        elif kind in UNDO and f.rank is not None:
            loc = rank_locations(session, f.job_id).get(f.rank)
            if loc is not None:
                commands.enqueue(session, f.node_id, UNDO[kind], {"pid": loc.pid}, job_id=f.job_id, fault_id=f.id)
        elif kind in NETWORK_KINDS:
            commands.enqueue(session, f.node_id, CommandKind.SHAPE_NIC, {"kind": "clear"}, job_id=f.job_id,
                             fault_id=f.id)
    _finish(session, f, FaultStatus.CLEARED, why)


def clear_for_ended_jobs(session: Session) -> None:
    rows = session.scalars(
        select(Fault).join(Job, Job.id == Fault.job_id)
        .where(Fault.status.in_([FaultStatus.FIRED.value, FaultStatus.PENDING.value]),
               Job.status.in_([s.value for s in JobStatus if s.is_terminal()]))
    ).all()
    for f in rows:
        kind = FaultKind(f.kind)
        # A throttle and a stopped process (whoever stopped it) outlive the job's end; a compute slow-down does not.
        needs_undo = (kind in UNDO and not (kind == FaultKind.SLOW_RANK and _in_rank(f))) or kind in NETWORK_KINDS
        if f.status == FaultStatus.PENDING.value or needs_undo:
            clear_fault(session, f, "job ended")


def _finish(session: Session, f: Fault, status: FaultStatus, message: str) -> None:
    f.status = status.value
    f.cleared_at = datetime.now(UTC)
    f.message = message if not f.message else f"{f.message}; {message}"
    record_event(session, "fault_" + status.value.lower(), f"{f.kind}: {message}", job_id=f.job_id,
                 node_id=f.node_id, data={"fault_id": f.id})
