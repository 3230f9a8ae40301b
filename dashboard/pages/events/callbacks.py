"""The events list's callback: the newest events, refreshed every tick."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.pages.events.tables import events_table
from dashboard.registry import CallbackSet, Paced
from dashboard.tables import error_banner

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""

EVENTS_LIMIT = 200


@callback(
    Output("events-table", "children"),
    Output("events-error", "children"),
    Input("events-interval", "n_intervals"),
    paced=Paced("events-interval"),
)
def refresh_events(_n: int) -> tuple[Any, Any]:
    cfg = current_config()
    try:
        with open_client() as client:
            events = client.list_events(limit=EVENTS_LIMIT)
    except FETCH_ERRORS as exc:
        return dash.no_update, error_banner(describe_error(exc), "events-error-text")
    return events_table(events, cfg.prefix), None

