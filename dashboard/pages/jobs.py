"""Jobs list: every job with its status, optimizer, size, progress and last loss.

Component ids start with ``jobs-``.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, callback, dcc, html

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner, jobs_table

dash.register_page(__name__, path="/", name="Jobs", title="Vigil - jobs", order=0)

JOBS_LIMIT = 200


def layout(**kwargs: Any) -> html.Div:
    """A skeleton; the table is filled (and refreshed) by :func:`refresh_jobs`."""
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


@callback(
    Output("jobs-table", "children"),
    Output("jobs-count", "children"),
    Output("jobs-error", "children"),
    Input("jobs-interval", "n_intervals"),
)
def refresh_jobs(_n: int) -> tuple[Any, Any, Any]:
    cfg = current_config()
    try:
        with open_client() as client:
            jobs = client.list_jobs(limit=JOBS_LIMIT)
    except FETCH_ERRORS as exc:
        # Keep the last table on screen; say why it is stale.
        return dash.no_update, dash.no_update, error_banner(describe_error(exc), "jobs-error-text")
    shown = len(jobs.data)
    count = f"{shown} of {jobs.count} jobs" if jobs.count > shown else f"{jobs.count} jobs"
    return jobs_table(jobs, cfg.prefix), count, None
