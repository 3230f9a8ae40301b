"""The one way tests stand up Vigil's controller, in its three forms.

* **In process**: :func:`build_app` is ``controller.app.create_app`` with the tests' defaults (SQLite in
  the test's folder unless a database URL is given, migrations run, the Ray seam faked by
  :class:`~tests.controller.fakes.FakeLauncher`, background loops off so a test drives the supervisor
  and the monitor itself); :func:`in_process` wraps it in a ``TestClient`` holding a token of a role.
* **Over HTTP**: :func:`serve` puts any app built by :func:`build_app` behind uvicorn on 127.0.0.1 (a
  port the OS picks, or a given one), in a daemon thread; :class:`tests.live_controller.LiveController`
  is that server plus the REST helpers the agent and dashboard tests use.
* **As a process**: :class:`ControllerProcess` is ``vigil controller`` as a child process, for the tests
  that SIGKILL it mid-stream.

Needs: the controller's dependencies (FastAPI, SQLAlchemy, Alembic, uvicorn), loopback, a writable folder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from controller.app import Mount, create_app
from tests.auth import bearer, issue_token
from tests.controller.fakes import FakeLauncher
from vigil.contract.probe import LOOPBACK, free_port, wait_for
from vigil.contract.settings import Settings

REPO = Path(__file__).resolve().parents[1]
FAKE: Any = object()
"""``launcher=FAKE`` (the default): a new :class:`FakeLauncher`; ``launcher=None``: none, jobs stay PENDING."""


def settings_for(home: Path, database_url: str | None = None, **fields: Any) -> Settings:
    """Settings of a test controller: its home, and SQLite at ``home/vigil.db`` unless a URL is given."""
    return Settings(home=home, database_url=database_url or f"sqlite:///{Path(home) / 'vigil.db'}", **fields)


def build_app(settings: Settings, *, launcher: Any = FAKE, cluster: Any = None, mounts: Sequence[Mount] = (),
              dashboard: bool = False, background: bool = False) -> FastAPI:
    """The real controller app for a test (module docstring). ``dashboard=True`` mounts the dashboard as
    ``vigil controller`` does (after ``mounts``)."""
    if dashboard:
        from ops.dashboard_mount import mount_dashboard

        mounts = [*mounts, mount_dashboard]
    return create_app(settings, FakeLauncher() if launcher is FAKE else launcher, cluster=cluster,
                      background=background, mounts=mounts)


@contextmanager
def in_process(app: FastAPI, role: str | None = "admin") -> Iterator[TestClient]:
    """A ``TestClient`` on ``app`` (its lifespan run) with a new token of ``role`` (``None``: no token)."""
    headers = bearer(issue_token(app, role)) if role is not None else {}
    with TestClient(app, headers=headers) as c:
        yield c


@dataclass
class LiveServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"live server at {self.url} did not stop within {timeout} s")


def bind(port: int = 0, retry_s: float = 10.0) -> socket.socket:
    """A listening-ready socket on 127.0.0.1 (``port`` 0: the OS picks). The port of a server that just
    stopped is free again at once (SO_REUSEADDR); a busy one is retried for ``retry_s``. Made with
    ``proto=IPPROTO_TCP``, as the OS's own lookup makes one: asyncio then sends each connection's writes at once
    (TCP_NODELAY); without, every request but a connection's first waited ~40 ms for a delayed ACK."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind((LOOPBACK, port))
            return sock
        except OSError:
            if port == 0 or time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.1)


def serve(make_app: Callable[[str], Any], *, port: int = 0, start_timeout: float = 60.0,
          **uvicorn_options: Any) -> LiveServer:
    """Build an app with its own base URL and serve it with uvicorn in a daemon thread.

    ``make_app`` receives the base URL before serving starts, because the mounted dashboard calls the API
    of the very server it is mounted in."""
    sock = bind(port)
    url = f"http://{LOOPBACK}:{sock.getsockname()[1]}"
    try:
        app = make_app(url)
    except BaseException:
        sock.close()
        raise
    config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False, timeout_graceful_shutdown=2,
                            **uvicorn_options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn {url}")
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=start_timeout, interval=0.01,
                 what=f"live server at {url}")
    finally:
        if not server.started:
            server.should_exit = True
            sock.close()
    if not server.started:
        raise RuntimeError(f"live server at {url} did not start")
    return LiveServer(url=url, server=server, thread=thread)


class ControllerProcess:
    """``vigil controller`` as a child process on a database URL; ``kill()`` is SIGKILL, ``start()`` reuses
    the port after ``kill()`` or ``stop()``."""

    def __init__(self, home: Path, url: str) -> None:
        self.home, self.url_db = home, url
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, VIGIL_HOME=str(self.home), VIGIL_DATABASE_URL=self.url_db,
                   VIGIL_CONTROLLER_URL=self.url, PYTHONPATH=str(REPO), VIGIL_AGGREGATE_SETTLE_S="0.5",
                   # The samples carry fixed timestamps of long ago: keep their raw rows to count them.
                   VIGIL_RAW_RETENTION_S=str(10 * 365 * 86400))
        env.pop("VIGIL_RAY_ADDRESS", None)
        self.starts += 1
        log = (self.home / f"controller-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "controller", "--port", str(self.port)],
                                     cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "controller exited"
            try:
                return httpx.get(f"{self.url}/api/v1/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=60, interval=0.1, what="controller up")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
