"""Several controllers, one agent: each call goes to the controller that answered last, and on to the
next URL of the list when that one does not answer.

Controllers on one PostgreSQL database all serve the API (one of them, the leader, also runs the
monitor: controller/leader.py), so an agent given all their URLs (``--controller URL1,URL2``) keeps
shipping and polling through whichever is up. A call fails over on what says "this controller is not
there": a connection error, a timeout, a broken connection, an HTTP 5xx. Any other answer (a 4xx, a
reply that does not parse) comes from a controller that is up, and is the caller's to handle. Once a
URL has answered, the agent sticks with it (no flapping back to the first); each switch is logged once.

A call tried on another controller is the same request again: the telemetry batch with the same
``(agent_id, seq)``, the same command answer. Both are idempotent on the server, so a request the dead
controller stored before it died is simply recognised as a replay.

The shipper and the command loop each have a client of their own (a slow poll never waits behind a
post). Its only state is which URL is current: calls from two threads would at worst log a switch twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import httpx

from vigil.contract.client import ApiError, VigilClient

log = logging.getLogger(__name__)

T = TypeVar("T")


def controller_down(exc: BaseException) -> bool:
    """Whether ``exc`` says the controller is not there (try another) rather than that it refused."""
    if isinstance(exc, ApiError):
        return exc.status_code >= 500
    return isinstance(exc, httpx.TransportError | OSError)


class FailoverClient:
    """:class:`~vigil.contract.client.VigilClient` per URL; :meth:`call` runs a request on the current one,
    then on each other in turn while they are down (module docstring)."""

    def __init__(self, clients: Sequence[VigilClient], urls: Sequence[str], *, purpose: str = "") -> None:
        if not clients or len(clients) != len(urls):
            raise ValueError("FailoverClient needs one client per URL, at least one")
        self.clients = list(clients)
        self.urls = list(urls)
        self.purpose = purpose
        self._current = 0

    @classmethod
    def connect(cls, urls: Sequence[str], *, token: str, timeout: float, purpose: str = "") -> FailoverClient:
        """A client per URL, with ``token`` and ``timeout`` (per attempt)."""
        return cls([VigilClient(u, token=token, timeout=timeout) for u in urls], urls, purpose=purpose)

    @property
    def url(self) -> str:
        """The controller the next call goes to first."""
        return self.urls[self._current]

    def call(self, request: Callable[[VigilClient], T]) -> T:
        """``request(client)`` on the current controller, then on the others while they are down; the
        error of the last one tried when none answered."""
        n = len(self.clients)
        for i in range(n):
            index = (self._current + i) % n
            try:
                result = request(self.clients[index])
            except Exception as exc:
                if i == n - 1 or not controller_down(exc):
                    raise
                log.debug("%scontroller %s down (%s: %s)", self._what(), self.urls[index], type(exc).__name__, exc)
                continue
            if index != self._current:
                log.warning("%scontroller %s did not answer; using %s from now on", self._what(),
                            self.urls[self._current], self.urls[index])
                self._current = index
            return result
        raise AssertionError("unreachable")  # the last attempt returned or raised

    def _what(self) -> str:
        return f"{self.purpose}: " if self.purpose else ""

    def close(self) -> None:
        for client in self.clients:
            client.close()
