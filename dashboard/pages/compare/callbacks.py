"""The compare page's callback: the picker's options and the three figures for the jobs selected."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
from dash import Input, Output

from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.pages.compare.figures import compare_figures, compare_traces, job_label, parse_job_ids
from dashboard.pages.compare.layout import GRAPH_IDS
from dashboard.registry import CallbackSet, Paced
from dashboard.tables import error_banner
from vigil.contract.client import ApiError
from vigil.contract.schemas import JobOverviewPublic, JobPublic

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""

JOBS_LIMIT = 200
"""Jobs offered in the picker (newest first)."""
OVERVIEW_POINTS = 5000


def _option(job: JobPublic) -> dict[str, str]:
    return {"label": f"{job_label(job)} · {job.id} · {job.status.value}", "value": job.id}


@callback(
    Output("compare-jobs", "options"),
    *[Output(gid, "figure") for gid in GRAPH_IDS],
    Output("compare-link", "href"),
    Output("compare-error", "children"),
    Input("compare-interval", "n_intervals"),
    Input("compare-jobs", "value"),
    paced=Paced("compare-interval"),
)
def refresh_compare(_n: int, selected: list[str] | str | None) -> tuple[Any, ...]:
    cfg = current_config()
    ids = parse_job_ids(selected)
    link = f"{cfg.prefix}compare" + (f"?jobs={quote(','.join(ids), safe=',')}" if ids else "")
    entries: list[tuple[JobPublic, JobOverviewPublic | None]] = []
    problems: list[str] = []
    unreadable: dict[str, str] = {}
    try:
        with open_client() as client:
            listed = client.list_jobs(limit=JOBS_LIMIT).data
            known = {j.id: j for j in listed}
            for job_id in ids:
                try:
                    job = known.get(job_id) or client.get_job(job_id)
                except ApiError as exc:
                    unreadable[job_id] = "no such job" if exc.status_code == 404 else describe_error(exc)
                    problems.append(f"{job_id}: {unreadable[job_id]}")
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
    # The picker offers the listed jobs, and keeps any selected one that is older than the list. A selected
    # id it could not read stays too, disabled and saying why: the dropdown drops a value missing from its
    # options, which would run this again without it and clear the error naming it.
    options = [_option(j) for j in listed] + [_option(j) for j, _ in entries if j.id not in {x.id for x in listed}]
    options += [{"label": f"{job_id} · {why}", "value": job_id, "disabled": True} for job_id, why in unreadable.items()]
    figures = compare_figures(compare_traces(entries))
    error = error_banner("; ".join(problems), "compare-error-text") if problems else None
    return (options, *figures, link, error)

