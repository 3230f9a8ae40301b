"""The nodes page's skeleton: the fleet grid, empty until the first refresh."""

from __future__ import annotations

from typing import Any

import dash_ag_grid as dag
from dash import dcc, html

from dashboard.context import current_config
from dashboard.pages.nodes.tables import fleet_columns


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; :func:`dashboard.pages.nodes.callbacks.refresh_nodes` fills and refreshes the grid."""
    return html.Div(
        [
            html.H2("Nodes"),
            dcc.Interval(id="nodes-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="nodes-error"),
            html.Div("loading…", id="nodes-summary", className="text-muted mb-2"),
            dag.AgGrid(
                id="nodes-grid",
                columnDefs=fleet_columns([]),
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
