"""The compare page's skeleton: the job picker, the link to the selection, and the three figures."""

from __future__ import annotations

from typing import Any

import dash_bootstrap_components as dbc
from dash import dcc, html

from dashboard.context import current_config
from dashboard.figures.base import graph
from dashboard.pages.compare.figures import COMPARE_AXES, parse_job_ids

GRAPH_IDS = ("compare-loss-step", "compare-loss-time", "compare-loss-bits")
"""One per :data:`dashboard.pages.compare.figures.COMPARE_AXES`, in order."""


def layout(jobs: str | None = None, **kwargs: Any) -> html.Div:
    """The picker (preselected from ``?jobs=``) and the three figures, which
    :func:`dashboard.pages.compare.callbacks.refresh_compare` fills."""
    selected = parse_job_ids(jobs)
    graphs = [
        dbc.Col(graph(gid, title, "420px", "pick jobs to compare"), lg=4, md=12)
        for gid, (_, title, _) in zip(GRAPH_IDS, COMPARE_AXES, strict=True)
    ]
    return html.Div(
        [
            html.H2("Compare jobs"),
            dcc.Interval(id="compare-interval", interval=current_config().refresh_ms, n_intervals=0),
            dbc.Row(
                [
                    dbc.Col(
                        dcc.Dropdown(
                            id="compare-jobs",
                            options=[{"label": j, "value": j} for j in selected],
                            value=selected,
                            multi=True,
                            placeholder="Pick jobs to compare…",
                        ),
                        md=10,
                    ),
                    dbc.Col(html.A("link to this comparison", id="compare-link", href="#"), md=2,
                            className="d-flex align-items-center"),
                ],
                className="mb-2",
            ),
            html.Div(id="compare-error"),
            dbc.Row(graphs, className="g-2"),
        ]
    )
