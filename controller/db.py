"""Database engine and sessions: SQLite (WAL) by default, PostgreSQL through psycopg 3."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Self

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from vigil.contract.background import BackgroundLoop

log = logging.getLogger(__name__)

WAL_AUTOCHECKPOINT_PAGES = 100_000
"""SQLite: the WAL size (pages of 4 KiB: ~400 MB) at which a committing writer checkpoints it itself.
SQLite's default (1,000 pages) made every ~4 MB of ingest pay a checkpoint and its fsync inside the
writers' queue (18% of serial ingest time, and its p99); :class:`WalCheckpointer` does it instead."""


def checkpoint_wal(sessions: sessionmaker[Session]) -> tuple[int, int] | None:
    """SQLite: copy the WAL's committed pages into the database file (``PASSIVE``: it waits for no reader
    or writer, which go on meanwhile); returns (pages in the WAL, pages checkpointed). None elsewhere."""
    engine = sessions.kw.get("bind")
    if engine is None or engine.dialect.name != "sqlite":
        return None
    with engine.connect() as conn:
        _busy, log_pages, done = conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").one()
    return int(log_pages), int(done)


class WalCheckpointer(BackgroundLoop):
    """:func:`checkpoint_wal` every ``interval_s`` in a thread of the leader (SQLite). The checkpoint runs
    in SQLite's C code without the GIL, beside the ingest's writers and the aggregation, not in their way."""

    thread_name = "vigil-wal-checkpoint"

    def __init__(self, sessions: sessionmaker[Session], interval_s: float = 1.0) -> None:
        self.sessions = sessions
        self.interval = interval_s
        super().__init__()

    def tick(self) -> bool:
        checkpoint_wal(self.sessions)
        return False


def make_engine(url: str) -> Engine:
    """An engine for ``url``. SQLite gets WAL, foreign keys and a busy timeout; its folder is created."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            # The leader's WalCheckpointer checkpoints the WAL, off the writers' path; this is only the
            # bound should it not run.
            cur.execute("PRAGMA wal_autocheckpoint=100000")  # WAL_AUTOCHECKPOINT_PAGES (a test holds them equal)
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    if parsed.drivername in ("postgresql", "postgres"):
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def take_write_lock(session: Session) -> None:
    """SQLite: make ``session``'s transaction a writer now, unless it is one already (``BEGIN IMMEDIATE``:
    it waits up to the busy timeout for the write lock). Nothing elsewhere.

    Call it before a savepoint that reads, then writes. Python's sqlite3 begins a transaction only at
    its first write, so the reads of a session that has not written run each in their own snapshot, and the
    first write waits for the lock. But a ``SAVEPOINT`` begins a *deferred* transaction at once: its reads
    share one snapshot, and if another connection commits before the savepoint's first write, SQLite
    cannot upgrade that stale snapshot and fails the write at once ("database is locked",
    SQLITE_BUSY_SNAPSHOT), without waiting. The transaction stays stale until it ends."""
    conn = session.connection()
    if conn.dialect.name != "sqlite":
        return
    if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN IMMEDIATE")


_ON_COMMIT = "vigil_on_commit"


def on_commit(session: Session, key: object, fn: Callable[[], None]) -> None:
    """Call ``fn`` once ``session``'s transaction commits (never if it rolls back); a second ``fn`` under the
    same ``key`` in the same transaction replaces the first. For what must not be seen before the write it
    tells of: waking an agent's long poll, or the monitor, for a row they would otherwise read too early."""
    session.info.setdefault(_ON_COMMIT, {})[key] = fn


@event.listens_for(Session, "after_commit")
def _run_on_commit(session: Session) -> None:
    for fn in session.info.pop(_ON_COMMIT, {}).values():
        try:
            fn()
        except Exception:  # the commit is done; a failed notification must not undo it
            log.exception("after commit")


@event.listens_for(Session, "after_rollback")
def _forget_on_rollback(session: Session) -> None:
    session.info.pop(_ON_COMMIT, None)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on any error (nothing half-written)."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


class _SqliteWriter:
    """This process's turn to write one SQLite database: a thread lock, then an exclusive ``flock`` on
    ``<database>.writer`` (other processes: ``vigil controller --workers``), released in reverse."""

    def __init__(self, database: str | None) -> None:
        self._mutex = threading.Lock()
        self._path = f"{database}.writer" if database and database != ":memory:" else None
        self._fd = -1

    def __enter__(self) -> Self:
        self._mutex.acquire()
        try:
            if self._path is not None:
                if self._fd < 0:
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._mutex.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fd >= 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()


_SQLITE_WRITERS: weakref.WeakKeyDictionary[object, _SqliteWriter] = weakref.WeakKeyDictionary()
_WRITERS_GUARD = threading.Lock()


def sqlite_writer(sessions: sessionmaker[Session]) -> AbstractContextManager[object]:
    """Hold while writing through ``sessions``: SQLite takes one writer at a time, so the writers
    (telemetry requests, the aggregation; of this process and of the other ``--workers``) queue for it
    here, and the next starts the moment the last commits, instead of each polling SQLite's lock with
    its busy handler's sleeps (up to 100 ms each: most of ingest's p99 under load). Reads need no turn
    (WAL). PostgreSQL: no queue (a null context)."""
    engine = sessions.kw.get("bind")
    if engine is None or engine.dialect.name != "sqlite":
        return nullcontext()
    with _WRITERS_GUARD:
        writer = _SQLITE_WRITERS.get(engine)
        if writer is None:
            writer = _SQLITE_WRITERS[engine] = _SqliteWriter(engine.url.database)
    return writer
