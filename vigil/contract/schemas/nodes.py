"""Nodes, events, logs and the service's health, as the API shows them."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
)

from vigil.contract.schemas.telemetry import RankProcess

# --------------------------------------------------------------------------------------------------
# Read models
# --------------------------------------------------------------------------------------------------


class NodeState(str, enum.Enum):
    ALIVE = "ALIVE"
    DEAD = "DEAD"
    EVICTED = "EVICTED"


class NodePublic(BaseModel):
    id: str
    hostname: str
    address: str
    state: NodeState
    agent_id: str | None
    last_heartbeat: datetime | None
    heartbeat_age_s: float | None
    ranks: list[RankProcess] = []
    host: dict[str, Any] = {}


class NodesPublic(BaseModel):
    data: list[NodePublic]
    count: int


class EventPublic(BaseModel):
    id: int
    ts: datetime
    kind: str
    job_id: str | None
    node_id: str | None
    message: str
    data: dict[str, Any] = {}


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


class Health(BaseModel):
    status: Literal["ok"]
    database: str
    version: str
    leader: bool = Field(
        True,
        description="Whether this controller runs the supervisor, the monitor and the aggregation (holds the "
        "leader lock); a standby on the same PostgreSQL database answers false. Always true on SQLite.",
    )


LOG_TAIL_DEFAULT = 256 * 1024
LOG_TAIL_MAX = 16 * 1024 * 1024


class LogsPublic(BaseModel):
    job_id: str
    logs: str
    total_bytes: int = Field(0, description="Size of the whole driver log (UTF-8).")
    truncated: bool = Field(False, description="True: ``logs`` is the tail (``tail_bytes``), cut at a line start.")
