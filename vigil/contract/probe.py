"""Waiting for something to happen and finding a free port: what every process starter, bench and
test needs, in one place. Standard library only (the agent, the trainer and the tests import it).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (another process may take it before you do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def poll(cond: Callable[[], T], timeout: float, interval: float = 0.5,
         ignore: tuple[type[BaseException], ...] = ()) -> T | None:
    """``cond()``'s first truthy value within ``timeout`` seconds, checked every ``interval``; ``None``
    when it never came. Exceptions of the ``ignore`` types count as "not yet" (a server still starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
            if value:
                return value
        except ignore:
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def wait_for(cond: Callable[[], T], timeout: float = 20.0, what: str = "", interval: float = 0.1,
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    """:func:`poll`, but ``TimeoutError`` naming ``what`` (and the last value or ignored error) when
    the time is up."""
    last: list[object] = [None]

    def probe() -> T:
        try:
            value = cond()
        except ignore as exc:
            last[0] = exc
            raise
        last[0] = value
        return value

    value = poll(probe, timeout, interval, ignore)
    if value is None or not value:
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what or cond} (last: {last[0]!r})")
    return value
