"""The jobs list's callback: the table refreshed every tick."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.pages.jobs.tables import jobs_table
from dashboard.registry import CallbackSet, Paced
from dashboard.tables import error_banner

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""

JOBS_LIMIT = 200


@callback(
    Output("jobs-table", "children"),
    Output("jobs-count", "children"),
    Output("jobs-error", "children"),
    Input("jobs-interval", "n_intervals"),
    paced=Paced("jobs-interval"),
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

