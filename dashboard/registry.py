"""Callbacks declared beside their functions, registered on each app that asks.

Dash's own ``@dash.callback`` puts a callback in a process-wide list that the first app to serve a
request takes whole; with several apps in one process (tests, a standalone app beside a mounted one)
the others would get none. A page declares its callbacks on a :class:`CallbackSet` instead, with the
same arguments ``@dash.callback`` takes, and its ``register(app)`` hands them to ``app.callback``: each
app gets each callback once, and the functions stay plain module-level functions (unit-testable).

A polling callback also takes ``running=Paced("<its dcc.Interval's id>")`` (see :class:`Paced`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import dash
from dash import Output

from dashboard.context import CONFIG_KEY, DashboardConfig

F = TypeVar("F", bound=Callable[..., Any])

BUSY_POLL_MS = 30_000
"""The period of a page's timer while one of its refreshes is under way."""


@dataclass(frozen=True)
class Paced:
    """``running=Paced(interval_id)``: while the callback runs, its timer waits instead of ticking.

    Dash drops the reply of a callback that fires again before it answered (plotly/dash#941), so a
    page whose refresh takes longer than its period (a busy controller, a big job) would never draw
    at all: every tick would cancel the refresh under way. While a paced callback runs, the timer's
    period is :data:`BUSY_POLL_MS`; when it answers, the app's period again, counted from then. A
    reply that never comes (the server unreachable) leaves the slow period, so the page still
    retries, every :data:`BUSY_POLL_MS`.
    """

    interval_id: str

    def running(self, refresh_ms: int) -> list[tuple[Output, int, int]]:
        """Dash's ``running`` argument for an app polling every ``refresh_ms``."""
        return [(Output(self.interval_id, "interval"), BUSY_POLL_MS, refresh_ms)]


class CallbackSet:
    """The callbacks of one page, in the order declared."""

    def __init__(self) -> None:
        self._declared: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        """``@callbacks(Output(...), Input(...), ...)``: declare the function below as a callback."""
        def declare(fn: F) -> F:
            self._declared.append((fn, args, kwargs))
            return fn
        return declare

    def register(self, app: dash.Dash) -> None:
        """Register every declared callback on ``app`` (``app.callback(*args, **kwargs)(fn)``).

        ``app.server.config[CONFIG_KEY]`` must hold the app's :class:`DashboardConfig` already: a
        :class:`Paced` callback's timer returns to the app's period.
        """
        cfg = app.server.config[CONFIG_KEY]
        assert isinstance(cfg, DashboardConfig)
        for fn, args, kwargs in self._declared:
            paced = kwargs.get("running")
            if isinstance(paced, Paced):
                kwargs = {**kwargs, "running": paced.running(cfg.refresh_ms)}
            app.callback(*args, **kwargs)(fn)
