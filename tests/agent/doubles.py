"""Test doubles for the agent tests: a fake clock, a fake transport, and an in-test HTTP server
standing in for the controller's ingest endpoint; helpers to play ranks (datagrams) and run agents.

``TelemetryServer`` is a *test double*, not the controller: it implements only what the agent
relies on (POST /api/v1/telemetry, gzip bodies, TelemetryBatch validation -> 422, idempotency on
(agent_id, seq) -> ``duplicate: true``) and can be switched down and up again, answer 503, or store
a batch and drop the connection before answering: the misbehaviour ``test_integration.py`` needs.
Tests of the agent against the controller itself use the real one (:mod:`tests.live_controller`).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import psutil
from pydantic import ValidationError

from agent.main import AgentConfig, run_agent
from vigil.contract.probe import wait_for  # the agent tests import it from here
from vigil.contract.schemas import TelemetryAck, TelemetryBatch


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def decode_body(body: bytes) -> TelemetryBatch:
    return TelemetryBatch.model_validate_json(gzip.decompress(body))


class FakeTransport:
    """Records posted batches; ``fail_with`` (an exception) makes every post raise it."""

    def __init__(self) -> None:
        self.calls: list[TelemetryBatch] = []  # every post, including failed and repeated ones
        self.stored: list[TelemetryBatch] = []  # what a controller would have stored, in order
        self.fail_with: BaseException | None = None
        self._seen: set[tuple[str, int]] = set()

    def post(self, body: bytes) -> TelemetryAck:
        batch = decode_body(body)
        self.calls.append(batch)
        if self.fail_with is not None:
            raise self.fail_with
        key = (batch.agent_id, batch.seq)
        if key in self._seen:
            return TelemetryAck(accepted=True, duplicate=True, stored=0)
        self._seen.add(key)
        self.stored.append(batch)
        return TelemetryAck(accepted=True, duplicate=False, stored=len(batch.samples))

    @property
    def stored_seqs(self) -> list[int]:
        return [b.seq for b in self.stored]

    @property
    def stored_samples(self) -> list[Any]:
        return [s for b in self.stored for s in b.samples]


def step_dict(step: int, *, job_id: str = "job-1", rank: int = 0, pid: int | None = None) -> dict[str, Any]:
    """A valid StepSample as a rank would send it (JSON-ready dict)."""
    d: dict[str, Any] = {
        "kind": "step",
        "job_id": job_id,
        "rank": rank,
        "world_size": 2,
        "step": step,
        "ts": 1_700_000_000.0 + step,
        "loss": 2.5,
        "step_time_s": 0.1,
        "tokens": 512,
        "tokens_per_s": 5120.0,
    }
    if pid is not None:
        d["pid"] = pid
    return d


def collective_dict(step: int, seq: int = 0, *, job_id: str = "job-1", rank: int = 0) -> dict[str, Any]:
    return {
        "kind": "collective",
        "job_id": job_id,
        "rank": rank,
        "step": step,
        "seq": seq,
        "op": "all_reduce",
        "payload_bytes": 4096,
        "wire_bytes": 4096,
        "duration_s": 0.002,
        "ts": 1_700_000_000.0 + step,
    }


def datagram(items: list[dict[str, Any]]) -> bytes:
    return json.dumps(items, separators=(",", ":")).encode()


def send_datagrams(path: str, payloads: list[bytes], as_pid: int | None = None) -> None:
    """Blocking sends: when the agent's queue is full the sender waits instead of losing data.

    ``as_pid``: the datagrams carry that process's credentials (``SCM_CREDENTIALS``), as if it sent them
    (only root may: the agent checks a sample's pid against its sender, agent/ranksocket.py)."""
    creds = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", as_pid or 0, os.getuid(), os.getgid()))]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        for p in payloads:
            if as_pid is None:
                s.sendto(p, path)
            else:
                s.sendmsg([p], creds, 0, path)


class _TrackingServer(ThreadingHTTPServer):
    """Remembers its open connections so that going down can cut them."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        with self._conn_lock:
            conns, self.connections = list(self.connections), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class TelemetryServer:
    """Test double of the controller's ingest endpoint, on 127.0.0.1 in a thread.

    ``mode``: ``"ok"`` stores and acks; ``"503"`` answers 503 Service Unavailable; ``"drop"``
    stores the batch and then closes the connection without answering (an ack lost on the way
    back, so the agent must retry and the retry must be recognised as a duplicate).
    ``down()`` closes the listening socket (connection refused), ``up()`` reopens the same port.
    """

    def __init__(self) -> None:
        self.mode = "ok"
        self.port = 0
        self.stored: list[TelemetryBatch] = []  # unique batches in arrival order
        self.posts = 0
        self.duplicates = 0
        self.invalid = 0
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._httpd: _TrackingServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                if self.path != "/api/v1/telemetry":
                    self._answer(404, {"detail": "not found"})
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                server.posts += 1
                if server.mode == "503":
                    self._answer(503, {"detail": "unavailable"})
                    return
                try:
                    batch = TelemetryBatch.model_validate_json(body)
                except ValidationError as exc:
                    with server._lock:
                        server.invalid += 1
                    self._answer(422, {"detail": exc.errors(include_url=False, include_context=False)})
                    return
                key = (batch.agent_id, batch.seq)
                with server._lock:
                    duplicate = key in server._seen
                    if duplicate:
                        server.duplicates += 1
                    else:
                        server._seen.add(key)
                        server.stored.append(batch)
                if server.mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._answer(200, {"accepted": True, "duplicate": duplicate, "stored": len(batch.samples)})

            def _answer(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = _TrackingServer(("127.0.0.1", self.port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def down(self) -> None:
        """Stop listening *and* cut open keep-alive connections: the agent's HTTP client would
        otherwise keep talking to the handler threads of a "down" server."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd.cut_connections()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    # -- what arrived ------------------------------------------------------------------------------
    def snapshot(self) -> list[TelemetryBatch]:
        with self._lock:
            return list(self.stored)

    def samples(self) -> list[Any]:
        return [s for b in self.snapshot() for s in b.samples]

    def heartbeats(self) -> list[Any]:
        return [b.heartbeat for b in self.snapshot() if b.heartbeat is not None]


def socket_ready(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


class AgentThread:
    """run_agent in a thread, as a context manager: entered once the socket answers."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            run_agent(self.config, self.stop)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test in __exit__
            self.error = exc

    def __enter__(self) -> Self:
        self.thread.start()
        wait_for(lambda: socket_ready(self.config.socket_path) or self.error is not None, what="agent socket")
        assert self.error is None, self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(20)
        assert not self.thread.is_alive(), "agent did not stop"
        assert self.error is None, self.error


def state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:
        return "gone"


def gone(pid: int) -> bool:
    return state(pid) in ("gone", psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
