"""Commands for node agents: queued by the monitor and the API, fetched and answered by the agents."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controller.command_bell import queued
from controller.jobs import record_event
from controller.models import Fault, Job, NodeCommandRow, StackDump
from vigil.contract.schemas import CommandKind, CommandResult, CommandStatus, NodeCommand

log = logging.getLogger(__name__)


def enqueue(
    session: Session, node_id: str, kind: CommandKind, args: dict[str, Any] | None = None, *,
    job_id: str | None = None, incident_id: int | None = None, fault_id: int | None = None,
) -> NodeCommandRow:
    row = NodeCommandRow(node_id=node_id, kind=kind.value, args=args or {}, status=CommandStatus.PENDING.value,
                         job_id=job_id, incident_id=incident_id, fault_id=fault_id, result={})
    session.add(row)
    session.flush()
    queued(session, node_id)  # the agent's long poll answers once this commits
    record_event(session, "command", f"{kind.value} -> {node_id}", job_id=job_id, node_id=node_id,
                 data={"command_id": row.id, "args": row.args})
    return row


def pending(session: Session, node_id: str, limit: int = 100) -> list[NodeCommand]:
    return listed(session, node_id, CommandStatus.PENDING, limit)


def listed(session: Session, node_id: str, status: CommandStatus | None, limit: int = 100) -> list[NodeCommand]:
    """``node_id``'s commands of ``status`` (None: any), oldest first."""
    q = select(NodeCommandRow).where(NodeCommandRow.node_id == node_id)
    if status is not None:
        q = q.where(NodeCommandRow.status == status.value)
    return [to_public(r) for r in session.scalars(q.order_by(NodeCommandRow.id).limit(limit)).all()]


def to_public(r: NodeCommandRow) -> NodeCommand:
    return NodeCommand(id=r.id, node_id=r.node_id, kind=CommandKind(r.kind), args=r.args,
                       status=CommandStatus(r.status), created_at=r.created_at)


class CommandNotFound(LookupError):
    pass


def record_result(session: Session, node_id: str, command_id: int, result: CommandResult) -> bool:
    """Store an agent's answer once (a repeat is ignored: returns False). py-spy stacks become StackDumps."""
    row = session.get(NodeCommandRow, command_id)
    if row is None or row.node_id != node_id:
        raise CommandNotFound(command_id)
    if row.status != CommandStatus.PENDING.value:
        return False
    row.status = (CommandStatus.DONE if result.ok else CommandStatus.FAILED).value
    row.result = result.output
    row.message = result.message[:4096] or None
    row.done_at = datetime.now(UTC)
    if row.kind == CommandKind.PYSPY_DUMP.value and row.job_id:
        pids = row.args.get("pids", {})
        states = result.output.get("states", {}) if isinstance(result.output.get("states"), dict) else {}
        for rank, text in (result.output.get("stacks") or {}).items():
            state = states.get(str(rank))
            header = f"# process state: {state}\n" if state else ""
            session.add(StackDump(job_id=row.job_id, incident_id=row.incident_id, node_id=node_id, rank=int(rank),
                                  pid=int(pids.get(str(rank), 0)), stack=(header + str(text))[:200_000]))
    if row.fault_id is not None and result.ok and row.job_id and row.kind != CommandKind.WRITE_FAULT_FILE.value:
        # An agent-side fault hit the job wherever it was when the agent acted: the newest step the
        # controller has then (a fault the rank carries out reports its exact step itself).
        session.execute(update(Fault).where(Fault.id == row.fault_id, Fault.hit_step.is_(None))
                        .values(hit_step=select(Job.last_step).where(Job.id == row.job_id).scalar_subquery()))
    record_event(session, "command_result", f"{row.kind} on {node_id}: {'ok' if result.ok else 'failed'}"
                 + (f" ({result.message[:200]})" if result.message else ""), job_id=row.job_id, node_id=node_id,
                 data={"command_id": row.id})
    session.flush()
    return True
