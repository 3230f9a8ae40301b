"""Callbacks declared beside their functions, registered on each app that asks.

Dash's own ``@dash.callback`` puts a callback in a process-wide list that the first app to serve a
request takes whole; with several apps in one process (tests, a standalone app beside a mounted one)
the others would get none. A page declares its callbacks on a :class:`CallbackSet` instead, with the
same arguments ``@dash.callback`` takes, and its ``register(app)`` hands them to ``app.callback``: each
app gets each callback once, and the functions stay plain module-level functions (unit-testable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import dash

F = TypeVar("F", bound=Callable[..., Any])


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
        """Register every declared callback on ``app`` (``app.callback(*args, **kwargs)(fn)``)."""
        for fn, args, kwargs in self._declared:
            app.callback(*args, **kwargs)(fn)
