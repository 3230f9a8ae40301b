"""Tokens: roles and who may call the API."""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from vigil.contract.schemas.common import ID_PATTERN, NAME_MAX, NODE_ID_PATTERN, Line, _Strict

# --------------------------------------------------------------------------------------------------
# Tokens (who may call the API)
# --------------------------------------------------------------------------------------------------


class Role(str, enum.Enum):
    """What a bearer token may do; ``controller.auth.ROUTE_POLICY`` maps every route to roles."""

    ADMIN = "admin"
    """Everything, including token management."""
    USER = "user"
    """Submit, cancel, recover, evict/readmit, and read."""
    AGENT = "agent"
    """A node agent: ingest telemetry and heartbeats; nothing else."""
    VIEWER = "viewer"
    """Read only (the dashboard)."""
    JOB = "job"
    """A job's Ray driver: only its own job (the token names it)."""


class TokenCreate(_Strict):
    """A token to issue. ``job_id`` is required for (and only for) the ``job`` role."""

    role: Role = Field(..., description="admin | user | agent | viewer | job.")
    name: Line = Field("", max_length=NAME_MAX, description="What the token is for (shown in lists).")
    job_id: str | None = Field(None, pattern=ID_PATTERN, description="The job a ``job`` token is scoped to.")
    node_id: str | None = Field(
        None, pattern=NODE_ID_PATTERN,
        description="The node an ``agent`` token is scoped to: it may ingest and fetch commands for that node only.",
    )
    expires_at: datetime | None = Field(
        None, description="When the token stops working (ISO 8601; UTC when no offset is given); none: never."
    )

    @field_validator("expires_at")
    @classmethod
    def _expiry_in_future(cls, v: datetime | None) -> datetime | None:
        if v is None:
            return v
        if v.tzinfo is None:
            v = v.replace(tzinfo=UTC)
        if v <= datetime.now(UTC):
            raise ValueError("must be in the future")
        return v

    @model_validator(mode="after")
    def _job_scope(self) -> TokenCreate:
        if (self.role == Role.JOB) != (self.job_id is not None):
            raise ValueError("job_id is required for the job role, and only for it")
        if self.node_id is not None and self.role != Role.AGENT:
            raise ValueError("node_id: only an agent token is scoped to a node")
        return self


class TokenPublic(BaseModel):
    """A token as listed: never the secret itself (only stored as a hash), only its first characters."""

    id: str
    name: str
    role: Role
    job_id: str | None = None
    node_id: str | None = Field(None, description="The node an agent token is scoped to (none: any node).")
    hint: str = Field(..., description="The token's first characters, to tell tokens apart.")
    created_at: datetime
    created_by: str | None = Field(None, description="Id of the token that issued this one.")
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = Field(None, description="Last accepted use (updated at most once a minute).")
    active: bool = Field(..., description="Neither revoked nor expired.")


class TokenCreated(TokenPublic):
    """The answer to creating a token: the only time its secret is shown."""

    token: str


class TokensPublic(BaseModel):
    data: list[TokenPublic]
    count: int


class WhoAmI(BaseModel):
    """``GET /whoami``: who the caller's token says it is (never the secret). The dashboard's sign-in
    checks a pasted token with it before keeping it server side."""

    token_id: str | None = Field(None, description="The token's id (tok_...); none for an in-process token.")
    role: Role
    name: str = Field("", description="What the token is for, as given when it was issued.")
    job_id: str | None = Field(None, description="The one job a ``job`` token may touch.")
    node_id: str | None = Field(None, description="The one node an ``agent`` token acts for.")
