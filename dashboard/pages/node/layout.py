"""The node page's skeleton: header, actions (:func:`dashboard.actions.node_actions_panel`), the history
figures (:data:`GRAPHS`), ranks and incidents."""

from __future__ import annotations

from typing import Any

from dash import dcc, html

from dashboard.actions import node_actions_panel
from dashboard.context import current_config
from dashboard.figures.base import graph
from dashboard.pages.node.figures import (
    node_gpu_figure,
    node_load_figure,
    node_network_figure,
    node_nic_errors_figure,
    node_utilisation_figure,
)

GRAPHS = (
    ("util", "CPU, memory, disk", node_utilisation_figure),
    ("load", "Load average", node_load_figure),
    ("net", "Network", node_network_figure),
    ("nic-errors", "NIC errors and drops", node_nic_errors_figure),
    ("gpu", "GPUs", node_gpu_figure),
)
"""(id suffix, title, builder) of the page's figures, in order."""


def _graph(name: str, title: str) -> dcc.Graph:
    return graph(f"node-detail-{name}", title, "320px")


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
