"""FastAPI dependencies, as ``Annotated`` aliases the routes declare."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session

from controller.auth import CurrentPrincipal
from vigil.contract.schemas import ID_PATTERN, INT64_MAX, NODE_ID_PATTERN
from vigil.contract.settings import Settings


def get_session(request: Request) -> Iterator[Session]:
    """A session per request: committed when the handler returns, rolled back on any error.

    Scoped to the handler (``SessionDep``): the commit happens before the response is sent, so a
    client told 2xx finds its write stored, and a commit that fails is an error answer, never a
    success whose write was lost (with the default request scope FastAPI commits after sending)."""
    session: Session = request.app.state.sessions()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]

# Ids in paths: refused with 422 unless they look like what the controller hands out, so no odd
# byte (NUL, a slash, 10 kB of text, an integer beyond 64 bits) ever reaches a query.
JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job's id (job_...).")]
NodeId = Annotated[str, Path(pattern=NODE_ID_PATTERN, description="A node's id.")]
RowId = Annotated[int, Path(ge=0, le=INT64_MAX, description="A numeric id.")]

__all__ = ["CurrentPrincipal", "JobId", "NodeId", "RowId", "SessionDep", "SettingsDep", "get_app_settings",
           "get_session"]
