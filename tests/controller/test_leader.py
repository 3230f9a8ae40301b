"""Leadership (controller/leader.py): one controller of those sharing a PostgreSQL database runs the
supervisor, the monitor and the aggregation; another takes over when it dies. On SQLite a file lock next
to the database lets one of several worker processes (``vigil controller --workers N``) lead.

The loop's logic is driven one pass at a time with a fake lock; the lock itself and the takeover run on
a REAL PostgreSQL database (fixture ``postgres_url``: a fresh database on 127.0.0.1:5432, skipped when
there is no server): sessions ended by ``pg_terminate_backend``, a process holding the lock killed with
``kill -9``, and two real controller apps (``create_app`` with its background loops) on one database.

Needs: PostgreSQL on 127.0.0.1:5432 for all but the first tests; a Python interpreter for one subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from controller.db import make_engine, make_session_factory, session_scope
from controller.leader import (
    LOCK_KEY,
    AdvisoryLock,
    AlwaysLeader,
    FileLock,
    Leadership,
    default_controller_id,
)
from controller.models import Event
from controller.recovery.monitor import Monitor
from tests.harness import build_app, in_process, settings_for
from vigil.contract.background import BackgroundLoop
from vigil.contract.probe import wait_for
from vigil.contract.settings import Settings

REPO = Path(__file__).resolve().parents[2]
API = "/api/v1"
INTERVAL = 0.2


class Loop(BackgroundLoop):
    """A loop that counts its passes (what the leader runs)."""

    thread_name = "test-led-loop"

    def __init__(self) -> None:
        super().__init__()
        self.interval = 60.0
        self.passes = 0

    def tick(self) -> None:
        self.passes += 1


class FakeLock:
    """The lock, by hand: ``free`` says whether it can be taken, ``alive`` whether its session lives."""

    def __init__(self) -> None:
        self.free = True
        self.alive = True
        self.held_now = False
        self.fail: Exception | None = None

    def try_acquire(self) -> bool:
        if self.fail is not None:
            raise self.fail
        if self.free and self.alive:
            self.held_now, self.free = True, False
        return self.held_now

    def held(self) -> bool:
        return self.held_now and self.alive

    def release(self) -> None:
        if self.held_now:
            self.held_now, self.free = False, True

    def close(self) -> None:
        self.release()


def _events(sessions: Any, kind: str) -> list[Event]:
    with session_scope(sessions) as s:
        return list(s.scalars(select(Event).where(Event.kind == kind).order_by(Event.id)).all())


@pytest.fixture
def sqlite_sessions(sqlite_url: str) -> Iterator[Any]:
    from controller import migrate

    migrate.upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield make_session_factory(engine)
    engine.dispose()


# -- the loop, one pass at a time --------------------------------------------------------------------

def test_the_loops_run_only_while_the_lock_is_held(sqlite_sessions: Any) -> None:
    lock, loops = FakeLock(), [Loop(), Loop()]
    lock.free = False  # another controller leads
    lead = Leadership(lock, loops, sqlite_sessions, controller_id="ctl-a", interval=60)
    lead.tick()
    assert not lead.is_leader and not any(loop.running for loop in loops)
    lock.free = True  # the leader died: its session, and so its lock, are gone
    lead.tick()
    try:
        assert lead.is_leader and all(loop.running for loop in loops)
        assert lead.leader_since is not None and lead.leader_since <= time.time()
        (ev,) = _events(sqlite_sessions, "controller_leader")
        assert ev.data == {"controller_id": "ctl-a"} and "ctl-a" in ev.message
        lead.tick()  # still held: nothing changes
        assert lead.is_leader and len(_events(sqlite_sessions, "controller_leader")) == 1
        lock.alive = False  # our session broke: the lock is lost with it
        lead.tick()
        assert not lead.is_leader and not any(loop.running for loop in loops)
        (lost,) = _events(sqlite_sessions, "controller_leader_lost")
        assert lost.data == {"controller_id": "ctl-a"}
        lock.alive = True
        lead.tick()  # taken again: the loops start afresh
        assert lead.is_leader and all(loop.running for loop in loops)
    finally:
        lead.stop()
    assert not any(loop.running for loop in loops) and lock.free  # stop() gives the lock up


def test_a_database_error_while_trying_is_a_pass_without_the_lock(sqlite_sessions: Any, caplog) -> None:
    lock, loop = FakeLock(), Loop()
    lock.fail = OperationalError("SELECT pg_try_advisory_lock", {}, Exception("server closed the connection"))
    lead = Leadership(lock, [loop], sqlite_sessions, controller_id="ctl-b", interval=60)
    lead.tick()
    lead.tick()
    assert not lead.is_leader and not loop.running
    assert sum("cannot try the leader lock" in r.message for r in caplog.records) == 1  # once per outage
    lock.fail = None
    lead.tick()
    assert lead.is_leader
    lead.stop()


def test_start_leads_at_once_when_the_lock_is_free(sqlite_sessions: Any) -> None:
    loop = Loop()
    lead = Leadership(FakeLock(), [loop], sqlite_sessions, controller_id="ctl-c", interval=60)
    lead.start()  # the first attempt in the caller's thread: no wait for the loop's first pass
    try:
        assert lead.is_leader and loop.running
    finally:
        lead.stop()


def test_sqlite_is_always_the_leader(sqlite_sessions: Any) -> None:
    loop = Loop()
    lead = Leadership(AlwaysLeader(), [loop], sqlite_sessions, controller_id=default_controller_id())
    assert lead.is_leader  # before start too: tests drive the loops by hand on SQLite
    lead.start()
    try:
        assert loop.running
    finally:
        lead.stop()
    assert ":" in lead.controller_id and str(os.getpid()) in lead.controller_id


def test_the_monitor_counts_silence_from_when_it_started_leading(sqlite_sessions: Any) -> None:
    now = [1000.0]
    monitor = Monitor(sqlite_sessions, interval=60, clock=lambda: now[0])
    assert monitor.started_at == 1000.0
    now[0] = 5000.0  # a standby, built long ago, becomes the leader now
    monitor.start()
    try:
        assert monitor.started_at == 5000.0
    finally:
        monitor.stop()


def test_healthz_on_sqlite_says_leader(tmp_path: Path, sqlite_url: str) -> None:
    app = build_app(settings_for(tmp_path, sqlite_url))
    with in_process(app, role=None) as c:
        assert c.get(f"{API}/healthz").json() == {"status": "ok", "database": "sqlite", "version": app.version,
                                                   "leader": True}


def test_two_apps_on_one_sqlite_file_have_one_leader(tmp_path: Path, sqlite_url: str) -> None:
    """``vigil controller --workers N`` on SQLite: every worker is an app on the same file; the file lock
    lets one run the loops, and another takes over when it stops."""
    def app(name: str) -> Any:
        return build_app(settings_for(tmp_path / name, sqlite_url, leader_interval_s=INTERVAL), background=True)

    a, b = app("a"), app("b")
    assert isinstance(a.state.leadership.lock, FileLock)
    with ExitStack() as first:
        ca = first.enter_context(TestClient(a))  # started first: it leads
        with TestClient(b) as cb:
            assert ca.get(f"{API}/healthz").json()["leader"] is True
            assert cb.get(f"{API}/healthz").json()["leader"] is False
            assert a.state.monitor.running and not b.state.monitor.running
            assert not b.state.telemetry.running and not b.state.supervisor.running
            first.close()  # the leader's worker ends: the lock is released
            # /healthz says leader only once the loops run (Leadership._gain): wait for the flag itself.
            wait_for(lambda: cb.get(f"{API}/healthz").json()["leader"], 10, "the other worker to take over", 0.05)
            assert b.state.monitor.running


def test_standby_controllers_need_postgresql(tmp_path: Path, sqlite_url: str) -> None:
    from ops.localcluster import start_local_cluster

    for url in (None, sqlite_url):
        with pytest.raises(ValueError, match="standby_controllers"):
            start_local_cluster(tmp_path / "home", database_url=url, standby_controllers=1)
    with pytest.raises(ValueError, match="standby_controllers"):
        start_local_cluster(tmp_path / "home", standby_controllers=-1)
    assert not (tmp_path / "home").exists()  # refused before anything started


# -- the lock on PostgreSQL --------------------------------------------------------------------------

def _lock_holders(url: str) -> list[int]:
    """Backend pids holding the leader lock (pg_locks splits a bigint key into classid/objid)."""
    raw = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(raw, autocommit=True) as conn:
        rows = conn.execute(
            # This database's only: the key is the same in every test's database on the shared server.
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid = ((%s::bigint >> 32) & 4294967295)::oid AND objid = (%s::bigint & 4294967295)::oid",
            (LOCK_KEY, LOCK_KEY)).fetchall()
    return [r[0] for r in rows]


def _terminate(url: str, pid: int) -> None:
    raw = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(raw, autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)


@pytest.mark.postgres
def test_one_holder_and_takeover_when_its_session_ends(postgres_url: str) -> None:
    a, b = AdvisoryLock(postgres_url), AdvisoryLock(postgres_url)
    try:
        assert a.try_acquire() and a.held()
        assert not b.try_acquire() and not b.held()
        (holder,) = _lock_holders(postgres_url)
        _terminate(postgres_url, holder)  # an operator, or the network, ends the leader's session
        assert not a.held()  # SELECT 1 fails: the lock went with the session
        wait_for(b.try_acquire, 5, "the lock to be free once the session ended", 0.05)  # the backend exits
        assert b.held()
        assert not a.try_acquire()  # a new session of a's: now the standby
        b.release()
        assert _lock_holders(postgres_url) == []
        assert a.try_acquire()
    finally:
        a.close()
        b.close()


HOLDER = """
import sys, time
from controller.leader import AdvisoryLock
lock = AdvisoryLock(sys.argv[1])
assert lock.try_acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.postgres
def test_a_holder_killed_with_sigkill_frees_the_lock(postgres_url: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, postgres_url], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    standby = AdvisoryLock(postgres_url)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert not standby.try_acquire()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        wait_for(standby.try_acquire, 10, "the lock to be free after kill -9", INTERVAL)
        assert time.monotonic() - t0 < 5  # the kernel closes the socket; PostgreSQL ends the session at once
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        standby.close()


# -- two real controllers on one database --------------------------------------------------------------

def _app(tmp_path: Path, url: str, name: str) -> Any:
    settings = Settings(home=tmp_path / name, database_url=url, leader_interval_s=INTERVAL, controller_id=name,
                        monitor_interval_s=0.2)
    return build_app(settings, background=True)


def _loops(app: Any) -> list[bool]:
    return [loop.running for loop in (app.state.supervisor, app.state.monitor, app.state.telemetry)]


def _leading(app: Any) -> bool:
    """Leader, with its three loops running."""
    return app.state.leadership.is_leader and all(_loops(app))


def _standing_by(app: Any) -> bool:
    """Not leader, none of its loops running."""
    return not app.state.leadership.is_leader and not any(_loops(app))


@pytest.mark.postgres
def test_two_controllers_one_leader_and_the_standby_takes_over(tmp_path: Path, postgres_url: str) -> None:
    app_a, app_b = _app(tmp_path, postgres_url, "ctl-a"), _app(tmp_path, postgres_url, "ctl-b")
    with TestClient(app_a) as a:
        b = TestClient(app_b).__enter__()
        try:
            assert a.get(f"{API}/healthz").json()["leader"] is True
            assert b.get(f"{API}/healthz").json()["leader"] is False
            assert _leading(app_a) and _standing_by(app_b)
            time.sleep(3 * INTERVAL)  # the standby keeps trying, in vain
            assert _leading(app_a) and _standing_by(app_b) and len(_lock_holders(postgres_url)) == 1

            # The leader's session ends under it: it stops its loops; the standby leads.
            (holder,) = _lock_holders(postgres_url)
            _terminate(postgres_url, holder)
            wait_for(lambda: _leading(app_b), 5, "the standby to take over", 0.05)
            wait_for(lambda: _standing_by(app_a), 5, "the old leader to step down", 0.05)
            assert app_b.state.monitor.started_at >= app_b.state.leadership.leader_since - 1  # its grace: from now
            assert b.get(f"{API}/healthz").json()["leader"] is True
            assert a.get(f"{API}/healthz").json()["leader"] is False
        finally:
            b.__exit__(None, None, None)  # the new leader shuts down: it gives the lock up
        # The old leader, a standby now, takes the lock back.
        wait_for(lambda: _leading(app_a), 5, "the first controller to lead again", 0.05)
        sessions = app_a.state.sessions

        def leaders() -> list[str]:
            return [e.data["controller_id"] for e in _events(sessions, "controller_leader")]

        # The event is written just after the loops start and leader_since is set (a second commit):
        # wait for it rather than read in between (seen in CI).
        wait_for(lambda: len(leaders()) >= 3, 5, "the third controller_leader event", 0.05)
        assert leaders() == ["ctl-a", "ctl-b", "ctl-a"]
        assert [e.data["controller_id"] for e in _events(sessions, "controller_leader_lost")] == ["ctl-a"]
    assert _lock_holders(postgres_url) == []  # the apps' shutdown gave it up


def test_each_monitor_pass_is_timed_on_metrics(tmp_path: Path, sqlite_url: str) -> None:
    """``vigil_monitor_pass_seconds`` (and the latest pass's gauge) on ``/metrics``: how the ingest
    benchmark checks that detection keeps its pace during a flood of telemetry."""
    from tests.auth import bearer, issue_token

    app = build_app(settings_for(tmp_path, sqlite_url))

    def count(text: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("vigil_monitor_pass_seconds_count"))

    with TestClient(app, headers=bearer(issue_token(app, "admin"))) as c:
        before = count(c.get("/metrics").text)
        app.state.monitor.step()
        app.state.monitor.step()
        text = c.get("/metrics").text
    assert count(text) == before + 2
    assert any(line.startswith("vigil_monitor_last_pass_seconds ") and float(line.split()[-1]) > 0
               for line in text.splitlines())


def test_sqlite_writers_of_two_processes_take_turns(tmp_path: Path) -> None:
    """``sqlite_writer``: a writer waits for the holder of the database's writer lock (here another engine on
    the same file, as another ``--workers`` process would hold it) and gets it the moment it is released."""
    import threading

    from controller.db import sqlite_writer

    url = f"sqlite:///{tmp_path / 'v.db'}"
    a, b = make_session_factory(make_engine(url)), make_session_factory(make_engine(url))
    got = threading.Event()

    def other() -> None:
        with sqlite_writer(b):
            got.set()

    with sqlite_writer(a):
        t = threading.Thread(target=other, daemon=True)
        t.start()
        assert not got.wait(0.5)  # waits while the other holds it
    assert got.wait(10)
    t.join(10)
    with sqlite_writer(a):  # free again once released
        pass
    assert (tmp_path / "v.db.writer").exists()
    pg = make_session_factory(make_engine("postgresql://user@127.0.0.1:1/none"))
    with sqlite_writer(pg) as nothing:  # PostgreSQL: no queue
        assert nothing is None
