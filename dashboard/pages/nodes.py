"""Nodes: every node the controller knows, its state, heartbeat age, ranks and host metrics.

Component ids start with ``nodes-``.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, callback, dcc, html

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner, nodes_table

dash.register_page(__name__, path="/nodes", name="Nodes", title="Vigil - nodes", order=2)


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; :func:`refresh_nodes` fills and refreshes the table."""
    return html.Div(
        [
            html.H2("Nodes"),
            dcc.Interval(id="nodes-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="nodes-error"),
            html.Div(id="nodes-table", children=html.Div("loading…", style={"color": "#888"})),
        ]
    )


@callback(
    Output("nodes-table", "children"),
    Output("nodes-error", "children"),
    Input("nodes-interval", "n_intervals"),
)
def refresh_nodes(_n: int) -> tuple[Any, Any]:
    try:
        with open_client() as client:
            nodes = client.list_nodes()
    except FETCH_ERRORS as exc:
        return dash.no_update, error_banner(describe_error(exc), "nodes-error-text")
    return nodes_table(nodes), None
