"""The jobs list's skeleton."""

from __future__ import annotations

from typing import Any

from dash import dcc, html

from dashboard.context import current_config


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; the table is filled (and refreshed) by :func:`dashboard.pages.jobs.callbacks.refresh_jobs`."""
    return html.Div(
        [
            html.Div(
                [html.H2("Jobs", className="me-3 mb-0"),
                 dcc.Link("compare jobs →", href=current_config().href("compare"), id="jobs-compare-link")],
                className="d-flex align-items-baseline mb-2",
            ),
            dcc.Interval(id="jobs-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="jobs-error"),
            html.Div(id="jobs-table", children=html.Div("loading…", style={"color": "#888"})),
            html.Div(id="jobs-count", style={"color": "#888", "fontSize": "12px", "marginTop": "6px"}),
        ]
    )
