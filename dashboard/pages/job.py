"""Job detail as a diagnosis: a header (status, progress, ETA, restarts, the incident under way), then
one tab per question:

* **Training**: loss (train and validation) and throughput against step, with the job's restarts,
  evictions, incidents, checkpoints and faults marked on the x axis (click one: its details);
* **Ranks**: step time percentiles over ranks (p50..p90 band, max with its rank), the binned
  rank x step heatmap, the slowest ranks (stragglers highlighted), one line per rank for jobs of at
  most 8 ranks; click a rank for its breakdown;
* **Step breakdown**: data / forward+backward / optimizer / communication / waiting, stacked per
  step (job-wide or the selected rank) and per rank;
* **Communication**: per kind of collective, p50/max time, wait vs transfer, achieved bandwidth,
  and wire bits per parameter per step by tag; kinds whose bytes are estimated (captured from torch's
  Flight Recorder) marked ``(est.)``, with a line saying why;
* **Incidents**: each with its timeline, action and evidence; a hang's place in the collectives (who
  waits where, who never entered; one row per rank) above its grouped py-spy stacks with the odd
  rank's against the majority's;
* **Checkpoints**: valid / invalid (and why), size, which one each restart restored;
* **Goodput**: productive time against the time lost per cause, and the ETTR;
* **Events**: the job's recent events.

Refreshing: every tick, :func:`refresh_job` reads the job and the overview's steps *after* the
newest one drawn (``since_step``, the page's cursor in ``job-detail-cursor``) and extends the line
figures with ``dash.Patch`` (a full rebuild on first load, after a restart, or when they grew too
long: :mod:`dashboard.job_views`). :func:`refresh_tab` then fetches and rebuilds the open tab's views
only (heavy reads, the heatmap, step breakdowns, collectives, only while their tab is open). Polling
stops once the job is terminal; a job the controller does not know (404) shows "job not found".

Component ids start with ``job-detail-``. ``job-detail-actions`` in the header holds the job's action
buttons (:func:`dashboard.actions.job_actions_panel`: cancel, recover, inject a fault; a signed-in user
or admin only), outside what the polling callback re-renders, so an open confirmation survives a refresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, State, callback, ctx, dcc, html

from controller.client import ApiError, VigilClient
from controller.schemas import IncidentKind
from dashboard import (
    breakdown_figures,
    collective_figures,
    collectives_view,
    job_views,
    plotting,
    rank_figures,
    recovery_figures,
    training_figures,
)
from dashboard.actions import job_actions_panel
from dashboard.context import FETCH_ERRORS, current_config, describe_error, open_client
from dashboard.incident_views import incident_card
from dashboard.job_grids import (
    CHECKPOINT_COLUMNS,
    COLLECTIVE_COLUMNS,
    EVENT_GRID_COLUMNS,
    SLOWEST_COLUMNS,
    checkpoint_rows,
    collective_rows,
    event_rows,
    grid,
    slowest_rank_rows,
)
from dashboard.job_panels import Vitals, goodput_summary, job_header, marker_detail, rank_detail
from dashboard.job_views import Cursor
from dashboard.tables import ROW_STYLE, error_banner

dash.register_page(
    __name__,
    path_template="/jobs/<job_id>",
    name="Job",
    title=lambda job_id=None, **_: f"Vigil - job {job_id}" if job_id else "Vigil - job",
    order=1,
)

NOT_FOUND_TEXT = "job not found"
EVENTS_LIMIT = 100
CHECKPOINT_EVENTS_LIMIT = 1000
"""Events read to find why checkpoints were invalid (the newest; the endpoint has no kind filter)."""
WINDOW_STEPS = 100
"""The breakdown, collectives and per-rank lines cover the newest this many steps."""
TOP_K = 10
"""Slowest ranks listed."""
RANK_WINDOW = 50
"""Steps over which the slowest ranks are ranked."""
HEATMAP_RANKS = 128
HEATMAP_STEPS = 200
"""The heatmap's bins at most (the controller bins wider jobs): ~25k cells, ~200 kB."""
HEATMAP_BIG_JOB = 2048
"""Above this many ranks the heatmap (whose cost grows with ranks x steps: ~1.2 s at 10,000 x 200 here)
is redrawn on every ``SLOW_REFRESH_EVERY``-th tick only, and when the tab is opened."""
SLOW_REFRESH_EVERY = 5
"""Without new steps, the open tab is still refreshed every this many ticks (incidents, goodput move)."""

TABS = ("training", "ranks", "breakdown", "communication", "incidents", "checkpoints", "goodput", "events")
_GRAPH_STYLE = {"height": "380px"}
_GRAPH_CONFIG = {"displaylogo": False}
_COL = {"flex": "1 1 520px", "minWidth": 0}


def _graph(name: str, title: str, height: str | None = None) -> dcc.Graph:
    return dcc.Graph(id=f"job-detail-{name}", figure=plotting.empty_figure(title),
                     style={**_GRAPH_STYLE, **({"height": height} if height else {})}, config=_GRAPH_CONFIG)


def _row(*children: Any) -> dbc.Row:
    return dbc.Row([dbc.Col(c, style=_COL) for c in children], style=ROW_STYLE)


def _tab(label: str, value: str, children: list[Any]) -> dcc.Tab:
    return dcc.Tab(label=label, value=value, id=f"job-detail-tab-{value}",
                   children=html.Div(children, style={"paddingTop": "8px"}))


def _tabs() -> dcc.Tabs:
    return dcc.Tabs(
        id="job-detail-tabs",
        value="training",
        children=[
            _tab("Training", "training", [
                _row(_graph("loss", "Loss"), _graph("throughput", "Throughput")),
                html.Div(id="job-detail-marker-detail", children=marker_detail(None), style={"padding": "6px"}),
            ]),
            _tab("Ranks", "ranks", [
                _row(_graph("step-time", "Step time"), _graph("heatmap", "Step time per rank")),
                html.Div(_graph("rank-lines", "Step time per rank"), id="job-detail-rank-lines-box",
                         style={"display": "none"}),
                html.H4("Slowest ranks"),
                grid("job-detail-slowest", SLOWEST_COLUMNS, row_id="rank", highlight="params.data.flag"),
                _graph("rank-breakdown", "Step breakdown of the selected rank", height="320px"),
            ]),
            _tab("Step breakdown", "breakdown", [
                _row(_graph("breakdown-step", "Step breakdown"), _graph("breakdown-rank", "Time per rank")),
            ]),
            _tab("Communication", "communication", [
                html.Div(id="job-detail-coll-note"),
                _row(_graph("coll-time", "Time in collectives"), _graph("coll-wait", "Wait vs transfer")),
                _row(_graph("coll-bandwidth", "Achieved bandwidth"), _graph("coll-bits", "Bits per parameter")),
                grid("job-detail-collectives", COLLECTIVE_COLUMNS, row_id="kind"),
            ]),
            _tab("Incidents", "incidents", [
                _graph("incident-timeline", "Incidents", height="260px"),
                html.Div(id="job-detail-incidents"),
            ]),
            _tab("Checkpoints", "checkpoints", [
                _graph("checkpoint-figure", "Checkpoints", height="320px"),
                grid("job-detail-checkpoints", CHECKPOINT_COLUMNS, row_id="id", highlight="params.data.valid === 'NO'"),
            ]),
            _tab("Goodput", "goodput", [
                _row(html.Div(id="job-detail-goodput", children=goodput_summary(None)),
                     _graph("goodput-figure", "Goodput")),
            ]),
            _tab("Events", "events", [grid("job-detail-events", EVENT_GRID_COLUMNS, row_id="id")]),
        ],
    )


def layout(job_id: str | None = None, **kwargs: Any) -> html.Div:
    """Skeleton of the page of ``job_id`` (called with no id by Dash to validate callbacks)."""
    return html.Div(
        [
            dcc.Store(id="job-detail-id", data=job_id),
            dcc.Store(id="job-detail-cursor", data=None),
            dcc.Interval(id="job-detail-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(
                id="job-detail-header",
                children=[
                    html.Div(id="job-detail-summary", children=html.H2(f"Job {job_id or ''}")),
                    html.Div(job_actions_panel(job_id), id="job-detail-actions"),
                ],
            ),
            html.Div(id="job-detail-error"),
            html.Div(
                id="job-detail-body",
                children=[
                    html.Div(
                        [html.B("rank: "),
                         dcc.Input(id="job-detail-rank", type="number", min=0, step=1, debounce=True,
                                   placeholder="all", style={"width": "90px", "marginRight": "10px"}),
                         html.Span(id="job-detail-rank-info", children=rank_detail(None))],
                        style={"margin": "4px 0"},
                    ),
                    _tabs(),
                ],
            ),
        ]
    )


# --------------------------------------------------------------------------------------------------
# Header and the overview's figures: every tick
# --------------------------------------------------------------------------------------------------

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
            ov = client.job_overview(job_id, since_step=job_views.since_step(cursor), top_k=TOP_K,
                                     rank_window=RANK_WINDOW)
            full = job_views.needs_rebuild(cursor, ov)
            if full and cursor is not None and cursor.last_step is not None:
                ov = client.job_overview(job_id, top_k=TOP_K, rank_window=RANK_WINDOW)
            incidents = client.list_incidents(job_id=job_id, limit=5)
    except FETCH_ERRORS as exc:
        error = error_banner(describe_error(exc), "job-detail-error-text")
        return _only(dash.no_update, error, dash.no_update, False)
    new = job_views.advance(cursor, ov, full=full)
    vitals = Vitals(
        eta_s=job_views.eta_seconds(new.recent, job.last_step, job.spec.steps),
        restarts=new.restarts,
        incident=job_views.live_incident(incidents.data),
        ranks=new.ranks or None,
    )
    if full:
        loss, tput, bands = (training_figures.overview_loss_figure(ov),
                             training_figures.overview_throughput_figure(ov),
                             rank_figures.step_time_bands_figure(ov))
    else:
        assert cursor is not None
        loss, tput, bands = job_views.overview_patches(ov, cursor)
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
        slowest_rank_rows(ov.slowest_ranks, rank_figures.STRAGGLER_RATIO),
    )


# --------------------------------------------------------------------------------------------------
# The open tab: only its data is fetched and rebuilt
# --------------------------------------------------------------------------------------------------

TAB_OUTPUTS: dict[str, list[tuple[str, str]]] = {
    "ranks": [("job-detail-heatmap", "figure"), ("job-detail-rank-lines", "figure"),
              ("job-detail-rank-lines-box", "style"), ("job-detail-rank-breakdown", "figure"),
              ("job-detail-rank-info", "children")],
    "breakdown": [("job-detail-breakdown-step", "figure"), ("job-detail-breakdown-rank", "figure")],
    "communication": [("job-detail-coll-time", "figure"), ("job-detail-coll-wait", "figure"),
                      ("job-detail-coll-bandwidth", "figure"), ("job-detail-coll-bits", "figure"),
                      ("job-detail-collectives", "rowData"), ("job-detail-coll-note", "children")],
    "incidents": [("job-detail-incident-timeline", "figure"), ("job-detail-incidents", "children")],
    "checkpoints": [("job-detail-checkpoint-figure", "figure"), ("job-detail-checkpoints", "rowData")],
    "goodput": [("job-detail-goodput", "children"), ("job-detail-goodput-figure", "figure")],
    "events": [("job-detail-events", "rowData")],
}
_TAB_ORDER = [(tab, out) for tab, outs in TAB_OUTPUTS.items() for out in outs]


def _window_start(cursor: Cursor) -> int | None:
    return None if cursor.last_step is None else max(cursor.last_step - WINDOW_STEPS + 1, 0)


def _ranks_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    hot = cursor.stragglers
    ticking = dash.ctx.triggered_id == "job-detail-cursor"
    if ticking and cursor.ranks > HEATMAP_BIG_JOB and cursor.tick % SLOW_REFRESH_EVERY:
        heat = dash.no_update
    else:
        heat = rank_figures.binned_heatmap_figure(
            client.job_heatmap(job_id, max_ranks=HEATMAP_RANKS, max_steps=HEATMAP_STEPS), hot)
    since = _window_start(cursor)
    if 0 < cursor.ranks <= rank_figures.LINES_MAX_RANKS:
        steps = client.job_steps(job_id, since_step=since, max_points=WINDOW_STEPS,
                                 max_ranks=rank_figures.LINES_MAX_RANKS)
        lines, box = rank_figures.rank_lines_figure(steps, hot), {"display": "block"}
    else:
        steps, lines, box = None, dash.no_update, {"display": "none"}
    info = rank_detail(None)
    breakdown = plotting.empty_figure("Step breakdown of the selected rank", "click a rank to see its breakdown")
    if rank is not None:
        own = client.job_steps(job_id, since_step=since, ranks=[rank], max_points=WINDOW_STEPS, max_ranks=1)
        node = own.data[0].node_id if own.data else None
        info = rank_detail(rank, None, node)
        breakdown = breakdown_figures.breakdown_step_figure(own, rank)
    return [heat, lines, box, breakdown, info]


def _breakdown_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    sample = job_views.rank_sample(cursor.ranks, cursor.slowest, include=[rank] if rank is not None else [])
    steps = client.job_steps(job_id, since_step=_window_start(cursor), ranks=sample, max_points=WINDOW_STEPS,
                             max_ranks=job_views.SAMPLE_RANKS + 1)
    sampled = len(steps.data) if sample is not None else None
    return [breakdown_figures.breakdown_step_figure(steps, rank, sampled),
            breakdown_figures.breakdown_rank_figure(steps, cursor.stragglers)]


def _communication_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    coll = client.job_collectives(job_id, since_step=_window_start(cursor), max_points=WINDOW_STEPS)
    stats = collective_figures.collective_stats(coll)
    return [collective_figures.collective_time_figure(stats, job_id),
            collective_figures.collective_wait_figure(stats, job_id),
            collective_figures.collective_bandwidth_figure(stats, job_id),
            collective_figures.bits_per_element_figure(coll),
            collective_rows(stats), collectives_view.estimated_note(coll)]


def _incidents_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    incidents = client.job_incidents(job_id).data
    faults = client.list_faults(job_id).data if incidents else []
    hangs = [i for i in incidents if i.kind == IncidentKind.HANG and i.evidence.get("stack_groups")]
    # The controller keeps the stacks of the newest diagnosed incident: shown with the newest hang.
    stacks = client.job_stacks(job_id) if hangs else None
    newest_hang = hangs[-1].id if hangs else None
    timelines, cards = [], []
    for inc in incidents:
        fault = job_views.cause_fault(inc, faults)
        phases = job_views.incident_phases(inc, fault)
        timelines.append((inc, phases))
        where = collectives_view.hang_collectives_view(inc.evidence, f"job-detail-hang-collectives-{inc.id}")
        cards.append(incident_card(inc, phases, fault, stacks if inc.id == newest_hang else None, where))
    body = list(reversed(cards)) or [html.Div("no incidents", style={"color": "#888"})]
    return [recovery_figures.incident_timeline_figure(timelines), body]


def _checkpoints_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    ckpts = client.job_checkpoints(job_id).data
    events = client.list_events(job_id=job_id, limit=CHECKPOINT_EVENTS_LIMIT).data
    markers = client.job_overview(job_id, since_step=job_views.since_step(cursor), top_k=1).markers
    restores = job_views.restores(markers, ckpts, events)
    reasons = job_views.invalid_reasons(events)
    return [recovery_figures.checkpoint_figure(ckpts, restores, job_id), checkpoint_rows(ckpts, reasons, restores)]


def _goodput_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    gp = client.job_goodput(job_id)
    return [goodput_summary(gp), recovery_figures.goodput_figure(gp)]


def _events_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None) -> list[Any]:
    return [event_rows(client.list_events(job_id=job_id, limit=EVENTS_LIMIT))]


TAB_BUILDERS: dict[str, Callable[[VigilClient, str, Cursor, int | None], list[Any]]] = {
    "ranks": _ranks_tab,
    "breakdown": _breakdown_tab,
    "communication": _communication_tab,
    "incidents": _incidents_tab,
    "checkpoints": _checkpoints_tab,
    "goodput": _goodput_tab,
    "events": _events_tab,
}


@callback(
    [Output(cid, prop) for _, (cid, prop) in _TAB_ORDER],
    Output("job-detail-error", "children", allow_duplicate=True),
    Input("job-detail-cursor", "data"),
    Input("job-detail-tabs", "value"),
    Input("job-detail-rank", "value"),
    State("job-detail-id", "data"),
    prevent_initial_call=True,
)
def refresh_tab(cursor_data: dict[str, Any] | None, tab: str, rank: int | None, job_id: str | None) -> list[Any]:
    out: list[Any] = [dash.no_update] * (len(_TAB_ORDER) + 1)
    cursor = Cursor.from_store(cursor_data, job_id or "")
    build = TAB_BUILDERS.get(tab)
    if cursor is None or build is None or not job_id:
        return out
    rank = int(rank) if isinstance(rank, int | float) and rank >= 0 else None
    try:
        with open_client() as client:
            values = build(client, job_id, cursor, rank)
    except FETCH_ERRORS as exc:
        out[-1] = error_banner(describe_error(exc), "job-detail-error-text")
        return out
    first = next(i for i, (t, _) in enumerate(_TAB_ORDER) if t == tab)
    out[first:first + len(values)] = values
    return out


# --------------------------------------------------------------------------------------------------
# Clicks: a rank -> its breakdown; a marker -> its details
# --------------------------------------------------------------------------------------------------


@callback(
    Output("job-detail-rank", "value"),
    Input("job-detail-heatmap", "clickData"),
    Input("job-detail-step-time", "clickData"),
    Input("job-detail-rank-lines", "clickData"),
    Input("job-detail-breakdown-rank", "clickData"),
    Input("job-detail-slowest", "cellClicked"),
    State("job-detail-cursor", "data"),
    prevent_initial_call=True,
)
def select_rank(heat: Any, bands: Any, lines: Any, per_rank: Any, cell: Any, cursor_data: Any) -> Any:
    slowest = (cursor_data or {}).get("slowest") or []
    trigger = ctx.triggered_id
    if trigger == "job-detail-slowest":
        rank = cell.get("rowId") if isinstance(cell, dict) else None
        return int(rank) if rank is not None and str(rank).isdigit() else dash.no_update
    click = {"job-detail-heatmap": heat, "job-detail-step-time": bands, "job-detail-rank-lines": lines,
             "job-detail-breakdown-rank": per_rank}.get(str(trigger))
    rank = job_views.clicked_rank(click, slowest)
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
