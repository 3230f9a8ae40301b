"""Node detail: a node's host metrics over time, its ranks and incidents, and evict / readmit.

Figures (CPU / memory / disk, load, network rx/tx, NIC errors and drops, and GPUs when the node has
them) come from the node's history (``GET /nodes/{id}/history``); state, ranks and heartbeat from the
node list; incidents from ``GET /incidents`` filtered to the node. Builders in :mod:`dashboard.pages.node.figures` and :mod:`dashboard.pages.node.tables`;
actions in :mod:`dashboard.actions` (``actions-node-*``). Component ids start with ``node-detail-``.
A node the controller does not know shows "node not found".
"""

from __future__ import annotations

import dash

from dashboard.pages.node.callbacks import callback
from dashboard.pages.node.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(
        __name__,
        path_template="/nodes/<node_id>",
        name="Node",
        title=lambda node_id=None, **_: f"Vigil - node {node_id}" if node_id else "Vigil - node",
        order=3,
        layout=layout,
    )
    callback.register(app)
