"""The controller's connections send at once (TCP_NODELAY), however their listening socket was made.

asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP. uvicorn's own listening socket for
``--workers`` and ours for several addresses (``vigil up --netns``) were made without it, so each response's
body waited for the client to acknowledge its headers: ~40 ms of delayed ACK on every request but a
connection's first (measured on loopback: 44 ms against ~1 ms). Here a real connection, accepted on such a
socket, is served by a real asyncio transport with :class:`controller.http_protocol.HeaderDeadlineProtocol`,
and by uvicorn's plain protocol for comparison.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from controller.http_protocol import HeaderDeadlineProtocol
from tests.harness import bind


async def _app(scope: dict, receive: object, send: object) -> None:  # never called: no request is sent
    raise AssertionError("no request expected")


def _nodelay_after_serving(protocol: type[H11Protocol], listening: socket.socket) -> int:
    """TCP_NODELAY of a connection accepted on ``listening`` once ``protocol`` serves it."""
    listening.listen()
    with socket.create_connection(listening.getsockname()) as _client:
        conn, _ = listening.accept()
        config = uvicorn.Config(_app, log_level="warning")
        config.load()

        async def serve() -> int:
            loop = asyncio.get_running_loop()
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol(config=config, server_state=ServerState(), app_state={}), conn)
            try:
                return conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            finally:
                transport.close()

        try:
            return asyncio.run(serve())
        finally:
            conn.close()


def test_a_connection_from_a_socket_made_without_proto_sends_at_once() -> None:
    # As uvicorn's bind_socket (--workers) and ops/cli/services.py's _listen made them: proto 0.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:
        plain.bind(("127.0.0.1", 0))
        assert plain.proto == 0
        assert _nodelay_after_serving(H11Protocol, plain) == 0, "asyncio now sets TCP_NODELAY itself"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:
        plain.bind(("127.0.0.1", 0))
        assert _nodelay_after_serving(HeaderDeadlineProtocol, plain) != 0


@pytest.mark.parametrize("protocol", [H11Protocol, HeaderDeadlineProtocol])
def test_the_test_servers_socket_is_made_as_the_os_lookup_makes_one(protocol: type[H11Protocol]) -> None:
    """``tests.harness.bind`` (every live controller of the tests): proto IPPROTO_TCP, so asyncio sends at once
    under any protocol, as under ``uvicorn.run(host=..., port=...)``."""
    with bind() as sock:
        assert sock.proto == socket.IPPROTO_TCP
        assert _nodelay_after_serving(protocol, sock) != 0
