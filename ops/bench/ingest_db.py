"""The databases of the ingest benchmark (:mod:`ops.bench.ingest`): a fresh SQLite file or PostgreSQL
database per run, its tokens, its size, its dirty steps, and the database's own bulk-insert rate for the
same rows (``db_bound_samples_per_s``)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ops.bench.ingest_load import _STRINGS, batch_columns, plan_batches

PG_ADMIN_URL = os.environ.get("VIGIL_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def _database(backend: str, home: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{home / 'vigil.db'}"
        return
    import psycopg

    name = f"vigil_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _db_bytes(url: str) -> int:
    from sqlalchemy import text

    from controller.db import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                pages = conn.exec_driver_sql("PRAGMA page_count").scalar() or 0
                free = conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0
                size = conn.exec_driver_sql("PRAGMA page_size").scalar() or 0
                return int((pages - free) * size)
            return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar() or 0)
    finally:
        engine.dispose()


def _tokens(url: str) -> tuple[str, str]:
    """(admin, agent) tokens issued straight in the database, as ``vigil up`` does."""
    from controller import migrate
    from controller.db import make_engine, make_session_factory, session_scope
    from controller.tokens import create_token
    from vigil.contract.schemas import Role, TokenCreate

    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        sessions = make_session_factory(engine)
        with session_scope(sessions) as s:
            admin = create_token(s, TokenCreate(role=Role.ADMIN, name="bench")).token
            agent = create_token(s, TokenCreate(role=Role.AGENT, name="bench agents")).token
        return admin, agent
    finally:
        engine.dispose()


def _dirty_steps(url: str) -> int:
    from sqlalchemy import func, select

    from controller.db import make_engine
    from controller.models import TelemetryDirtyStep

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(TelemetryDirtyStep)).scalar() or 0)
    finally:
        engine.dispose()


def _mark_running(url: str, job_id: str) -> None:
    """The job as if Ray ran it: the monitor then runs its detectors on it during the flood."""
    from sqlalchemy import update

    from controller.db import make_engine
    from controller.models import Job

    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(update(Job).where(Job.id == job_id).values(status="running"))
    finally:
        engine.dispose()


def _aggregate_all(url: str) -> float:
    """Seconds to aggregate every dirty step now, in this process (one thread, as the controller does)."""
    from controller.aggregation import TelemetryMaintainer
    from controller.db import make_engine, make_session_factory

    engine = make_engine(url)
    try:
        t = time.perf_counter()
        TelemetryMaintainer(make_session_factory(engine), retention_s=1e9, settle_s=0.0).flush()
        return time.perf_counter() - t
    finally:
        engine.dispose()


def db_bound(backend: str, home: Path, *, ranks: int, collectives: int, samples: int, agents: int, batch: int
             ) -> float:
    """Samples per second the database itself takes for the same rows: :func:`controller.telemetry.bulk_insert`
    straight into a fresh database of ``backend``, one transaction per batch, no HTTP, no decoding."""
    from controller import migrate
    from controller.db import make_engine, make_session_factory
    from controller.models import Job
    from controller.telemetry import COLLECTIVE_COLUMNS, STEP_COLUMNS, bulk_insert

    bound_home = home / "db-bound"
    bound_home.mkdir(parents=True, exist_ok=True)
    with _database(backend, bound_home) as url:
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            sessions = make_session_factory(engine)
            job_id = "bench-bound"
            with sessions() as s:
                s.add(Job(id=job_id, name="bench-bound", status="running", spec={}))
                s.commit()
            t0 = time.time()
            stored, spent = 0, 0.0
            for b in plan_batches(ranks, collectives, samples, agents, batch):
                step, coll = batch_columns(b, ranks, collectives, t0)
                node = f"bench-node-{b.agent}"
                rows = []
                for cols, names in ((step, STEP_COLUMNS), (coll, COLLECTIVE_COLUMNS)):
                    n = len(cols["rank"])
                    lists = [[job_id] * n if c == "job_id" else
                             [_STRINGS[i] for i in cols[c].tolist()] if c in ("op", "group", "tag") else
                             cols[c].tolist() if c in cols else [None if c not in ("attempt", "dropped") else 0] * n
                             for c in names]
                    rows.append(list(zip(*lists, [node] * n, strict=True)))
                t = time.perf_counter()
                with sessions() as s:
                    stored += bulk_insert(s, "step_metrics", (*STEP_COLUMNS, "node_id"), rows[0])
                    stored += bulk_insert(s, "collective_metrics", (*COLLECTIVE_COLUMNS, "node_id"), rows[1])
                    s.commit()
                spent += time.perf_counter() - t
            return stored / max(spent, 1e-9)
        finally:
            engine.dispose()
