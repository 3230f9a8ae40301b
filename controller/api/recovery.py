"""Fault injection, incidents, checkpoints, stacks, manual recovery, eviction, and agent commands."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import func, select

from controller import command_bell, faults
from controller import jobs as job_service
from controller.api.deps import JobId, NodeId, RowId, SessionDep
from controller.db import on_commit, session_scope
from controller.models import Fault, Incident, Node, StackDump
from controller.recovery import checkpoints, commands
from controller.recovery.actions import HeadNodeError, evict_node, is_head_node, readmit_node, restart_job
from controller.recovery.stacks import group_stacks, training_thread_first
from vigil.contract.schemas import (
    ID_PATTERN,
    CheckpointsPublic,
    CommandResult,
    CommandStatus,
    FaultCreate,
    FaultKind,
    FaultPublic,
    FaultsPublic,
    FaultStatus,
    IncidentPublic,
    IncidentsPublic,
    JobStatus,
    NodeActionPublic,
    NodeCommandsPublic,
    NodeState,
    RecoverRequest,
    StacksPublic,
)

router = APIRouter(tags=["recovery"])


def _job(session: SessionDep, job_id: str):  # type: ignore[no-untyped-def]
    try:
        return job_service.get_job(session, job_id)
    except job_service.JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} not found") from None


def _node(session: SessionDep, node_id: str) -> Node:
    node = session.get(Node, node_id)
    if node is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"node {node_id!r} not found")
    return node


def _incident_public(i: Incident) -> IncidentPublic:
    return IncidentPublic.model_validate(i, from_attributes=True)


# -- faults ------------------------------------------------------------------------------------------


@router.post("/jobs/{job_id}/faults", status_code=status.HTTP_201_CREATED, response_model=FaultPublic)
def inject_fault(job_id: JobId, body: FaultCreate, session: SessionDep, request: Request) -> FaultPublic:
    """Inject a real fault into a running job once it reaches ``step`` (see docs/RECOVERY.md)."""
    job = _job(session, job_id)
    if body.node_id is not None:
        # Refused now where it is known already (the monitor checks again when the fault fires).
        held = {loc.node_id for loc in faults.rank_locations(session, job.id).values()}
        if held and body.node_id not in held:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"node_id: node {body.node_id!r} holds no rank of "
                                f"job {job.id} (its ranks are on {', '.join(sorted(held))})")
        if body.kind == FaultKind.KILL_NODE and is_head_node(request.app.state.monitor.cluster, body.node_id):
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"node_id: node {body.node_id!r} is the Ray head "
                                "(GCS, every job's driver): kill_node never targets it")
    try:
        f = faults.create_fault(session, job, body)
    except ValueError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from exc
    out = faults.to_public(f)
    session.commit()
    # Arm it now rather than at the monitor's next pass: a fault the rank carries out is exact only
    # if its file reaches the rank before the step (a standby's idle monitor ignores the wake).
    request.app.state.monitor.wake()
    return out


@router.get("/jobs/{job_id}/faults", response_model=FaultsPublic)
def list_faults(job_id: JobId, session: SessionDep) -> FaultsPublic:
    _job(session, job_id)
    rows = session.scalars(select(Fault).where(Fault.job_id == job_id).order_by(Fault.id)).all()
    return FaultsPublic(data=[faults.to_public(f) for f in rows], count=len(rows))


@router.post("/jobs/{job_id}/faults/{fault_id}/clear", response_model=FaultPublic)
def clear_fault(job_id: JobId, fault_id: RowId, session: SessionDep) -> FaultPublic:
    """Undo a fault (a stopped rank continues, a throttle or a NIC fault ends)."""
    f = session.get(Fault, fault_id)
    if f is None or f.job_id != job_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"fault {fault_id} of job {job_id!r} not found")
    if f.status in (FaultStatus.CLEARED.value, FaultStatus.FAILED.value):
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"fault {fault_id} is already {f.status}")
    faults.clear_fault(session, f, "cleared by user")
    return faults.to_public(f)


# -- incidents, checkpoints, stacks --------------------------------------------------------------------


@router.get("/incidents", response_model=IncidentsPublic)
def list_incidents(
    session: SessionDep, job_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> IncidentsPublic:
    q = select(Incident)
    cq = select(func.count()).select_from(Incident)
    if job_id is not None:
        q, cq = q.where(Incident.job_id == job_id), cq.where(Incident.job_id == job_id)
    rows = session.scalars(q.order_by(Incident.id.desc()).limit(limit)).all()
    return IncidentsPublic(data=[_incident_public(i) for i in rows], count=session.scalar(cq) or 0)


@router.get("/jobs/{job_id}/incidents", response_model=IncidentsPublic)
def job_incidents(job_id: JobId, session: SessionDep) -> IncidentsPublic:
    _job(session, job_id)
    rows = session.scalars(select(Incident).where(Incident.job_id == job_id).order_by(Incident.id)).all()
    return IncidentsPublic(data=[_incident_public(i) for i in rows], count=len(rows))


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointsPublic)
def job_checkpoints(job_id: JobId, session: SessionDep) -> CheckpointsPublic:
    """Checkpoints the job reported, oldest first; only ``valid`` ones are restored from."""
    _job(session, job_id)
    data = checkpoints.list_checkpoints(session, job_id)
    return CheckpointsPublic(data=data, count=len(data))


@router.get("/jobs/{job_id}/stacks", response_model=StacksPublic)
def job_stacks(job_id: JobId, session: SessionDep) -> StacksPublic:
    """The newest py-spy stacks of the job's ranks, grouped; ``odd_ranks`` are the likely culprits."""
    _job(session, job_id)
    newest = session.scalar(select(func.max(StackDump.incident_id)).where(StackDump.job_id == job_id))
    q = select(StackDump).where(StackDump.job_id == job_id)
    q = q.where(StackDump.incident_id == newest) if newest is not None else q
    rows = session.scalars(q.order_by(StackDump.id)).all()
    stacks = {d.rank: d.stack for d in rows}
    groups, odd = group_stacks(stacks) if stacks else ([], [])
    return StacksPublic(job_id=job_id, collected_at=max((d.collected_at for d in rows), default=None), groups=groups,
                        odd_ranks=odd, stacks={r: training_thread_first(t) for r, t in stacks.items()})


# -- manual recovery -------------------------------------------------------------------------------------


@router.post("/jobs/{job_id}/recover", response_model=IncidentPublic, status_code=status.HTTP_202_ACCEPTED)
def recover_job(job_id: JobId, body: RecoverRequest, session: SessionDep, request: Request) -> IncidentPublic:
    """Restart the job's ranks from the newest valid checkpoint (optionally evicting a node first)."""
    job = _job(session, job_id)
    if job.status != JobStatus.RUNNING.value:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job {job_id!r} is {job.status}, not RUNNING")
    monitor = request.app.state.monitor
    if body.evict_node is not None:
        _node(session, body.evict_node)
        if is_head_node(monitor.cluster, body.evict_node):
            raise HTTPException(status.HTTP_409_CONFLICT,
                                detail=f"evict_node: {body.evict_node!r} is the Ray head and is never evicted")
    inc = restart_job(session, monitor.cluster, job, body.reason, body.evict_node, clock=monitor.clock)
    return _incident_public(inc)


@router.post("/nodes/{node_id}/evict", response_model=NodeActionPublic)
def evict(node_id: NodeId, session: SessionDep, request: Request,
          deadline_s: Annotated[float, Query(gt=0, le=3600)] = 5.0) -> NodeActionPublic:
    """Drain the node in Ray (its ranks checkpoint and restart elsewhere); it stays out until readmitted."""
    _node(session, node_id)
    try:
        outcome = evict_node(session, request.app.state.monitor.cluster, node_id, "manual eviction", deadline_s)
    except HeadNodeError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from exc
    return NodeActionPublic(node_id=node_id, state=NodeState.EVICTED, outcome=outcome)


@router.post("/nodes/{node_id}/readmit", response_model=NodeActionPublic)
def readmit(node_id: NodeId, session: SessionDep) -> NodeActionPublic:
    """Take an evicted node back: its agent starts a fresh raylet."""
    _node(session, node_id)
    try:
        readmit_node(session, node_id)
    except ValueError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from exc
    return NodeActionPublic(node_id=node_id, state=NodeState.ALIVE)


# -- agent commands -------------------------------------------------------------------------------------------


@router.get("/nodes/{node_id}/commands", response_model=NodeCommandsPublic)
async def node_commands(
    request: Request,
    node_id: NodeId,
    wanted: Annotated[Literal["PENDING", "DONE", "FAILED", "ALL"], Query(
        alias="status", description="Commands of this status (the agent polls PENDING); ALL: any.")] = "PENDING",
    wait_s: Annotated[float, Query(ge=0, le=command_bell.MAX_WAIT_S, description=(
        "PENDING only: when none is pending, wait up to this long for one (a long poll: the answer comes as "
        "soon as a command for the node is queued)."))] = 0.0,
) -> NodeCommandsPublic:
    """This node's commands of ``status`` (default: pending, what the agent polls), oldest first.

    Async: a waiting poll holds no thread and no database connection (controller/command_bell.py)."""
    sessions = request.app.state.sessions
    status_ = None if wanted == "ALL" else CommandStatus(wanted)

    def read() -> list:
        with session_scope(sessions) as s:
            return commands.listed(s, node_id, status_)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + (wait_s if status_ == CommandStatus.PENDING else 0.0)
    while True:
        rung = command_bell.BELL.count(node_id)  # before the read: a ring after it is not missed
        data = await run_in_threadpool(read)
        if data or loop.time() >= deadline:
            return NodeCommandsPublic(data=data, count=len(data))
        if await request.is_disconnected():  # the agent went away (stopped, killed): nobody to answer
            return NodeCommandsPublic(data=[], count=0)
        recheck = min(deadline, loop.time() + command_bell.RECHECK_S)
        while loop.time() < recheck and command_bell.BELL.count(node_id) == rung:
            await asyncio.sleep(command_bell.LOOK_S)


@router.post("/nodes/{node_id}/commands/{command_id}/result", response_model=dict)
def command_result(request: Request, node_id: NodeId, command_id: RowId, body: CommandResult,
                   session: SessionDep) -> dict:
    """An agent's answer; a second answer to the same command is acknowledged and ignored. The monitor's
    next pass comes as soon as the answer is stored (a hang's stacks, say, which its decision waits for)."""
    try:
        stored = commands.record_result(session, node_id, command_id, body)
    except commands.CommandNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"command {command_id} of {node_id!r} not found") from None
    monitor = getattr(request.app.state, "monitor", None)
    if stored and monitor is not None:
        on_commit(session, "wake-monitor", monitor.wake)
    return {"stored": stored}
