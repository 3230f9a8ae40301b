"""Agent ingest: ``POST /telemetry`` with a TelemetryBatch (JSON, optionally gzip)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from controller.api.deps import SettingsDep
from controller.auth import CurrentPrincipal, check_node_scope
from controller.db import session_scope
from controller.host_history import HostHistoryLimits
from controller.schemas import TelemetryAck, TelemetryBatch
from controller.telemetry import BodyTooLarge, decode_body, ingest
from controller.tokens import Principal

router = APIRouter(tags=["telemetry"])


@router.post(
    "/telemetry",
    response_model=TelemetryAck,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TelemetryBatch"}}},
        }
    },
)
async def post_telemetry(request: Request, settings: SettingsDep, principal: CurrentPrincipal) -> TelemetryAck:
    """Store a batch once; a replay of (agent_id, seq) is acknowledged as a duplicate and ignored.

    A bad batch (invalid JSON, a field out of range, too large) is refused whole with 422/413; a
    batch for another node than the agent token's own is refused with 403.
    """
    raw = await request.body()
    # Decoding, validation and the database work all run in a worker thread: parsing a batch of
    # 10,000 samples takes tens of milliseconds that the event loop must not be blocked for, and a
    # write waiting for SQLite's lock must never block the loop that would let the holder commit.
    return await run_in_threadpool(
        _decode_and_store, request.app.state.sessions, raw, request.headers.get("content-encoding"),
        settings.max_body_bytes, principal,
        HostHistoryLimits(settings.host_history_interval_s, settings.host_history_max_rows),
    )


def _decode_and_store(
    sessions: sessionmaker[Session], raw: bytes, encoding: str | None, limit: int, principal: Principal,
    host_history: HostHistoryLimits,
) -> TelemetryAck:
    try:
        body = decode_body(raw, encoding, limit)
    except BodyTooLarge as exc:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail=str(exc)) from exc
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(exc)) from exc
    try:
        batch = TelemetryBatch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False, include_input=False)) from exc
    check_node_scope(principal, batch.node_id)
    with session_scope(sessions) as session:
        return ingest(session, batch, host_history=host_history)
