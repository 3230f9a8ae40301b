"""The job page's callbacks: the header and the overview's figures every tick (:func:`refresh_job`),
the open tab when the cursor, the tab or the selected rank changes (:func:`refresh_tab`), and clicks
(a rank: its breakdown; a marker: its details)."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, html

from dashboard.context import FETCH_ERRORS, describe_error, open_client
from dashboard.pages.job.clicks import clicked_rank
from dashboard.pages.job.cursor import Cursor, advance, eta_seconds, needs_rebuild, since_step
from dashboard.pages.job.figures.overview import overview_figures, overview_patches
from dashboard.pages.job.figures.ranks import STRAGGLER_RATIO
from dashboard.pages.job.joins import live_incident
from dashboard.pages.job.panels import Vitals, job_header, marker_detail
from dashboard.pages.job.tables import slowest_rank_rows
from dashboard.pages.job.tabs import RANK_WINDOW, SLOW_REFRESH_EVERY, TAB_BUILDERS, TAB_ORDER, TOP_K
from dashboard.registry import CallbackSet, Paced
from dashboard.tables import error_banner
from vigil.contract.client import ApiError

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""

NOT_FOUND_TEXT = "job not found"
_MAIN_FIGURES = 4  # loss, throughput, step-time bands, slowest-ranks rows


def _only(summary: Any, error: Any, body_style: Any, stop_polling: bool) -> tuple[Any, ...]:
    """Outputs that change header, error line, body visibility and polling; the rest stays."""
    keep = dash.no_update
    return (summary, error, body_style, stop_polling, keep) + (keep,) * _MAIN_FIGURES


def _not_found(job_id: str | None) -> tuple[Any, ...]:
    summary = html.Div(
        [
            html.H2(NOT_FOUND_TEXT, id="job-detail-not-found"),
            html.P(f"The controller has no job {job_id!r}."),
        ]
    )
    return _only(summary, None, {"display": "none"}, True)


@callback(
    Output("job-detail-summary", "children"),
    Output("job-detail-error", "children"),
    Output("job-detail-body", "style"),
    Output("job-detail-interval", "disabled"),
    Output("job-detail-cursor", "data"),
    Output("job-detail-loss", "figure"),
    Output("job-detail-throughput", "figure"),
    Output("job-detail-step-time", "figure"),
    Output("job-detail-slowest", "rowData"),
    Input("job-detail-interval", "n_intervals"),
    State("job-detail-id", "data"),
    State("job-detail-cursor", "data"),
    paced=Paced("job-detail-interval"),
)
def refresh_job(n: int, job_id: str | None, cursor_data: dict[str, Any] | None) -> tuple[Any, ...]:
    if not job_id:
        return _not_found(job_id)
    cursor = Cursor.from_store(cursor_data, job_id)
    try:
        with open_client() as client:
            try:
                job = client.get_job(job_id)
            except ApiError as exc:
                if exc.status_code == 404:
                    return _not_found(job_id)
                raise
            ov = client.job_overview(job_id, since_step=since_step(cursor), top_k=TOP_K,
                                     rank_window=RANK_WINDOW)
            full = needs_rebuild(cursor, ov)
            if full and cursor is not None and cursor.last_step is not None:
                ov = client.job_overview(job_id, top_k=TOP_K, rank_window=RANK_WINDOW)
            incidents = client.list_incidents(job_id=job_id, limit=5)
    except FETCH_ERRORS as exc:
        error = error_banner(describe_error(exc), "job-detail-error-text")
        return _only(dash.no_update, error, dash.no_update, False)
    new = advance(cursor, ov, full=full)
    vitals = Vitals(
        eta_s=eta_seconds(new.recent, job.last_step, job.spec.steps),
        restarts=new.restarts,
        incident=live_incident(incidents.data),
        ranks=new.ranks or None,
    )
    if full:
        loss, tput, bands = overview_figures(ov)
    else:
        assert cursor is not None
        loss, tput, bands = overview_patches(ov, cursor.tail, cursor.tail_sparse, cursor.markers)
    # The open tab refreshes when the cursor changes: on new steps or markers, and every few ticks.
    changed = full or bool(ov.step) or new.markers != (cursor.markers if cursor else -1)
    keep_cursor = not changed and n % SLOW_REFRESH_EVERY != 0
    return (
        job_header(job, vitals),
        None,
        {"display": "block"},
        job.status.is_terminal(),  # a finished job's data no longer changes: stop polling it
        dash.no_update if keep_cursor else new.to_store(),
        loss,
        tput,
        bands,
        slowest_rank_rows(ov.slowest_ranks, STRAGGLER_RATIO),
    )

@callback(
    [Output(cid, prop) for _, (cid, prop) in TAB_ORDER],
    Output("job-detail-error", "children", allow_duplicate=True),
    Input("job-detail-cursor", "data"),
    Input("job-detail-tabs", "value"),
    Input("job-detail-rank", "value"),
    State("job-detail-id", "data"),
    prevent_initial_call=True,
    paced=Paced("job-detail-interval", trigger=("job-detail-cursor", "data")),  # no new cursor cancels it
)
def refresh_tab(cursor_data: dict[str, Any] | None, tab: str, rank: int | None, job_id: str | None) -> list[Any]:
    out: list[Any] = [dash.no_update] * (len(TAB_ORDER) + 1)
    cursor = Cursor.from_store(cursor_data, job_id or "")
    build = TAB_BUILDERS.get(tab)
    if cursor is None or build is None or not job_id:
        return out
    rank = int(rank) if isinstance(rank, int | float) and rank >= 0 else None
    try:
        with open_client() as client:
            values = build(client, job_id, cursor, rank, ctx.triggered_id == "job-detail-cursor")
    except FETCH_ERRORS as exc:
        out[-1] = error_banner(describe_error(exc), "job-detail-error-text")
        return out
    first = next(i for i, (t, _) in enumerate(TAB_ORDER) if t == tab)
    out[first:first + len(values)] = values
    return out

@callback(
    Output("job-detail-rank", "value"),
    Input("job-detail-heatmap", "clickData"),
    Input("job-detail-step-time", "clickData"),
    Input("job-detail-rank-lines", "clickData"),
    Input("job-detail-breakdown-rank", "clickData"),
    Input("job-detail-rank-lost", "clickData"),
    Input("job-detail-slowest", "cellClicked"),
    Input("job-detail-rank-lost-table", "cellClicked"),
    State("job-detail-cursor", "data"),
    prevent_initial_call=True,
)
def select_rank(heat: Any, bands: Any, lines: Any, per_rank: Any, lost: Any, cell: Any, lost_cell: Any,
                cursor_data: Any) -> Any:
    slowest = (cursor_data or {}).get("slowest") or []
    trigger = ctx.triggered_id
    if trigger in ("job-detail-slowest", "job-detail-rank-lost-table"):
        clicked = cell if trigger == "job-detail-slowest" else lost_cell
        rank = clicked.get("rowId") if isinstance(clicked, dict) else None
        return int(rank) if rank is not None and str(rank).isdigit() else dash.no_update
    click = {"job-detail-heatmap": heat, "job-detail-step-time": bands, "job-detail-rank-lines": lines,
             "job-detail-breakdown-rank": per_rank, "job-detail-rank-lost": lost}.get(str(trigger))
    rank = clicked_rank(click, slowest)
    return dash.no_update if rank is None else rank


@callback(
    Output("job-detail-marker-detail", "children"),
    Input("job-detail-loss", "clickData"),
    State("job-detail-id", "data"),
    prevent_initial_call=True,
)
def show_marker(click: Any, job_id: str | None) -> Any:
    point = (click or {}).get("points", [{}])[0]
    marker = point.get("customdata")
    if not isinstance(marker, list) or len(marker) < 5 or not job_id:
        return dash.no_update
    kind, ref = marker[0], marker[3]
    incident = checkpoint = None
    try:
        with open_client() as client:
            # An incident's and a restart's ref is an incident id; a checkpoint's, a checkpoint id.
            if kind in ("incident", "restart") and ref is not None and str(ref).isdigit():
                incident = next((i for i in client.job_incidents(job_id).data if i.id == int(ref)), None)
            elif kind == "checkpoint" and ref is not None:
                checkpoint = next((c for c in client.job_checkpoints(job_id).data if str(c.id) == str(ref)), None)
    except FETCH_ERRORS as exc:
        return html.Div([marker_detail(marker), error_banner(describe_error(exc), "job-detail-marker-error")])
    return marker_detail(marker, incident, checkpoint)

