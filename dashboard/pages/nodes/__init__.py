"""Nodes: the fleet at a glance, one grid row per node (dash-ag-grid: sort, filter, resize).

Each row: state, heartbeat age, ranks, CPU / memory / disk bars, the 1-minute load, NIC rx/tx rates
with sparklines of their recent history, NIC errors and drops, and GPU / InfiniBand columns when some
node has them. A node's id links to its page (``/nodes/<id>``). Rows and columns are built by
:mod:`dashboard.pages.nodes.tables`; component ids start with ``nodes-``.
"""

from __future__ import annotations

import dash

from dashboard.pages.nodes.callbacks import callback
from dashboard.pages.nodes.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(__name__, path="/nodes", name="Nodes", title="Vigil - nodes", order=2, layout=layout)
    callback.register(app)
