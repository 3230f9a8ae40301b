"""Attack on the controller's sockets: slowloris. A client opens connections and sends each request's headers a
byte at a time; uvicorn bounds idle keep-alive connections but not this, so enough such clients hold every
socket the controller may open, and the agents' heartbeats stop getting through (their nodes look dead).

Finding (issue 23): no header timeout. ``vigil controller`` now serves with
:class:`controller.http_protocol.HeaderDeadlineProtocol`: a request's headers are due within a deadline of
its first byte. The test runs the real controller app under uvicorn on loopback, with raw sockets; on plain
uvicorn (the code before) the slow connection stays open, and the test says so."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from controller import http_protocol
from ops.localcluster import free_port
from tests.harness import build_app
from vigil.contract.settings import Settings


@pytest.fixture
def port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(http_protocol, "HEADER_TIMEOUT_S", 1.0)
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'v.db'}")
    p = free_port()
    app = build_app(settings, dashboard=True)  # as `vigil controller`
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p, log_level="warning",
                                           http=http_protocol.HeaderDeadlineProtocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield p
    finally:
        server.should_exit = True
        thread.join(10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sends before closing is read past)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    return False


def _response(sock: socket.socket) -> bytes:
    """One whole response (its headers, then Content-Length bytes of body), however the segments arrive."""
    sock.settimeout(5.0)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def test_a_request_whose_headers_never_end_is_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.monotonic()
        assert _closed_within(slow, 5.0), "the server kept a connection whose headers never ended"
        assert time.monotonic() - started < 4.0


def test_an_idle_connection_and_a_slow_second_request_are_closed_a_quick_one_is_served(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as idle:  # connected, never a byte
        assert _closed_within(idle, 5.0)
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(c).startswith(b"HTTP/1.1 200")
        c.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHo")  # the next request, kept alive, then stalls
        assert _closed_within(c, 5.0)


def test_one_client_cannot_hold_more_than_its_share_of_connections(port: int, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """Finding (issue 23): no connection limits. One peer address holds at most MAX_CONNECTIONS_PER_CLIENT."""
    monkeypatch.setattr(http_protocol, "MAX_CONNECTIONS_PER_CLIENT", 3)
    monkeypatch.setattr(http_protocol, "HEADER_TIMEOUT_S", 30.0)  # only the cap may close them here
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        with socket.create_connection(("127.0.0.1", port)) as extra:
            assert _closed_within(extra, 2.0), "a fourth connection of the same client was kept"
        for s in held:  # the first three are served
            s.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b" 200 " in _response(s)
        held.pop().close()
        time.sleep(0.2)  # the server sees the close
        with socket.create_connection(("127.0.0.1", port)) as again:  # a slot is free again: served
            again.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b" 200 " in _response(again)
    finally:
        for s in held:
            s.close()
