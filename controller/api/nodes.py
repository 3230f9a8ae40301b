"""Nodes and events (read-only for now)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import func, select

from controller.api.deps import SessionDep
from controller.models import Event, Node
from vigil.contract.schemas import (
    ID_PATTERN,
    EventPublic,
    EventsPublic,
    NodePublic,
    NodesPublic,
    NodeState,
    RankProcess,
)

router = APIRouter(tags=["nodes"])


@router.get("/nodes", response_model=NodesPublic)
def list_nodes(session: SessionDep) -> NodesPublic:
    """Nodes that have an agent reporting, with their heartbeat age and the ranks they run."""
    now = time.time()
    rows = session.scalars(select(Node).order_by(Node.id)).all()
    data = [
        NodePublic(
            id=n.id, hostname=n.hostname, address=n.address, state=NodeState(n.state), agent_id=n.agent_id,
            last_heartbeat=n.last_heartbeat,
            heartbeat_age_s=(now - n.last_heartbeat.timestamp()) if n.last_heartbeat else None,
            ranks=[RankProcess.model_validate(r) for r in n.ranks], host=n.host,
        )
        for n in rows
    ]
    return NodesPublic(data=data, count=len(data))


@router.get("/events", response_model=EventsPublic)
def list_events(
    session: SessionDep,
    job_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventsPublic:
    """Most recent events first."""
    q = select(Event)
    cq = select(func.count()).select_from(Event)
    if job_id is not None:
        q = q.where(Event.job_id == job_id)
        cq = cq.where(Event.job_id == job_id)
    rows = session.scalars(q.order_by(Event.id.desc()).limit(limit)).all()
    return EventsPublic(
        data=[EventPublic(id=e.id, ts=e.ts, kind=e.kind, job_id=e.job_id, node_id=e.node_id, message=e.message,
                          data=e.data) for e in rows],
        count=session.scalar(cq) or 0,
    )
