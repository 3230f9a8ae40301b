"""Agent ingest: ``POST /telemetry`` with a TelemetryBatch (JSON, optionally gzip), and
``POST /telemetry/columnar`` with the same batch in columns (MessagePack, optionally gzip; see
:mod:`vigil.contract.schemas.columnar`): one schema, two encodings, the same storage and exactly-once rules."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from controller.api.deps import SettingsDep
from controller.auth import CurrentPrincipal, check_node_scope
from controller.columnar import ColumnarError, decode, ingest_columnar
from controller.db import session_scope, sqlite_writer
from controller.host_history import HostHistoryLimits
from controller.telemetry import BodyTooLarge, decode_body, ingest
from controller.telemetry_guard import TelemetryGuard
from controller.tokens import Principal
from vigil.contract.schemas import TelemetryAck, TelemetryBatch
from vigil.contract.schemas.columnar import COLUMNAR_PATH, CONTENT_TYPE, CONTENT_TYPES
from vigil.contract.settings import Settings

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
        settings.max_body_bytes, principal, _host_history(settings), request.app.state.telemetry_guard,
    )


def _body(raw: bytes, encoding: str | None, limit: int) -> bytes:
    """The request body, gunzipped and within ``limit``: 413 when too large, 422 when not valid gzip."""
    try:
        return decode_body(raw, encoding, limit)
    except BodyTooLarge as exc:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail=str(exc)) from exc
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(exc)) from exc


def _host_history(settings: Settings) -> HostHistoryLimits:
    return HostHistoryLimits(settings.host_history_interval_s, settings.host_history_max_rows)


def _decode_and_store(
    sessions: sessionmaker[Session], raw: bytes, encoding: str | None, limit: int, principal: Principal,
    host_history: HostHistoryLimits, guard: TelemetryGuard | None = None,
) -> TelemetryAck:
    body = _body(raw, encoding, limit)
    try:
        batch = TelemetryBatch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False, include_input=False)) from exc
    check_node_scope(principal, batch.node_id)
    with sqlite_writer(sessions), session_scope(sessions) as session:
        return ingest(session, batch, host_history=host_history, guard=guard)


@router.post(
    COLUMNAR_PATH,
    response_model=TelemetryAck,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {t: {"schema": {"type": "string", "format": "binary"}}
                        for t in (CONTENT_TYPE, "application/octet-stream")},
        }
    },
)
async def post_telemetry_columnar(request: Request, settings: SettingsDep, principal: CurrentPrincipal
                                  ) -> TelemetryAck:
    """Store a columnar batch once (the agents' default: a fraction of the JSON batch's CPU cost).

    The same rules and answers as ``POST /telemetry``: a field that breaks its rule is refused
    with 422 naming it (``samples.collective.duration_s``) and nothing is stored; 413 when too
    large; 415 for another content type; 403 for another node than the agent token's own.
    """
    ctype = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if ctype not in CONTENT_TYPES:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            detail=f"Content-Type: {ctype or 'none'} (use {CONTENT_TYPE})")
    raw = await request.body()
    return await run_in_threadpool(
        _decode_and_store_columnar, request.app.state.sessions, raw, request.headers.get("content-encoding"),
        settings.max_body_bytes, principal, _host_history(settings), request.app.state.telemetry_guard,
    )


def _decode_and_store_columnar(
    sessions: sessionmaker[Session], raw: bytes, encoding: str | None, limit: int, principal: Principal,
    host_history: HostHistoryLimits, guard: TelemetryGuard | None = None,
) -> TelemetryAck:
    body = _body(raw, encoding, limit)
    try:
        batch = decode(body)
    except ValidationError as exc:  # the header: named as the JSON endpoint names the batch's fields
        raise RequestValidationError(exc.errors(include_url=False, include_context=False, include_input=False)) from exc
    except ColumnarError as exc:
        raise RequestValidationError(exc.errors()) from exc
    check_node_scope(principal, batch.header.node_id)
    with sqlite_writer(sessions), session_scope(sessions) as session:
        return ingest_columnar(session, batch, host_history=host_history, guard=guard)
