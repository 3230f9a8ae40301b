"""What each tab of the job page fetches and builds, only while it is open: one function per tab
(:data:`TAB_BUILDERS`) returning the values of its outputs (:data:`TAB_OUTPUTS`), in order. Each is called
with the client, the job, the page's cursor, the selected rank (None: all) and whether the call is the
periodic refresh (``ticking``: the cursor moved) rather than the user opening the tab or picking a rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dash
from dash import html

from dashboard.figures.base import empty_figure
from dashboard.pages.job.clicks import SAMPLE_RANKS, rank_sample
from dashboard.pages.job.collectives_view import estimated_note, hang_collectives_view
from dashboard.pages.job.cursor import Cursor, since_step
from dashboard.pages.job.figures import breakdown, collectives, ranks, recovery
from dashboard.pages.job.incidents import incident_card
from dashboard.pages.job.joins import cause_fault, incident_phases, invalid_reasons, restores
from dashboard.pages.job.panels import goodput_summary, rank_detail
from dashboard.pages.job.tables import checkpoint_rows, collective_rows, event_rows, seconds_lost_rows
from vigil.contract.client import VigilClient
from vigil.contract.schemas import IncidentKind

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

TAB_OUTPUTS: dict[str, list[tuple[str, str]]] = {
    "ranks": [("job-detail-heatmap", "figure"), ("job-detail-rank-lines", "figure"),
              ("job-detail-rank-lines-box", "style"), ("job-detail-rank-breakdown", "figure"),
              ("job-detail-rank-info", "children"), ("job-detail-rank-lost", "figure"),
              ("job-detail-rank-lost-table", "rowData")],
    "breakdown": [("job-detail-breakdown-step", "figure"), ("job-detail-breakdown-rank", "figure")],
    "communication": [("job-detail-coll-time", "figure"), ("job-detail-coll-wait", "figure"),
                      ("job-detail-coll-bandwidth", "figure"), ("job-detail-coll-bits", "figure"),
                      ("job-detail-collectives", "rowData"), ("job-detail-coll-note", "children")],
    "incidents": [("job-detail-incident-timeline", "figure"), ("job-detail-incidents", "children")],
    "checkpoints": [("job-detail-checkpoint-figure", "figure"), ("job-detail-checkpoints", "rowData")],
    "goodput": [("job-detail-goodput", "children"), ("job-detail-goodput-figure", "figure")],
    "events": [("job-detail-events", "rowData")],
}
TAB_ORDER = [(tab, out) for tab, outs in TAB_OUTPUTS.items() for out in outs]


def _window_start(cursor: Cursor) -> int | None:
    return None if cursor.last_step is None else max(cursor.last_step - WINDOW_STEPS + 1, 0)


def _ranks_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
               ticking: bool) -> list[Any]:
    hot = cursor.stragglers
    if ticking and cursor.ranks > HEATMAP_BIG_JOB and cursor.tick % SLOW_REFRESH_EVERY:
        heat = dash.no_update
    else:
        heat = ranks.binned_heatmap_figure(
            client.job_heatmap(job_id, max_ranks=HEATMAP_RANKS, max_steps=HEATMAP_STEPS), hot)
    since = _window_start(cursor)
    if 0 < cursor.ranks <= ranks.LINES_MAX_RANKS:
        steps = client.job_steps(job_id, since_step=since, max_points=WINDOW_STEPS,
                                 max_ranks=ranks.LINES_MAX_RANKS)
        lines, box = ranks.rank_lines_figure(steps, hot), {"display": "block"}
    else:
        steps, lines, box = None, dash.no_update, {"display": "none"}
    info = rank_detail(None)
    selected = empty_figure("Step breakdown of the selected rank", "click a rank to see its breakdown")
    if rank is not None:
        own = client.job_steps(job_id, since_step=since, ranks=[rank], max_points=WINDOW_STEPS, max_ranks=1)
        node = own.data[0].node_id if own.data else None
        info = rank_detail(rank, None, node)
        selected = breakdown.breakdown_step_figure(own, rank)
    lost = client.job_seconds_lost(job_id, max_points=10)
    return [heat, lines, box, selected, info, ranks.seconds_lost_figure(lost), seconds_lost_rows(lost)]


def _breakdown_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
                   ticking: bool) -> list[Any]:
    sample = rank_sample(cursor.ranks, cursor.slowest, include=[rank] if rank is not None else [])
    steps = client.job_steps(job_id, since_step=_window_start(cursor), ranks=sample, max_points=WINDOW_STEPS,
                             max_ranks=SAMPLE_RANKS + 1)
    sampled = len(steps.data) if sample is not None else None
    return [breakdown.breakdown_step_figure(steps, rank, sampled),
            breakdown.breakdown_rank_figure(steps, cursor.stragglers)]


def _communication_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
                       ticking: bool) -> list[Any]:
    coll = client.job_collectives(job_id, since_step=_window_start(cursor), max_points=WINDOW_STEPS)
    stats = collectives.collective_stats(coll)
    return [collectives.collective_time_figure(stats, job_id),
            collectives.collective_wait_figure(stats, job_id),
            collectives.collective_bandwidth_figure(stats, job_id),
            collectives.bits_per_element_figure(coll),
            collective_rows(stats), estimated_note(coll)]


def _incidents_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
                   ticking: bool) -> list[Any]:
    incidents = client.job_incidents(job_id).data
    faults = client.list_faults(job_id).data if incidents else []
    hangs = [i for i in incidents if i.kind == IncidentKind.HANG and i.evidence.get("stack_groups")]
    # The controller keeps the stacks of the newest diagnosed incident: shown with the newest hang.
    stacks = client.job_stacks(job_id) if hangs else None
    newest_hang = hangs[-1].id if hangs else None
    timelines, cards = [], []
    for inc in incidents:
        fault = cause_fault(inc, faults)
        phases = incident_phases(inc, fault)
        timelines.append((inc, phases))
        where = hang_collectives_view(inc.evidence, f"job-detail-hang-collectives-{inc.id}")
        cards.append(incident_card(inc, phases, fault, stacks if inc.id == newest_hang else None, where))
    body = list(reversed(cards)) or [html.Div("no incidents", style={"color": "#888"})]
    return [recovery.incident_timeline_figure(timelines), body]


def _checkpoints_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
                     ticking: bool) -> list[Any]:
    ckpts = client.job_checkpoints(job_id).data
    events = client.list_events(job_id=job_id, limit=CHECKPOINT_EVENTS_LIMIT).data
    markers = client.job_overview(job_id, since_step=since_step(cursor), top_k=1).markers
    restored = restores(markers, ckpts, events)
    reasons = invalid_reasons(events)
    return [recovery.checkpoint_figure(ckpts, restored, job_id), checkpoint_rows(ckpts, reasons, restored)]


def _goodput_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
                 ticking: bool) -> list[Any]:
    gp = client.job_goodput(job_id)
    return [goodput_summary(gp), recovery.goodput_figure(gp)]


def _events_tab(client: VigilClient, job_id: str, cursor: Cursor, rank: int | None,
                ticking: bool) -> list[Any]:
    return [event_rows(client.list_events(job_id=job_id, limit=EVENTS_LIMIT))]


TAB_BUILDERS: dict[str, Callable[[VigilClient, str, Cursor, int | None, bool], list[Any]]] = {
    "ranks": _ranks_tab,
    "breakdown": _breakdown_tab,
    "communication": _communication_tab,
    "incidents": _incidents_tab,
    "checkpoints": _checkpoints_tab,
    "goodput": _goodput_tab,
    "events": _events_tab,
}
