"""Telemetry ingest and reads: idempotent on (agent_id, seq), rows written in bulk, all or nothing."""

from __future__ import annotations

import gzip
import logging
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controller.host_history import HostHistoryLimits
from controller.host_history import record as record_host_sample
from controller.jobs import record_event
from controller.models import (
    Fault,
    Job,
    Node,
    RankProgress,
    TelemetryBatchSeen,
)
from controller.recovery import adapt
from controller.telemetry_guard import TelemetryGuard
from vigil.contract.schemas import (
    LIVE_OPS,
    CheckpointSample,
    CollectiveSample,
    FaultSample,
    NodeState,
    ProgressSample,
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


STEP_NOT_STORED = frozenset({"kind", "world_size", "pid"})
"""Fields of a :class:`StepSample` the controller does not keep (the kind is the table; world size and pid are
the rank's own business)."""
#: The step record's columns: the fields of :class:`StepSample` (declared there once, in its order) that
#: ``step_metrics`` stores. The JSON path's getter, the columnar rows and the bulk insert all use this tuple;
#: the table holds exactly these plus ``id`` and the batch's ``node_id`` (tests/controller/test_columnar.py).
STEP_COLUMNS = tuple(f for f in StepSample.model_fields if f not in STEP_NOT_STORED)
#: Columns of the collective table, in the order the bulk writers send them (``node_id`` last: it is the
#: batch's, not the sample's). ``group`` is quoted: it is an SQL keyword.
COLLECTIVE_COLUMNS = (
    "job_id", "rank", "step", "attempt", "seq", "op", "group", "tag", "payload_bytes", "wire_bytes", "elements",
    "duration_s", "ts",
)
_OP = COLLECTIVE_COLUMNS.index("op")
_step_values = attrgetter(*STEP_COLUMNS)
_collective_values = attrgetter(*COLLECTIVE_COLUMNS)
_step_key = attrgetter("job_id", "step")


SQLITE_ROWS_PER_INSERT = 256
"""Rows per multi-row INSERT statement on SQLite (fewer where its variable limit says so)."""


def bulk_insert(session: Session, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> int:
    """Add ``rows`` (tuples in ``columns`` order) to ``table`` inside the session's transaction, skipping
    any row whose unique key is already there (a sample replayed under any batch number, or twice in
    one batch). Returns how many rows were added.

    The hot path of ingest, so it skips SQLAlchemy's per-row parameter processing: PostgreSQL gets
    ``COPY ... FROM STDIN`` (psycopg 3 encodes rows in C) into a session-local staging table, then
    one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``; SQLite multi-row ``INSERT ... VALUES (...),
    (...) ... ON CONFLICT DO NOTHING`` statements. No other backend is supported.
    """
    if not rows:
        return 0
    conn = session.connection()
    quoted = ", ".join(f'"{c}"' for c in columns)
    dialect = conn.dialect.name
    if dialect == "postgresql":
        stage = f"vigil_stage_{table}"
        driver = conn.connection.driver_connection
        with driver.cursor() as cur:
            # Created once per connection (temporary tables live as long as it), emptied at commit.
            cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
                        f"SELECT {quoted} FROM {table} WITH NO DATA")
            with cur.copy(f"COPY {stage} ({quoted}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            cur.execute(f"INSERT INTO {table} ({quoted}) SELECT {quoted} FROM {stage} ON CONFLICT DO NOTHING")
            added = cur.rowcount
            cur.execute(f"DELETE FROM {stage}")  # a second batch in the same transaction starts empty
        return added
    if dialect == "sqlite":
        # Multi-row VALUES, SQLITE_ROWS_PER_INSERT rows a statement: the sqlite3 module binds and steps
        # each statement in C and gives the GIL up once per statement, not once per row as executemany
        # does (1.5x the rows per second alone, more beside other threads: docs/BENCHMARKS.md).
        driver = conn.connection.driver_connection
        per = max(1, min(SQLITE_ROWS_PER_INSERT, driver.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(columns)))
        row_marks = "(" + ", ".join("?" * len(columns)) + ")"
        before = driver.total_changes
        for i in range(0, len(rows), per):
            chunk = rows[i:i + per]
            driver.execute(f"INSERT INTO {table} ({quoted}) VALUES {', '.join([row_marks] * len(chunk))} "
                           "ON CONFLICT DO NOTHING", list(chain.from_iterable(chunk)))
        return driver.total_changes - before
    raise NotImplementedError(f"telemetry ingest supports SQLite and PostgreSQL, not {dialect}")  # pragma: no cover


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


@dataclass
class Prepared:
    """One batch's samples of known jobs, ready to store: raw rows in the bulk writers' column order
    (``node_id`` last), the (job, step) pairs they touch, per job the step sample its progress is read
    from (:func:`newest_step_lowest_rank`), and the rare kinds that take their own code."""

    steps: list[tuple[Any, ...]]
    collectives: list[tuple[Any, ...]]
    touched: set[tuple[str, int]]
    progress: list[StepSample]
    checkpoints: list[CheckpointSample] = field(default_factory=list)
    faults: list[FaultSample] = field(default_factory=list)
    states: list[ProgressSample] = field(default_factory=list)
    """Where stalled ranks stand in their collectives (rare: only while steps stall)."""
    orphans: int = 0
    live: list[tuple[Any, ...]] = field(default_factory=list)
    """The collective rows of live recovery (:data:`LIVE_OPS`), which are also job events: rare, and found
    without a Python pass over every row where the wire format allows (columnar: its string dictionary)."""


_BATCHES, _JOBS, _NODES = TelemetryBatchSeen.__table__, Job.__table__, Node.__table__
_SEEN = select(_BATCHES.c.id).where(_BATCHES.c.agent_id == bindparam("agent_id"), _BATCHES.c.seq == bindparam("seq"))
_KNOWN = select(_JOBS.c.id).where(_JOBS.c.id.in_(bindparam("ids", expanding=True)))
_ADD_BATCH = insert(_BATCHES).values(samples=0).returning(_BATCHES.c.id)
_COUNT_BATCH = update(_BATCHES).where(_BATCHES.c.id == bindparam("row")).values(samples=bindparam("stored"))
_NODE_AGENT = select(_NODES.c.agent_id).where(_NODES.c.id == bindparam("node"))


def store(session: Session, header: TelemetryBatch, job_ids: set[str], prepare: Callable[[set[str]], Prepared],
          now: float | None = None, host_history: HostHistoryLimits | None = None,
          guard: TelemetryGuard | None = None) -> TelemetryAck:
    """Store one batch once; the core both wire formats share (:func:`ingest`, and
    :func:`controller.columnar.ingest_columnar`).

    ``header`` gives the agent, the batch number, the node and the heartbeat; ``job_ids`` every job
    its samples name; ``prepare(known)`` builds the rows of the samples whose job is in ``known``
    (samples of unknown jobs are dropped and counted). A batch already seen (agent, seq) is a
    duplicate. The batch's own row is written first (a concurrent replay fails there, before any
    bulk work), then each sample once by its unique key (job, rank, step, attempt[, seq]) whatever
    batch carried it before; then the dirty (job, step) marks, job progress, checkpoints, faults, the
    node and its heartbeat - all in the caller's transaction: the aggregates are derived later from
    what was committed (:mod:`controller.aggregation`), so a controller killed at any point loses
    nothing and counts nothing twice. A heartbeat also adds a row to its node's bounded host history
    (:mod:`controller.host_history`, ``host_history``: its bounds, default :class:`HostHistoryLimits`).
    With a ``guard``, samples of a job that never ran on the sending node, and checkpoints outside the
    job's storage, are refused and counted (:mod:`controller.telemetry_guard`).
    """
    conn = session.connection()  # Core statements built once (below): this runs for every batch
    if conn.execute(_SEEN, {"agent_id": header.agent_id, "seq": header.seq}).first() is not None:
        return TelemetryAck(accepted=True, duplicate=True, stored=0)
    known = set(conn.execute(_KNOWN, {"ids": list(job_ids)}).scalars()) if job_ids else set()
    allowed = known if guard is None else {j for j in known if guard.node_allowed(session, j, header.node_id)}
    rows = prepare(allowed)
    if guard is not None:
        rows = _guarded(session, guard, header.node_id, known - allowed, rows, prepare, allowed)
    if rows.orphans:
        log.warning("batch %s/%s: %d samples for unknown jobs dropped", header.agent_id, header.seq, rows.orphans)
    try:
        seen_row = conn.execute(_ADD_BATCH, {"agent_id": header.agent_id, "seq": header.seq}).scalar_one()
    except IntegrityError:
        session.rollback()  # the same batch raced in through another request: stored once by that one
        return TelemetryAck(accepted=True, duplicate=True, stored=0)
    stored = bulk_insert(session, "step_metrics", (*STEP_COLUMNS, "node_id"), rows.steps)
    stored += bulk_insert(session, "collective_metrics", (*COLLECTIVE_COLUMNS, "node_id"), rows.collectives)
    stored += len(rows.checkpoints) + len(rows.faults) + len(rows.states)
    if stored:
        conn.execute(_COUNT_BATCH, {"row": seen_row, "stored": stored})
    mark_dirty(session, rows.touched, time.time() if now is None else now)
    if rows.progress:
        update_job_progress(session, rows.progress)
    if rows.checkpoints:
        from controller.recovery.checkpoints import record_checkpoints

        record_checkpoints(session, rows.checkpoints)
    if rows.faults:
        record_fault_hits(session, rows.faults)
    if rows.states:
        record_rank_progress(session, rows.states)
    if rows.live:
        record_live_events(session, rows.live, header.node_id)
    touch_node(session, header)
    if header.heartbeat is not None:
        record_host_sample(session, header.node_id, header.heartbeat.ts, header.heartbeat.host,
                           host_history or HostHistoryLimits())
    session.flush()
    return TelemetryAck(accepted=True, duplicate=False, stored=stored)


def _guarded(session: Session, guard: TelemetryGuard, node_id: str, refused_jobs: set[str], rows: Prepared,
             prepare: Callable[[set[str]], Prepared], allowed: set[str]) -> Prepared:
    """``rows`` without checkpoints outside their job's storage; refusals counted (rare: a second ``prepare``
    per refused job only to count its samples)."""
    for job in sorted(refused_jobs):
        n = rows.orphans - prepare(allowed | {job}).orphans
        guard.refused(session, job, node_id, "node", n, f"node {node_id} runs none of job {job}'s processes")
    outside = [c for c in rows.checkpoints if not guard.checkpoint_allowed(c.job_id, c.path)]
    for c in outside:
        guard.refused(session, c.job_id, node_id, "checkpoint_path", 1,
                      f"checkpoint {c.path!r} is outside job {c.job_id}'s storage")
    if outside:
        rows.checkpoints = [c for c in rows.checkpoints if c not in outside]
    return rows


def ingest(session: Session, batch: TelemetryBatch, now: float | None = None,
           host_history: HostHistoryLimits | None = None, guard: TelemetryGuard | None = None) -> TelemetryAck:
    """Store a JSON-decoded ``batch`` once (:func:`store`: the rules)."""

    def prepare(known: set[str]) -> Prepared:
        samples = batch.samples
        if len(known) < len(job_ids):
            samples = [s for s in samples if s.job_id in known]
        node = (batch.node_id,)
        # Comprehensions and C-level getters: this runs for every sample ingested.
        step_samples: list[StepSample] = [s for s in samples if s.kind == "step"]  # type: ignore[misc]
        newest = newest_step_lowest_rank(np.array([s.job_id for s in step_samples]),
                                         np.fromiter((s.step for s in step_samples), np.int64, len(step_samples)),
                                         np.fromiter((s.rank for s in step_samples), np.int64, len(step_samples)))
        collectives = [_collective_values(s) + node for s in samples if s.kind == "collective"]
        return Prepared(
            steps=[_step_values(s) + node for s in step_samples],
            collectives=collectives,
            live=[r for r in collectives if r[_OP] in LIVE_OPS],
            touched=set(map(_step_key, (s for s in samples if s.kind in ("step", "collective")))),
            progress=[step_samples[i] for i in newest],
            checkpoints=[s for s in samples if s.kind == "checkpoint"],  # type: ignore[misc]
            faults=[s for s in samples if s.kind == "fault"],  # type: ignore[misc]
            states=[s for s in samples if s.kind == "progress"],  # type: ignore[misc]
            orphans=len(batch.samples) - len(samples),
        )

    job_ids = {s.job_id for s in batch.samples}
    return store(session, batch, job_ids, prepare, now, host_history, guard)


def newest_step_lowest_rank(job: np.ndarray, step: np.ndarray, rank: np.ndarray) -> list[int]:
    """Per job, the index of its row with the newest step and, among that step's rows, the lowest rank:
    the sample ``jobs.last_step`` and ``jobs.last_loss`` are read from (chosen here and nowhere else; both
    wire formats call it, the columnar one on its columns, the JSON one on arrays of its samples)."""
    if len(job) == 0:
        return []
    order = np.lexsort((rank, -step.astype(np.int64), job))  # by job, then step descending, then rank ascending
    return order[np.r_[True, job[order][1:] != job[order][:-1]]].tolist()


def update_job_progress(session: Session, samples: list[StepSample]) -> None:
    """Move each job's ``last_step`` / ``last_loss`` forward to its sample in ``samples`` (one per job, from
    :func:`newest_step_lowest_rank`); a sample of an older step than the stored one changes nothing."""
    for s in samples:
        # One prepared UPDATE, no ORM load or statement compilation: this runs for every batch.
        conn = session.connection()
        m = "?" if conn.dialect.name == "sqlite" else "%s"
        conn.exec_driver_sql(
            f"UPDATE jobs SET last_step = {m}, last_loss = {m} WHERE id = {m} AND (last_step IS NULL OR last_step <= {m})",
            (s.step, s.loss, s.job_id, s.step),
        )


def record_rank_progress(session: Session, samples: list[ProgressSample]) -> None:
    """Keep each rank's newest progress report (newer attempt, then newer time, wins; a replay changes nothing)."""
    newest: dict[tuple[str, int], ProgressSample] = {}
    for p in samples:
        cur = newest.get((p.job_id, p.rank))
        if cur is None or (p.attempt, p.ts) > (cur.attempt, cur.ts):
            newest[(p.job_id, p.rank)] = p
    for (job_id, rank), p in newest.items():
        row = session.get(RankProgress, (job_id, rank))
        if row is not None and (row.attempt, row.ts) >= (p.attempt, p.ts):
            continue
        state = p.model_dump(mode="json", include={"groups", "in_flight", "last_done"})
        if row is None:
            session.add(RankProgress(job_id=job_id, rank=rank, attempt=p.attempt, ts=p.ts, step=p.step,
                                     idle_s=p.idle_s, state=state))
        else:
            row.attempt, row.ts, row.step, row.idle_s, row.state = p.attempt, p.ts, p.step, p.idle_s, state


def record_fault_hits(session: Session, samples: list[FaultSample]) -> None:
    """The step each in-rank fault really hit, from the rank's report (the first report wins); a report of
    kind ``adapt`` is a switch to a version of the job's setting (:func:`controller.recovery.adapt.record_switch`)."""
    for s in samples:
        if s.fault_kind == adapt.ADAPT_KIND:
            adapt.record_switch(session, s)
            continue
        session.execute(update(Fault).where(Fault.id == s.fault_id, Fault.job_id == s.job_id, Fault.hit_step.is_(None))
                        .values(hit_step=s.step))


def touch_node(session: Session, batch: TelemetryBatch) -> None:
    if batch.heartbeat is None and session.connection().execute(_NODE_AGENT, {"node": batch.node_id}).scalar() == batch.agent_id:
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


def record_live_events(session: Session, live: Sequence[tuple[Any, ...]], node_id: str) -> None:
    """An event for each live-recovery collective row (:data:`LIVE_OPS`: ``Prepared.live``), so a heal and
    a quorum change show on the job's events with their durations."""
    col = dict(zip(COLLECTIVE_COLUMNS, range(len(COLLECTIVE_COLUMNS)), strict=True))
    for r in live:
        op = r[_OP]
        rank, step, seconds = r[col["rank"]], r[col["step"]], float(r[col["duration_s"]])
        if op == "heal":
            message = (f"rank {rank} healed from a live peer in {seconds:.2f} s "
                       f"({r[col['payload_bytes']] / 1e6:.1f} MB of state); it runs step {step} with the others")
        else:
            message = (f"rank {rank}: a collective of step {step} failed (a peer left); {seconds:.2f} s from its "
                       "start to a new quorum without that peer, the step run again")
        record_event(session, f"live_{op}", message, job_id=r[col["job_id"]], node_id=node_id,
                     data={"rank": rank, "step": step, "seconds": round(seconds, 3), "attempt": r[col["attempt"]]})


__all__ = ["BodyTooLarge", "CollectiveSample", "Prepared", "decode_body", "ingest", "store"]
