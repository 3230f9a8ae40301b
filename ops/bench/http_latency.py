"""``vigil bench http``: what one request to the controller costs on a kept-alive connection, under the
controller's HTTP protocol and under uvicorn's plain one, in one run.

The real controller app (SQLite, no background loops) is served by uvicorn on loopback from a listening
socket made as uvicorn's ``--workers`` and ``vigil up --netns`` make theirs (``socket.socket()``, proto 0),
in turn with ``plain`` (uvicorn's h11 protocol, the baseline) and ``vigil``
(:class:`controller.http_protocol.HeaderDeadlineProtocol`, which sets TCP_NODELAY on each connection).
A client makes ``--requests`` GETs of the job list, each variant on one kept-alive connection, as the agents,
the dashboard and the CLI do. Without TCP_NODELAY each response's body waits for the client to
acknowledge its headers: a delayed ACK, ~40 ms on Linux.

Prints JSON with ``--json``: per variant ``first_ms`` (the connection's first request), ``p50_ms``,
``p99_ms``, and ``p50_ratio`` (plain / vigil).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from controller.app import create_app
from controller.db import session_scope
from controller.http_protocol import HeaderDeadlineProtocol
from controller.tokens import create_token
from vigil.contract.schemas import Role, TokenCreate
from vigil.contract.settings import Settings

PATH = "/api/v1/jobs"
"""The read each request makes (the job list, as the CLI and the dashboard read it)."""
VARIANTS: dict[str, type[H11Protocol]] = {"plain": H11Protocol, "vigil": HeaderDeadlineProtocol}


def _serve(app: Any, protocol: type[H11Protocol]) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0, as uvicorn's bind_socket makes it
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    return server, thread, sock.getsockname()[1]


def measure(app: Any, protocol: type[H11Protocol], path: str, token: str, requests: int) -> dict[str, float]:
    server, thread, port = _serve(app, protocol)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}) as c:
            took = []
            for _ in range(requests + 1):
                t = time.perf_counter()
                c.get(path).raise_for_status()
                took.append((time.perf_counter() - t) * 1000)
    finally:
        server.should_exit = True
        thread.join(10)
    rest = sorted(took[1:])
    return {"first_ms": round(took[0], 2), "p50_ms": round(statistics.median(rest), 2),
            "p99_ms": round(rest[min(len(rest) - 1, int(0.99 * len(rest)))], 2)}


def run(requests: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vigil-bench-http-") as home:
        settings = Settings(home=Path(home), database_url=f"sqlite:///{home}/vigil.db")
        app = create_app(settings, background=False)
        with session_scope(app.state.sessions) as session:
            token = create_token(session, TokenCreate(role=Role.ADMIN, name="bench")).token
        out: dict[str, Any] = {"requests": requests, "path": PATH, "listening_socket_proto": 0}
        for name, protocol in VARIANTS.items():
            out[name] = measure(app, protocol, PATH, token, requests)
    out["p50_ratio"] = round(out["plain"]["p50_ms"] / max(out["vigil"]["p50_ms"], 1e-6), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vigil bench http", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="requests per variant, after the first (200)")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    result = run(args.requests)
    if args.json:
        print(json.dumps(result))
    else:
        for name in VARIANTS:
            r = result[name]
            print(f"{name:6s} first {r['first_ms']:7.2f} ms  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms")
        print(f"p50 plain / vigil: {result['p50_ratio']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
