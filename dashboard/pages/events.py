"""Events: the controller's most recent events (job transitions, incidents, recovery actions).

Component ids start with ``events-``.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, callback, dcc, html

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner, events_table

dash.register_page(__name__, path="/events", name="Events", title="Vigil - events", order=4)

EVENTS_LIMIT = 200


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; :func:`refresh_events` fills and refreshes the list."""
    return html.Div(
        [
            html.H2("Events"),
            dcc.Interval(id="events-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="events-error"),
            html.Div(id="events-table", children=html.Div("loading…", style={"color": "#888"})),
        ]
    )


@callback(
    Output("events-table", "children"),
    Output("events-error", "children"),
    Input("events-interval", "n_intervals"),
)
def refresh_events(_n: int) -> tuple[Any, Any]:
    cfg = current_config()
    try:
        with open_client() as client:
            events = client.list_events(limit=EVENTS_LIMIT)
    except FETCH_ERRORS as exc:
        return dash.no_update, error_banner(describe_error(exc), "events-error-text")
    return events_table(events, cfg.prefix), None
