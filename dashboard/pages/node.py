"""Node detail: a node's host metrics over time, its ranks and incidents, and evict / readmit.

Figures (CPU / memory / disk, load, network rx/tx, NIC errors and drops, and GPUs when the node has
them) come from the node's history (``GET /nodes/{id}/history``); state, ranks and heartbeat from the
node list; incidents from ``GET /incidents`` filtered to the node. Builders in :mod:`dashboard.node_views`;
actions in :mod:`dashboard.actions` (``actions-node-*``). Component ids start with ``node-detail-``.
A node the controller does not know shows "node not found".
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, callback, dcc, html

from dashboard import node_views, plotting
from dashboard.actions import node_actions_panel
from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner

dash.register_page(
    __name__,
    path_template="/nodes/<node_id>",
    name="Node",
    title=lambda node_id=None, **_: f"Vigil - node {node_id}" if node_id else "Vigil - node",
    order=3,
)

HISTORY_POINTS = 500
INCIDENTS_LIMIT = 500
"""Newest incidents fetched (of every node) to find this node's."""
NOT_FOUND_TEXT = "node not found"

_GRAPH_STYLE = {"height": "320px"}
_GRAPH_CONFIG = {"displaylogo": False}
GRAPHS = (
    ("util", "CPU, memory, disk", node_views.node_utilisation_figure),
    ("load", "Load average", node_views.node_load_figure),
    ("net", "Network", node_views.node_network_figure),
    ("nic-errors", "NIC errors and drops", node_views.node_nic_errors_figure),
    ("gpu", "GPUs", node_views.node_gpu_figure),
)
"""(id suffix, title, builder) of the page's figures, in order."""


def _graph(name: str, title: str) -> dcc.Graph:
    return dcc.Graph(id=f"node-detail-{name}", figure=plotting.empty_figure(title), style=_GRAPH_STYLE,
                     config=_GRAPH_CONFIG)


def layout(node_id: str | None = None, **kwargs: Any) -> html.Div:
    """Skeleton of the page of ``node_id`` (called with no id by Dash to validate callbacks)."""
    return html.Div(
        [
            dcc.Store(id="node-detail-id", data=node_id),
            dcc.Interval(id="node-detail-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="node-detail-header", children=html.H2(f"Node {node_id or ''}")),
            html.Div(node_actions_panel(node_id), id="node-detail-actions"),
            html.Div(id="node-detail-error"),
            html.Div(
                id="node-detail-body",
                children=[
                    html.Div([_graph(name, title) for name, title, _ in GRAPHS[:2]], className="vigil-grid-2"),
                    html.Div([_graph(name, title) for name, title, _ in GRAPHS[2:4]], className="vigil-grid-2"),
                    html.Div(_graph("gpu", "GPUs"), id="node-detail-gpu-row", style={"display": "none"}),
                    html.H3("Ranks", className="h5 mt-3"),
                    html.Div(id="node-detail-ranks"),
                    html.H3("Incidents", className="h5 mt-3"),
                    html.Div(id="node-detail-incidents"),
                ],
            ),
        ]
    )


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
        gpu_style = {"display": "block"} if node_views.history_has_gpu(history) else {"display": "none"}
    error = error_banner("; ".join(errors), "node-detail-error-text") if errors else None
    return (
        node_views.node_facts(node),
        error,
        {"display": "block"},
        False,
        *figures,
        gpu_style,
        node_views.ranks_table(node.ranks, cfg.prefix),
        node_views.incidents_table(incidents, cfg.prefix) if incidents is not None else dash.no_update,
    )

