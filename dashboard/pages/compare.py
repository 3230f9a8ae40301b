"""Compare jobs: loss against step, against wall time and against bits sent, one trace per job.

Pick jobs in the multi-select (or open ``/compare?jobs=a,b``); each job's curve is labelled
``name (optimizer)``. Per-step loss, time and wire bytes come from the job overview
(``GET /jobs/{id}/overview``); bits sent are the cumulative wire bytes x 8
(:func:`dashboard.compare_views.cumulative_bits`). ``compare-link`` is a link to the current selection. Component ids start with ``compare-``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, callback, dcc, html

from controller.client import ApiError
from controller.schemas import JobOverviewPublic, JobPublic
from dashboard import compare_views, plotting
from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.tables import error_banner

dash.register_page(__name__, path="/compare", name="Compare", title="Vigil - compare", order=3)

JOBS_LIMIT = 200
"""Jobs offered in the picker (newest first)."""
OVERVIEW_POINTS = 5000

_GRAPH_STYLE = {"height": "420px"}
_GRAPH_CONFIG = {"displaylogo": False}
GRAPH_IDS = ("compare-loss-step", "compare-loss-time", "compare-loss-bits")
"""One per :data:`dashboard.compare_views.COMPARE_AXES`, in order."""


def layout(jobs: str | None = None, **kwargs: Any) -> html.Div:
    """The picker (preselected from ``?jobs=``) and the three figures; :func:`refresh_compare` fills them."""
    selected = compare_views.parse_job_ids(jobs)
    graphs = [
        dbc.Col(dcc.Graph(id=gid, figure=plotting.empty_figure(title, "pick jobs to compare"), style=_GRAPH_STYLE,
                          config=_GRAPH_CONFIG), lg=4, md=12)
        for gid, (_, title, _) in zip(GRAPH_IDS, compare_views.COMPARE_AXES, strict=True)
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


def _option(job: JobPublic) -> dict[str, str]:
    return {"label": f"{compare_views.job_label(job)} · {job.id} · {job.status.value}", "value": job.id}


@callback(
    Output("compare-jobs", "options"),
    *[Output(gid, "figure") for gid in GRAPH_IDS],
    Output("compare-link", "href"),
    Output("compare-error", "children"),
    Input("compare-interval", "n_intervals"),
    Input("compare-jobs", "value"),
)
def refresh_compare(_n: int, selected: list[str] | str | None) -> tuple[Any, ...]:
    cfg = current_config()
    ids = compare_views.parse_job_ids(selected)
    link = f"{cfg.prefix}compare" + (f"?jobs={quote(','.join(ids), safe=',')}" if ids else "")
    entries: list[tuple[JobPublic, JobOverviewPublic | None]] = []
    problems: list[str] = []
    try:
        with open_client() as client:
            listed = client.list_jobs(limit=JOBS_LIMIT).data
            known = {j.id: j for j in listed}
            for job_id in ids:
                try:
                    job = known.get(job_id) or client.get_job(job_id)
                except ApiError as exc:
                    problems.append(f"{job_id}: {'no such job' if exc.status_code == 404 else describe_error(exc)}")
                    continue
                known.setdefault(job.id, job)
                try:
                    overview = client.job_overview(job_id, max_points=OVERVIEW_POINTS)
                except FETCH_ERRORS as exc:
                    problems.append(f"{job_id}: {describe_error(exc)}")
                    overview = None
                entries.append((job, overview))
    except FETCH_ERRORS as exc:
        keep = dash.no_update
        return (keep, keep, keep, keep, link, error_banner(describe_error(exc), "compare-error-text"))
    # The picker offers the listed jobs, and keeps any selected one that is older than the list.
    options = [_option(j) for j in listed] + [_option(j) for j, _ in entries if j.id not in {x.id for x in listed}]
    figures = compare_views.compare_figures(compare_views.compare_traces(entries))
    error = error_banner("; ".join(problems), "compare-error-text") if problems else None
    return (options, *figures, link, error)
