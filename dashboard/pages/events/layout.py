"""The events list's skeleton."""

from __future__ import annotations

from typing import Any

from dash import dcc, html

from dashboard.context import current_config


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; :func:`dashboard.pages.events.callbacks.refresh_events` fills and refreshes the list."""
    return html.Div(
        [
            html.H2("Events"),
            dcc.Interval(id="events-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="events-error"),
            html.Div(id="events-table", children=html.Div("loading…", style={"color": "#888"})),
        ]
    )
