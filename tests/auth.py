"""Credentials for tests that talk to a real controller: tokens issued straight in its database."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from controller.db import session_scope
from controller.tokens import create_token
from vigil.contract.schemas import Role, TokenCreate


def issue_token(app: Any, role: Role | str, *, job_id: str | None = None, expires_at: datetime | None = None,
                name: str = "test", node_id: str | None = None) -> str:
    """A new token of ``role`` for the controller ``app`` (a ``create_app()`` result), as ``vigil up`` makes one."""
    with session_scope(app.state.sessions) as session:
        return create_token(session, TokenCreate(role=Role(role), job_id=job_id, expires_at=expires_at,
                                                 name=name, node_id=node_id)).token


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
