"""The nodes page's callback: every node's row (with sparklines of its recent NIC rates) each tick."""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import Input, Output, State

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.pages.nodes.tables import SPARK_POINTS, fleet_columns, fleet_rows, fleet_summary
from dashboard.registry import CallbackSet, Paced
from dashboard.tables import error_banner
from vigil.contract.schemas import NodeHistoryPublic

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""

log = logging.getLogger(__name__)

SPARK_WINDOW_S = 600.0
"""The sparklines show this much recent history."""
SPARK_MAX_NODES = 64
"""Histories are fetched for at most this many nodes per refresh (one request each); the others'
rows have no sparkline."""



def _histories(client: Any, node_ids: list[str]) -> dict[str, NodeHistoryPublic | None]:
    """Recent history of each node, for the sparklines; a node whose history cannot be read has none
    (the grid still shows its current values)."""
    since = time.time() - SPARK_WINDOW_S
    out: dict[str, NodeHistoryPublic | None] = {}
    for node_id in node_ids[:SPARK_MAX_NODES]:
        try:
            out[node_id] = client.node_history(node_id, since_ts=since, max_points=SPARK_POINTS)
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
    paced=Paced("nodes-interval"),
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
    rows = fleet_rows(nodes.data, histories, cfg.prefix)
    new_columns = fleet_columns(rows)
    # New column definitions would reset the user's sorting and widths: send them only when they change.
    return rows, new_columns if new_columns != columns else dash.no_update, fleet_summary(nodes.data), None

