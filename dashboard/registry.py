"""Callbacks declared beside their functions, registered on each app that asks.

Dash's own ``@dash.callback`` puts a callback in a process-wide list that the first app to serve a
request takes whole; with several apps in one process (tests, a standalone app beside a mounted one)
the others would get none. A page declares its callbacks on a :class:`CallbackSet` instead, with the
same arguments ``@dash.callback`` takes, and its ``register(app)`` hands them to ``app.callback``: each
app gets each callback once, and the functions stay plain module-level functions (unit-testable).

A polling callback also takes ``paced=Paced("<its dcc.Interval's id>")`` (see :class:`Paced`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import dash
from dash import Input, Output

from dashboard.context import CONFIG_KEY, DashboardConfig

F = TypeVar("F", bound=Callable[..., Any])

BUSY_POLL_MS = 30_000
"""The period of a page's timer while one of its refreshes is under way."""

_HOLD_JS = f"function(_) {{ return {BUSY_POLL_MS}; }}"


@dataclass(frozen=True)
class Paced:
    """``paced=Paced(interval_id)``: the timer ``interval_id`` waits while the callback runs.

    Dash drops the reply of a callback that fires again before it answered (plotly/dash#941), so a
    page whose refresh takes longer than its period (a busy controller, a big job) would never draw
    at all: every tick would cancel the refresh under way. When ``trigger`` (the timer's tick by
    default) fires the callback, a clientside callback sets the timer's period to
    :data:`BUSY_POLL_MS` at once, in the browser; the callback's reply sets the app's period back
    (one more output, added at registration), counted from the reply. A reply that never comes (the
    server unreachable, or failing) leaves the slow period, so the page still retries, every
    :data:`BUSY_POLL_MS`. A reply for a page the user has left goes nowhere, as any output does.
    """

    interval_id: str
    trigger: tuple[str, str] | None = None
    """``(component id, property)`` whose change starts the callback; ``None``: the timer's tick."""

    def hold(self, first: bool) -> tuple[Output, Input]:
        """Output and input of the clientside callback that slows the timer when the callback starts;
        the ``first`` of a timer's holds owns its period, the others write it as duplicates."""
        trigger = self.trigger or (self.interval_id, "n_intervals")
        return Output(self.interval_id, "interval", allow_duplicate=not first), Input(*trigger)


def _paced(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], paced: Paced,
           refresh_ms: int) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``fn``, its outputs and its options with the timer's period added as its last output."""
    last = max(i for i, a in enumerate(args) if isinstance(a, Output) or
               (isinstance(a, list) and a and all(isinstance(o, Output) for o in a)))
    args = (*args[:last + 1], Output(paced.interval_id, "interval", allow_duplicate=True), *args[last + 1:])
    if not kwargs.get("prevent_initial_call"):
        kwargs = {**kwargs, "prevent_initial_call": "initial_duplicate"}

    @functools.wraps(fn)
    def reply(*a: Any, **k: Any) -> Any:
        out = fn(*a, **k)
        return [*out, refresh_ms] if isinstance(out, tuple | list) else [out, refresh_ms]

    return reply, args, kwargs


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
        :class:`Paced` callback's reply sets its timer back to the app's period.
        """
        cfg = app.server.config[CONFIG_KEY]
        assert isinstance(cfg, DashboardConfig)
        held: set[str] = set()
        for fn, args, kwargs in self._declared:
            paced = kwargs.get("paced")
            if isinstance(paced, Paced):
                kwargs = {k: v for k, v in kwargs.items() if k != "paced"}
                first, initial = paced.interval_id not in held, not kwargs.get("prevent_initial_call")
                held.add(paced.interval_id)
                # The hold runs when the callback does: on the page's load too, unless the callback does not.
                app.clientside_callback(_HOLD_JS, *paced.hold(first), prevent_initial_call=(
                    True if not initial else None if first else "initial_duplicate"))
                fn, args, kwargs = _paced(fn, args, kwargs, paced, cfg.refresh_ms)
            app.callback(*args, **kwargs)(fn)
