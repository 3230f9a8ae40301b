"""Telemetry ingest and reads: idempotent on (agent_id, seq), rows written in bulk, all or nothing."""

from __future__ import annotations

import gzip
import logging
import time
import zlib
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controller.host_history import HostHistoryLimits
from controller.host_history import record as record_host_sample
from controller.models import (
    Base,
    Job,
    Node,
    TelemetryBatchSeen,
)
from controller.schemas import (
    CheckpointSample,
    CollectiveSample,
    NodeState,
    StepSample,
    TelemetryAck,
    TelemetryBatch,
)

log = logging.getLogger(__name__)


class BodyTooLarge(ValueError):
    pass


def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The request body, gunzipped when ``encoding`` says so, refusing anything over ``limit`` bytes."""
    if len(body) > limit:
        raise BodyTooLarge(f"body: {len(body)} bytes exceeds the limit of {limit} bytes")
    enc = (encoding or "identity").lower()
    if enc == "identity":
        return body
    if enc != "gzip":
        raise ValueError(f"Content-Encoding: {encoding!r} is not supported (use gzip or none)")
    try:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out = d.decompress(body, limit + 1)
    except (zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"body: not valid gzip ({exc})") from exc
    if len(out) > limit or d.unconsumed_tail:
        raise BodyTooLarge(f"body: decompressed size exceeds the limit of {limit} bytes")
    return out


#: Columns of the raw tables, in the order the bulk writers send them (``node_id`` last: it is the
#: batch's, not the sample's). ``group`` is quoted: it is an SQL keyword.
STEP_COLUMNS = (
    "job_id", "rank", "step", "ts", "loss", "lr", "tokens", "step_time_s", "tokens_per_s", "data_s",
    "fwd_bwd_s", "optim_s", "comm_s", "comm_wait_s", "val_loss", "dropped",
)
COLLECTIVE_COLUMNS = (
    "job_id", "rank", "step", "seq", "op", "group", "tag", "payload_bytes", "wire_bytes", "elements",
    "duration_s", "ts",
)
_step_values = attrgetter(*STEP_COLUMNS)
_collective_values = attrgetter(*COLLECTIVE_COLUMNS)
_step_key = attrgetter("job_id", "step")


def bulk_insert(session: Session, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """Append ``rows`` (tuples in ``columns`` order) to ``table`` inside the session's transaction.

    The hot path of ingest, so it skips SQLAlchemy's per-row parameter processing: PostgreSQL gets
    ``COPY ... FROM STDIN`` (psycopg 3 encodes rows in C), SQLite one ``executemany`` of a prepared
    INSERT. Any other backend goes through Core's ``insert()``.
    """
    if not rows:
        return
    conn = session.connection()
    quoted = ", ".join(f'"{c}"' for c in columns)
    dialect = conn.dialect.name
    if dialect == "postgresql":
        driver = conn.connection.driver_connection
        with driver.cursor() as cur, cur.copy(f"COPY {table} ({quoted}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    elif dialect == "sqlite":
        marks = ", ".join("?" * len(columns))
        conn.exec_driver_sql(f"INSERT INTO {table} ({quoted}) VALUES ({marks})", rows)
    else:  # pragma: no cover - only SQLite and PostgreSQL are supported backends
        tbl = Base.metadata.tables[table]
        session.execute(insert(tbl), [dict(zip(columns, r)) for r in rows])


def mark_dirty(session: Session, steps: Iterable[tuple[str, int]], now: float) -> None:
    """Flag (job, step) pairs for (re)aggregation: insert, or bump ``version`` and ``touched_at``.

    Sorted, so concurrent ingests lock the rows in the same order (no deadlock on PostgreSQL). One
    prepared upsert (SQLite >= 3.24 and PostgreSQL share the syntax), executed for all pairs.
    """
    rows = [(j, s, now) for j, s in sorted(set(steps))]
    if not rows:
        return
    conn = session.connection()
    mark = "?" if conn.dialect.name == "sqlite" else "%s"
    conn.exec_driver_sql(
        "INSERT INTO telemetry_dirty_steps (job_id, step, version, touched_at) "
        f"VALUES ({mark}, {mark}, 1, {mark}) ON CONFLICT (job_id, step) DO UPDATE SET "
        "version = telemetry_dirty_steps.version + 1, touched_at = excluded.touched_at",
        rows,
    )


def ingest(session: Session, batch: TelemetryBatch, now: float | None = None,
           host_history: HostHistoryLimits | None = None) -> TelemetryAck:
    """Store ``batch`` once. A batch already seen (same agent and seq) is acknowledged and ignored.

    The raw rows are appended in bulk and every (job, step) they touch is marked dirty, all in the
    caller's transaction: the aggregates are derived later from what was committed (see
    :mod:`controller.aggregation`), so a controller killed at any point loses nothing and counts
    nothing twice. A heartbeat also adds a row to its node's bounded host history
    (:mod:`controller.host_history`, ``host_history``: its bounds, default :class:`HostHistoryLimits`).
    """
    seen = session.scalar(
        select(TelemetryBatchSeen.id).where(
            TelemetryBatchSeen.agent_id == batch.agent_id, TelemetryBatchSeen.seq == batch.seq
        )
    )
    if seen is not None:
        return TelemetryAck(accepted=True, duplicate=True, stored=0)

    job_ids = {s.job_id for s in batch.samples}
    known = set(session.scalars(select(Job.id).where(Job.id.in_(job_ids))).all()) if job_ids else set()
    node = (batch.node_id,)
    samples = batch.samples
    if len(known) < len(job_ids):
        samples = [s for s in samples if s.job_id in known]
    checkpoints: list[CheckpointSample] = [s for s in samples if s.kind == "checkpoint"]  # type: ignore[misc]
    if checkpoints:
        samples = [s for s in samples if s.kind != "checkpoint"]
    # Comprehensions and C-level getters: this loop runs for every sample ingested.
    step_samples: list[StepSample] = [s for s in samples if s.kind == "step"]  # type: ignore[misc]
    steps = [_step_values(s) + node for s in step_samples]
    colls = [_collective_values(s) + node for s in samples if s.kind == "collective"]
    touched = set(map(_step_key, samples))
    stored = len(steps) + len(colls) + len(checkpoints)
    orphans = len(batch.samples) - stored
    if orphans:
        log.warning("batch %s/%s: %d samples for unknown jobs dropped", batch.agent_id, batch.seq, orphans)

    # The batch's own row first: a concurrent replay of it fails here, before any bulk work.
    try:
        session.execute(insert(TelemetryBatchSeen).values(agent_id=batch.agent_id, seq=batch.seq, samples=stored))
    except IntegrityError:
        # The same batch raced in through another request: it is stored once by that one.
        session.rollback()
        return TelemetryAck(accepted=True, duplicate=True, stored=0)
    bulk_insert(session, "step_metrics", (*STEP_COLUMNS, "node_id"), steps)
    bulk_insert(session, "collective_metrics", (*COLLECTIVE_COLUMNS, "node_id"), colls)
    mark_dirty(session, touched, time.time() if now is None else now)
    if step_samples:
        _update_job_progress(session, step_samples)
    if checkpoints:
        from controller.recovery.checkpoints import record_checkpoints

        record_checkpoints(session, checkpoints)
    _touch_node(session, batch)
    if batch.heartbeat is not None:
        record_host_sample(session, batch.node_id, batch.heartbeat.ts, batch.heartbeat.host,
                           host_history or HostHistoryLimits())
    session.flush()
    return TelemetryAck(accepted=True, duplicate=False, stored=stored)


def _update_job_progress(session: Session, samples: list[StepSample]) -> None:
    latest: dict[str, StepSample] = {}
    for s in samples:
        cur = latest.get(s.job_id)
        if cur is None or (s.step, -s.rank) > (cur.step, -cur.rank):
            latest[s.job_id] = s
    for job_id, s in latest.items():
        # One prepared UPDATE, no ORM load or statement compilation: this runs for every batch.
        conn = session.connection()
        m = "?" if conn.dialect.name == "sqlite" else "%s"
        conn.exec_driver_sql(
            f"UPDATE jobs SET last_step = {m}, last_loss = {m} WHERE id = {m} AND (last_step IS NULL OR last_step <= {m})",
            (s.step, s.loss, job_id, s.step),
        )


def _touch_node(session: Session, batch: TelemetryBatch) -> None:
    if batch.heartbeat is None and session.scalar(select(Node.agent_id).where(Node.id == batch.node_id)) == batch.agent_id:
        return  # a known node, the same agent, no heartbeat: nothing to change (the common batch)
    node = session.get(Node, batch.node_id)
    if node is None:
        node = Node(id=batch.node_id, state=NodeState.ALIVE.value, ranks=[], host={}, dropped_samples=0)
        session.add(node)
    node.agent_id = batch.agent_id
    hb = batch.heartbeat
    if hb is not None:
        # When the controller heard from the agent, not when the agent wrote the heartbeat: a
        # replayed (spooled) heartbeat still proves the agent is alive now.
        node.last_heartbeat = datetime.fromtimestamp(max(hb.ts, time.time()), UTC)
        node.hostname = hb.hostname or node.hostname
        node.address = hb.address or node.address
        node.ranks = [r.model_dump() for r in hb.ranks]
        node.host = hb.host
        node.dropped_samples = hb.dropped_samples
        if node.state == NodeState.DEAD.value:
            node.state = NodeState.ALIVE.value


__all__ = ["BodyTooLarge", "CollectiveSample", "decode_body", "ingest"]
