"""Job detail: status and spec summary, live loss, step time (lines and a rank x step heatmap),
throughput, and the job's recent events.

Component ids start with ``job-detail-``. The layout is a skeleton holding the job id; the
interval callback fills everything, so a slow or missing controller never blocks the page.
A job the controller does not know (404) shows "job not found" and stops polling.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, callback, dcc, html

from controller.client import ApiError
from dashboard import figures
from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner, events_table, job_summary

dash.register_page(
    __name__,
    path_template="/jobs/<job_id>",
    name="Job",
    title=lambda job_id=None, **_: f"Vigil - job {job_id}" if job_id else "Vigil - job",
    order=1,
)

EVENTS_LIMIT = 50
NOT_FOUND_TEXT = "job not found"

_GRAPH_STYLE = {"height": "360px"}
_GRAPH_CONFIG = {"displaylogo": False}


def _graph(name: str, title: str) -> dcc.Graph:
    return dcc.Graph(
        id=f"job-detail-{name}", figure=figures.empty_figure(title), style=_GRAPH_STYLE, config=_GRAPH_CONFIG
    )


def layout(job_id: str | None = None, **kwargs: Any) -> html.Div:
    """Skeleton of the page of ``job_id`` (called with no id by Dash to validate callbacks)."""
    return html.Div(
        [
            dcc.Store(id="job-detail-id", data=job_id),
            dcc.Interval(id="job-detail-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(id="job-detail-header", children=html.H2(f"Job {job_id or ''}")),
            html.Div(id="job-detail-error"),
            html.Div(
                id="job-detail-body",
                children=[
                    html.Div(
                        [_graph("loss", "Training loss"), _graph("throughput", "Throughput")],
                        style={"display": "grid", "gridTemplateColumns": "1fr 1fr", "gap": "8px"},
                    ),
                    html.Div(
                        [_graph("step-time", "Step time"), _graph("heatmap", "Step time per rank")],
                        style={"display": "grid", "gridTemplateColumns": "1fr 1fr", "gap": "8px"},
                    ),
                    html.H3("Events"),
                    html.Div(id="job-detail-events"),
                ],
            ),
        ]
    )


def _only(header: Any, error: Any, body_style: Any, stop_polling: bool) -> tuple[Any, ...]:
    """Outputs that change header, error line, body visibility and polling; figures and events stay."""
    keep = dash.no_update
    return (header, error, body_style, stop_polling, keep, keep, keep, keep, keep)


def _not_found(job_id: str | None) -> tuple[Any, ...]:
    header = html.Div(
        [
            html.H2(NOT_FOUND_TEXT, id="job-detail-not-found"),
            html.P(f"The controller has no job {job_id!r}."),
        ]
    )
    return _only(header, None, {"display": "none"}, True)


@callback(
    Output("job-detail-header", "children"),
    Output("job-detail-error", "children"),
    Output("job-detail-body", "style"),
    Output("job-detail-interval", "disabled"),
    Output("job-detail-loss", "figure"),
    Output("job-detail-throughput", "figure"),
    Output("job-detail-step-time", "figure"),
    Output("job-detail-heatmap", "figure"),
    Output("job-detail-events", "children"),
    Input("job-detail-interval", "n_intervals"),
    State("job-detail-id", "data"),
)
def refresh_job(_n: int, job_id: str | None) -> tuple[Any, ...]:
    if not job_id:
        return _not_found(job_id)
    cfg = current_config()
    try:
        with open_client() as client:
            job = client.get_job(job_id)
            metrics = client.job_metrics(job_id)
            events = client.list_events(job_id=job_id, limit=EVENTS_LIMIT)
    except FETCH_ERRORS as exc:
        if isinstance(exc, ApiError) and exc.status_code == 404:
            return _not_found(job_id)
        error = error_banner(describe_error(exc), "job-detail-error-text")
        return _only(dash.no_update, error, dash.no_update, False)
    # A finished job's data no longer changes: stop polling it.
    done = job.status.is_terminal()
    return (
        job_summary(job),
        None,
        {"display": "block"},
        done,
        figures.loss_figure(metrics),
        figures.throughput_figure(metrics),
        figures.step_time_figure(metrics),
        figures.step_time_heatmap(metrics),
        events_table(events, cfg.prefix),
    )
