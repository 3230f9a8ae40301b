"""The controller's HTTP/1.1 protocol: uvicorn's h11 protocol plus a deadline for a request's headers.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not a client that opens a connection
and sends its request line and headers a byte at a time: many such clients (slowloris) hold sockets open for
ever, until the controller runs out of them and the agents' heartbeats stop getting through, so their nodes
look dead. Here a request's headers must arrive within :data:`HEADER_TIMEOUT_S` of its first byte (or of the
connection, for the first request); otherwise the connection is closed. And one client (a peer address) may
hold at most :data:`MAX_CONNECTIONS_PER_CLIENT` connections at once: beyond, a new one is closed at once, so
one host cannot take every socket from the others' agents. Its connections send at once (TCP_NODELAY, see
:func:`_no_delay`). ``vigil controller`` serves with it.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from typing import ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = float(os.environ.get("VIGIL_HEADER_TIMEOUT_S", "10"))
"""Seconds a client has to send a request's line and headers (``VIGIL_HEADER_TIMEOUT_S``)."""


MAX_CONNECTIONS_PER_CLIENT = int(os.environ.get("VIGIL_MAX_CONNECTIONS_PER_CLIENT", "256"))
"""Connections one peer address may hold open at once (``VIGIL_MAX_CONNECTIONS_PER_CLIENT``). Generous: on one
machine every agent, the dashboard and the CLI share 127.0.0.1."""


def _no_delay(transport: asyncio.BaseTransport) -> None:
    """Send small writes at once (TCP_NODELAY). asyncio sets it only on sockets made with ``proto=IPPROTO_TCP``;
    a listening socket made without it (uvicorn's for ``--workers``, ours for several addresses) hands out
    connections that hold a response's body until the client acknowledges its headers, which a client's
    delayed ACK makes ~40 ms: every request but a connection's first took 44 ms on loopback (measured)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # closed already: the protocol finds out on its own


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and a cap per client (module docstring)."""

    _header_timer: asyncio.TimerHandle | None = None
    _peer: str | None = None
    _open: ClassVar[Counter[str]] = Counter()
    """Open connections by peer address, in this process (one event loop serves them all)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)
        peer = self.client[0] if self.client else None
        if peer is not None:
            if self._open[peer] >= MAX_CONNECTIONS_PER_CLIENT:
                transport.close()
                return
            self._peer = peer
            self._open[peer] += 1
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if before is None or before.response_complete:  # bytes of a new request: its headers are due
            self._arm()
        super().data_received(data)
        if self.cycle is not None and self.cycle is not before:  # its headers are in
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._peer is not None:
            self._open[self._peer] -= 1
            if self._open[self._peer] <= 0:
                del self._open[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
