"""Nodes: the fleet at a glance, one grid row per node (dash-ag-grid: sort, filter, resize).

Each row: state, heartbeat age, ranks, CPU / memory / disk bars, the 1-minute load, NIC rx/tx rates
with sparklines of their recent history, NIC errors and drops, and GPU / InfiniBand columns when some
node has them. A node's id links to its page (``/nodes/<id>``). Rows and columns are built by
:mod:`dashboard.fleet`; component ids start with ``nodes-``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
import dash_ag_grid as dag
from dash import Input, Output, State, callback, dcc, html

from controller.schemas import NodeHistoryPublic
from dashboard import fleet
from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner

log = logging.getLogger(__name__)

dash.register_page(__name__, path="/nodes", name="Nodes", title="Vigil - nodes", order=2)

SPARK_WINDOW_S = 600.0
"""The sparklines show this much recent history."""
SPARK_MAX_NODES = 64
"""Histories are fetched for at most this many nodes per refresh (one request each); the others'
rows have no sparkline."""


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; :func:`refresh_nodes` fills and refreshes the grid."""
    return html.Div(
        [
            html.H2("Nodes"),
            dcc.Interval(id="nodes-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="nodes-error"),
            html.Div("loading…", id="nodes-summary", className="text-muted mb-2"),
            dag.AgGrid(
                id="nodes-grid",
                columnDefs=fleet.fleet_columns([]),
                rowData=[],
                getRowId="params.data.id",
                defaultColDef={"sortable": True, "filter": True, "resizable": True},
                dashGridOptions={
                    "domLayout": "autoHeight",
                    "tooltipShowDelay": 300,
                    "animateRows": False,
                    # A few dozen columns at most: render them all (tests and find-in-page see every cell).
                    "suppressColumnVirtualisation": True,
                },
                style={"width": "100%"},
            ),
        ]
    )


def _histories(client: Any, node_ids: list[str]) -> dict[str, NodeHistoryPublic | None]:
    """Recent history of each node, for the sparklines; a node whose history cannot be read has none
    (the grid still shows its current values)."""
    since = time.time() - SPARK_WINDOW_S
    out: dict[str, NodeHistoryPublic | None] = {}
    for node_id in node_ids[:SPARK_MAX_NODES]:
        try:
            out[node_id] = client.node_history(node_id, since_ts=since, max_points=fleet.SPARK_POINTS)
        except FETCH_ERRORS as exc:
            log.debug("no history for %s: %s", node_id, describe_error(exc))
            out[node_id] = None
    return out


@callback(
    Output("nodes-grid", "rowData"),
    Output("nodes-grid", "columnDefs"),
    Output("nodes-summary", "children"),
    Output("nodes-error", "children"),
    Input("nodes-interval", "n_intervals"),
    State("nodes-grid", "columnDefs"),
)
def refresh_nodes(_n: int, columns: list[dict[str, Any]] | None) -> tuple[Any, Any, Any, Any]:
    cfg = current_config()
    try:
        with open_client() as client:
            nodes = client.list_nodes()
            histories = _histories(client, [n.id for n in nodes.data])
    except FETCH_ERRORS as exc:
        keep = dash.no_update
        return keep, keep, keep, error_banner(describe_error(exc), "nodes-error-text")
    rows = fleet.fleet_rows(nodes.data, histories, cfg.prefix)
    new_columns = fleet.fleet_columns(rows)
    # New column definitions would reset the user's sorting and widths: send them only when they change.
    return rows, new_columns if new_columns != columns else dash.no_update, fleet.fleet_summary(nodes.data), None
