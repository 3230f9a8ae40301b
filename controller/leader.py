"""Leadership: which controller runs the background loops when several share one database.

Any number of controllers may serve the REST API on one PostgreSQL database (they hold no state of
their own beyond it), but the supervisor, the monitor and the telemetry maintainer must run in one of
them only: two monitors would open every incident twice and act on it twice. So they run under a
leader lock, a PostgreSQL *session* advisory lock (``pg_try_advisory_lock``) taken on a connection of
its own that the leader holds for as long as it leads. PostgreSQL releases a session lock when the
session ends, and a session ends when its client process dies, ``kill -9`` included (the kernel
closes the socket; PostgreSQL sees it at once), or when its host vanishes (then it takes the TCP
keepalives set on the connection, about 11 s). A standby tries the lock every ``leader_interval_s``
and takes over within one interval of that.

:class:`Leadership` is a :class:`~vigil.contract.background.BackgroundLoop`: when not leader it tries the
lock; when leader it checks that its connection still answers (``SELECT 1``: a session that broke has
lost the lock). It starts the loops on gaining leadership and stops them on losing it, logs both and
records a ``controller_leader`` (or ``controller_leader_lost``) event naming the controller.

The window to know about: a leader whose connection broke while the process lives (a network cut, the
session terminated by an operator) runs its loops until its next check, up to one interval (plus the
pass under way), while the new leader may already run its own. Actions are recorded in the database,
so a doubled pass shows as a doubled event, never as hidden state.

SQLite: one controller per database file (a second *controller* on the same file is not a supported
deployment), but that controller may run several worker processes (``vigil controller --workers N``:
ingest on more than one core), and only one of them may run the loops. SQLite has no advisory locks,
so the lock is an ``flock`` on a file next to the database (:class:`FileLock`): the kernel releases it
when its process dies, ``kill -9`` included, and another worker takes over within one interval. An
in-memory database has one process by construction: :class:`AlwaysLeader`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import URL, Connection, Engine, create_engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from controller.db import session_scope
from controller.jobs import record_event
from vigil.contract.background import BackgroundLoop

log = logging.getLogger(__name__)

LOCK_NAME = "vigil.controller.leader"
LOCK_KEY = int.from_bytes(hashlib.sha256(LOCK_NAME.encode()).digest()[:8], "big", signed=True)
"""The advisory lock's 64-bit key: derived from a fixed name, so every controller agrees on it and no
other application's small integer keys collide with it by chance."""

# Client side (libpq) and server side TCP keepalives of the lock's connection: a leader host that
# vanishes without closing its socket loses the lock in about idle + interval x count seconds, and a
# leader cut off from the database notices its dead connection as soon.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_COUNT = 5, 2, 3
_USER_TIMEOUT_MS = 10_000


def default_controller_id() -> str:
    """``host:pid``: names this controller in leadership events and logs."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaderLock(Protocol):
    """The lock a controller must hold to run the background loops."""

    def try_acquire(self) -> bool:
        """Take the lock if it is free; True when this process holds it now. May raise on a database error."""
        ...

    def held(self) -> bool:
        """Whether the lock is still held (its session alive); never raises."""
        ...

    def release(self) -> None:
        """Give the lock up (idempotent); never raises."""
        ...

    def close(self) -> None:
        """Release, and free what the lock holds (its engine); at the app's shutdown."""
        ...


class AlwaysLeader:
    """SQLite: one controller per database file, always the leader."""

    def try_acquire(self) -> bool:
        return True

    def held(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class FileLock:
    """SQLite with several worker processes: an exclusive ``flock`` on ``path`` (next to the database).

    ``flock`` locks belong to an open file description, so two locks on the same file conflict even
    within one process (two apps in a test), and the kernel drops the lock with the process.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = -1
        self._mutex = threading.Lock()  # the leadership thread and stop() (from the app's shutdown)

    def try_acquire(self) -> bool:
        with self._mutex:
            if self._fd >= 0:
                return True
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
            return True

    def held(self) -> bool:
        return self._fd >= 0

    def free(self) -> bool:
        """Whether this lock is held here or could be taken now (no other process leads)."""
        if self._fd >= 0:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)  # closing the descriptor drops the probe's lock

    def release(self) -> None:
        with self._mutex:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def close(self) -> None:
        self.release()


class AdvisoryLock:
    """A PostgreSQL session advisory lock on a connection of its own.

    The connection comes from a one-connection engine without a pool (``NullPool``), not from the app's
    pool: closing a pooled connection only returns it to the pool, and its session, lock included, would
    live on. Here closing the connection ends the session and so frees the lock. It runs in autocommit,
    so it never sits idle in a transaction while it holds the lock.
    """

    def __init__(self, url: str | URL, key: int = LOCK_KEY, connect_timeout_s: int = 5) -> None:
        self.key = key
        self._engine = create_engine(url, poolclass=NullPool, connect_args={
            "connect_timeout": connect_timeout_s, "keepalives": 1, "keepalives_idle": _KEEPALIVE_IDLE_S,
            "keepalives_interval": _KEEPALIVE_INTERVAL_S, "keepalives_count": _KEEPALIVE_COUNT,
            "tcp_user_timeout": _USER_TIMEOUT_MS,
        })
        self._conn: Connection | None = None
        self._held = False
        self._mutex = threading.Lock()  # the leadership thread and stop() (from the app's shutdown)

    def _connection(self) -> Connection:
        if self._conn is None:
            conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                # The server's side of the keepalives (per session; ignored on a unix socket).
                for name, value in (("tcp_keepalives_idle", _KEEPALIVE_IDLE_S),
                                    ("tcp_keepalives_interval", _KEEPALIVE_INTERVAL_S),
                                    ("tcp_keepalives_count", _KEEPALIVE_COUNT),
                                    ("tcp_user_timeout", _USER_TIMEOUT_MS)):
                    conn.execute(text("SELECT set_config(:name, :value, false)"), {"name": name, "value": str(int(value))})
            except SQLAlchemyError:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def try_acquire(self) -> bool:
        with self._mutex:
            if self._held:
                return True
            try:
                got = self._connection().execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.key}).scalar()
            except SQLAlchemyError:
                self._drop()
                raise
            self._held = bool(got)
            # Not got: the connection is kept for the next try (no reconnect every interval).
            return self._held

    def held(self) -> bool:
        with self._mutex:
            if not self._held or self._conn is None:
                return False
            try:
                self._conn.execute(text("SELECT 1"))
                return True
            except SQLAlchemyError as exc:
                log.warning("leader lock: its database session is gone (%s)", type(exc).__name__)
                self._drop()
                return False

    def release(self) -> None:
        with self._mutex:
            if self._held and self._conn is not None:
                try:
                    self._conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self.key})
                except SQLAlchemyError:
                    pass  # the session is gone: so is its lock
            self._drop()

    def close(self) -> None:
        self.release()
        self._engine.dispose()

    def _drop(self) -> None:
        """Close the connection (ending the session frees the lock) and forget it."""
        conn, self._conn, self._held = self._conn, None, False
        if conn is not None:
            try:
                conn.invalidate()  # a broken session is not worth a polite goodbye
                conn.close()
            except SQLAlchemyError:
                pass


def shared_database(engine: Engine) -> bool:
    """Whether another process can open the app's database: PostgreSQL or a SQLite file (not an
    in-memory SQLite database, which lives in this process alone)."""
    if engine.dialect.name == "postgresql":
        return True
    db = engine.url.database
    return bool(db) and db != ":memory:" and not db.startswith("file:")


def leader_lock(engine: Engine) -> AdvisoryLock | FileLock | AlwaysLeader:
    """The lock for the app's database: an advisory lock on PostgreSQL, a :class:`FileLock` next to a
    SQLite file (``vigil.db.leader``), :class:`AlwaysLeader` for an in-memory SQLite database."""
    if engine.dialect.name == "postgresql":
        return AdvisoryLock(engine.url)
    if shared_database(engine):
        return FileLock(f"{engine.url.database}.leader")
    return AlwaysLeader()


class Leadership(BackgroundLoop):
    """Holds (or waits for) the leader lock and runs ``loops`` only while it is held (module docstring).

    ``start()`` makes a first attempt at once, in the caller's thread, so a controller alone on its
    database leads as soon as its app has started; the later attempts and checks run in the thread.
    ``stop()`` stops the loops and gives the lock up, so a standby takes over within one interval.
    """

    thread_name = "vigil-leader"

    def __init__(
        self,
        lock: LeaderLock,
        loops: Sequence[BackgroundLoop],
        sessions: sessionmaker[Session],
        *,
        controller_id: str,
        interval: float = 1.0,
    ) -> None:
        self.lock = lock
        self.loops = list(loops)
        self.sessions = sessions
        self.controller_id = controller_id
        self.interval = interval
        self.leader_since: float | None = None
        """Unix time this controller became the leader; None while it is not."""
        self._failing = False  # the database refused the last attempt (logged once per outage)
        super().__init__()

    @property
    def is_leader(self) -> bool:
        """Leading now. On SQLite also before ``start()`` when no other process holds the lock (tests
        drive the loops by hand there)."""
        if self.leader_since is not None or isinstance(self.lock, AlwaysLeader):
            return True
        return isinstance(self.lock, FileLock) and not self.running and self.lock.free()

    # -- one pass ------------------------------------------------------------------------------------
    def tick(self) -> None:
        if self.leader_since is not None:
            if not self.lock.held():
                self._lose("its database session ended")
            return
        try:
            got = self.lock.try_acquire()
        except (SQLAlchemyError, OSError) as exc:
            if not self._failing:
                log.warning("controller %s: cannot try the leader lock (%s); trying again every %.1fs",
                            self.controller_id, exc, self.interval)
            self._failing = True
            return
        self._failing = False
        if got:
            self._gain()

    def _gain(self) -> None:
        # The loops first: /healthz says leader only once they run.
        for loop in self.loops:
            loop.start()
        self.leader_since = time.time()
        # Worth a warning where there is a choice (PostgreSQL); alone on SQLite it is just the start.
        log.log(logging.INFO if isinstance(self.lock, AlwaysLeader | FileLock) else logging.WARNING,
                "controller %s is the leader: supervisor, monitor and telemetry maintainer run here",
                self.controller_id)
        self._record("controller_leader", f"controller {self.controller_id} is the leader")

    def _lose(self, why: str) -> None:
        self.leader_since = None
        for loop in self.loops:
            loop.stop()
        self.lock.release()
        log.error("controller %s lost the leadership (%s): its background loops stopped; it tries to take "
                  "the lock again every %.1fs", self.controller_id, why, self.interval)
        self._record("controller_leader_lost", f"controller {self.controller_id} lost the leadership: {why}")

    def _record(self, kind: str, message: str) -> None:
        try:
            with session_scope(self.sessions) as s:
                record_event(s, kind, message, data={"controller_id": self.controller_id})
        except SQLAlchemyError as exc:  # the log line above says it; the database may be what failed
            log.warning("could not record %s: %s", kind, exc)

    # -- life cycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self.running:
            return
        try:
            self.tick()
        except Exception:  # the thread tries again; a failed first attempt must not fail the app's start
            log.exception("controller %s: first leadership attempt failed", self.controller_id)
        super().start()

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        was_leader = self.leader_since is not None
        self.leader_since = None
        for loop in self.loops:
            loop.stop()
        self.lock.release()
        if was_leader:
            log.info("controller %s stopped leading", self.controller_id)
