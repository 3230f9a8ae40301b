"""The node page's callback: its state, history figures, ranks and incidents every tick."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, html

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.pages.node.figures import history_has_gpu
from dashboard.pages.node.layout import GRAPHS
from dashboard.pages.node.tables import incidents_table, node_facts, ranks_table
from dashboard.registry import CallbackSet, Paced
from dashboard.tables import error_banner

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""

HISTORY_POINTS = 500
INCIDENTS_LIMIT = 500
"""Newest incidents fetched (of every node) to find this node's."""
NOT_FOUND_TEXT = "node not found"


def _not_found(node_id: str | None) -> tuple[Any, ...]:
    header = html.Div([html.H2(NOT_FOUND_TEXT, id="node-detail-not-found"),
                       html.P(f"The controller has no node {node_id!r}.")])
    keep = dash.no_update
    return (header, None, {"display": "none"}, True, keep, keep, keep, keep, keep, keep, keep, keep)


@callback(
    Output("node-detail-header", "children"),
    Output("node-detail-error", "children"),
    Output("node-detail-body", "style"),
    Output("node-detail-interval", "disabled"),
    *[Output(f"node-detail-{name}", "figure") for name, _, _ in GRAPHS],
    Output("node-detail-gpu-row", "style"),
    Output("node-detail-ranks", "children"),
    Output("node-detail-incidents", "children"),
    Input("node-detail-interval", "n_intervals"),
    State("node-detail-id", "data"),
    paced=Paced("node-detail-interval"),
)
def refresh_node(_n: int, node_id: str | None) -> tuple[Any, ...]:
    if not node_id:
        return _not_found(node_id)
    cfg = current_config()
    errors: list[str] = []
    try:
        with open_client() as client:
            node = next((n for n in client.list_nodes().data if n.id == node_id), None)
            if node is None:
                return _not_found(node_id)
            try:
                history = client.node_history(node_id, max_points=HISTORY_POINTS)
            except FETCH_ERRORS as exc:  # the page still shows state, ranks and incidents
                history = None
                errors.append(f"history: {describe_error(exc)}")
            try:
                incidents = [i for i in client.list_incidents(limit=INCIDENTS_LIMIT).data if i.node_id == node_id]
            except FETCH_ERRORS as exc:
                incidents = None
                errors.append(f"incidents: {describe_error(exc)}")
    except FETCH_ERRORS as exc:
        keep = dash.no_update
        error = error_banner(describe_error(exc), "node-detail-error-text")
        return (keep, error, keep, False, keep, keep, keep, keep, keep, keep, keep, keep)
    if history is None:  # keep what was drawn rather than blank the figures on a passing failure
        figures: list[Any] = [dash.no_update] * len(GRAPHS)
        gpu_style: Any = dash.no_update
    else:
        figures = [build(history) for _, _, build in GRAPHS]
        gpu_style = {"display": "block"} if history_has_gpu(history) else {"display": "none"}
    error = error_banner("; ".join(errors), "node-detail-error-text") if errors else None
    return (
        node_facts(node),
        error,
        {"display": "block"},
        False,
        *figures,
        gpu_style,
        ranks_table(node.ranks, cfg.prefix),
        incidents_table(incidents, cfg.prefix) if incidents is not None else dash.no_update,
    )

