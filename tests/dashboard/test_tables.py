"""Unit tests of the dashboard's tables and components (dashboard/tables.py, format.py, and in
dashboard/pages/: jobs/tables.py, events/tables.py, job/panels.py, job/tables.py, job/incidents.py): pure functions from wire schemas to Dash components.

Needs: dash and the wire schemas only (no server, no browser).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any

import dash_ag_grid as dag
from dash import dcc, html

from dashboard import format as fmt
from dashboard.pages.events.tables import events_table
from dashboard.pages.job import incidents as incident_views
from dashboard.pages.job import joins, panels
from dashboard.pages.job import tables as job_tables
from dashboard.pages.job.figures import collectives as collective_figures
from dashboard.pages.job.figures import ranks as rank_figures
from dashboard.pages.jobs.tables import jobs_table
from dashboard.tables import grid
from tests.dashboard import job_samples as js
from tests.dashboard.samples import make_event, make_job
from vigil.contract.schemas import (
    EventsPublic,
    IncidentKind,
    IncidentStatus,
    JobsPublic,
    JobStatus,
)


def _walk(component: Any) -> list[Any]:
    out = [component]
    children = getattr(component, "children", None)
    if isinstance(children, list | tuple):
        for c in children:
            out += _walk(c)
    elif children is not None and not isinstance(children, str | int | float):
        out += _walk(children)
    return out


def _texts(component: Any) -> list[str]:
    return [c for c in _walk(component) if isinstance(c, str)] + [
        c.children for c in _walk(component) if isinstance(getattr(c, "children", None), str)
    ]


def _rows(table: html.Table, cls: str) -> list[html.Tr]:
    return [c for c in _walk(table) if isinstance(c, html.Tr) and getattr(c, "className", None) == cls]


def test_jobs_table_row_per_job_with_prefixed_links() -> None:
    jobs = JobsPublic(
        data=[
            make_job("job-abc", "pydoc-dsm", JobStatus.RUNNING, steps=100, last_step=19, last_loss=1.6778),
            make_job("job-new", "fresh", JobStatus.PENDING, workers=(2, 2), optimizer="adamw", minutes_ago=1),
        ],
        count=2,
    )
    table = jobs_table(jobs, "/dashboard/")
    rows = _rows(table, "vigil-job-row")
    assert [r.to_plotly_json()["props"]["data-job-id"] for r in rows] == ["job-abc", "job-new"]
    links = [c for c in _walk(table) if isinstance(c, dcc.Link)]
    assert [link.href for link in links] == ["/dashboard/jobs/job-abc", "/dashboard/jobs/job-new"]
    first = _texts(rows[0])
    for expected in ("pydoc-dsm", "RUNNING", "dsm", "2–4", "19 / 100", "1.678", "2026-01-02 02:59:05"):
        assert expected in first, (expected, first)
    second = _texts(rows[1])
    for expected in ("PENDING", "adamw", "2", "– / 100", "–"):
        assert expected in second, (expected, second)


def test_jobs_table_standalone_prefix_and_empty() -> None:
    jobs = JobsPublic(data=[make_job("x")], count=1)
    (link,) = [c for c in _walk(jobs_table(jobs, "/")) if isinstance(c, dcc.Link)]
    assert link.href == "/jobs/x"
    empty = jobs_table(JobsPublic(data=[], count=0), "/")
    assert "no jobs yet" in _texts(empty)


def test_events_table_links_jobs() -> None:
    events = EventsPublic(
        data=[make_event(7, "incident.hang", "rank 1 hung", job_id="j1"), make_event(8, "x", "m")], count=2
    )
    table = events_table(events, "/dashboard/")
    rows = _rows(table, "vigil-event-row")
    assert len(rows) == 2
    links = [c for c in _walk(table) if isinstance(c, dcc.Link)]
    assert [link.href for link in links] == ["/dashboard/jobs/j1"]
    assert "rank 1 hung" in _texts(rows[0]) and "incident.hang" in _texts(rows[0])


def test_job_summary_names_status_and_spec() -> None:
    job = make_job("j9", "my run", JobStatus.FAILED, optimizer="powersgd", workers=(4, 4), last_step=7)
    job.message = "rank 3 died"
    parts = panels.job_summary(job)
    texts = [t for p in parts for t in _texts(p)]
    for expected in (
        "my run",
        "FAILED",
        "powersgd (lr 0.001)",
        "4",
        "7 / 100",
        "evict_restart",
        "rank 3 died",
    ):
        assert expected in texts, (expected, texts)


def test_formatters() -> None:
    assert fmt.fmt_time(None) == "–"
    cet = timezone(timedelta(hours=1))
    assert fmt.fmt_time(datetime(2026, 1, 1, 1, 0, 0, tzinfo=cet)) == "2026-01-01 00:00:00"
    assert fmt.fmt_float(None) == "–"
    assert fmt.fmt_float(math.nan) == "nan"
    assert fmt.fmt_float(1.23456789) == "1.235"
    assert [fmt.fmt_age(s) for s in (None, 0.84, 42.0, 300.0, 9000.0)] == [
        "–",
        "0.8 s",
        "42 s",
        "5 min",
        "2.5 h",
    ]
    assert fmt.fmt_ranks([]) == "–"


# ==================================================================================================
# The job page's diagnosis components
# ==================================================================================================


def _by_id(component: Any, component_id: str) -> Any:
    (found,) = [c for c in _walk(component) if getattr(c, "id", None) == component_id]
    return found


def _text(component: Any) -> str:
    """The text of ``component`` in document order."""
    if isinstance(component, str | int | float):
        return str(component)
    if isinstance(component, list | tuple):
        return "".join(_text(c) for c in component)
    children = getattr(component, "children", None)
    return "" if children is None else _text(children)


def test_job_header_progress_eta_restarts_and_the_incident_under_way() -> None:
    job = make_job("j1", "big run", JobStatus.RUNNING, steps=200, last_step=49)
    live = js.incident(7, IncidentKind.HANG, status=IncidentStatus.ACTING, rank=3, node_id="node-4")
    header = html.Div(panels.job_header(job, panels.Vitals(eta_s=450.0, restarts=2, incident=live, ranks=1024)))
    assert _by_id(header, "job-detail-status").children == "RUNNING"
    progress = _by_id(header, "job-detail-progress")
    assert (progress.value, progress.max) == ("50", "200")
    assert _by_id(header, "job-detail-step").children == "49 / 200"
    assert _text(_by_id(header, "job-detail-eta")) == "8 min"
    assert _text(_by_id(header, "job-detail-restarts")) == "2"
    assert _text(_by_id(header, "job-detail-ranks")) == "1024"
    assert _text(_by_id(header, "job-detail-incident")) == "hang (ACTING): rank 3, node node-4"
    quiet = html.Div(panels.job_header(make_job("j2", status=JobStatus.SUCCEEDED, last_step=99)))
    assert _text(_by_id(quiet, "job-detail-eta")) == "–" and _text(_by_id(quiet, "job-detail-incident")) == "–"


def test_slowest_rank_rows_flag_the_straggler() -> None:
    ov = js.overview(steps=range(5), slow=5)
    rows = job_tables.slowest_rank_rows(ov.slowest_ranks, rank_figures.STRAGGLER_RATIO)
    assert [(r["rank"], r["vs_median"], r["flag"]) for r in rows] == [(5, 5.0, "straggler"), (0, 1.0, ""), (1, 1.0, "")]
    assert rows[0]["node_id"] == "node-2"


def test_grids_are_sortable_filterable_ag_grids() -> None:
    g = grid("x-grid", job_tables.SLOWEST_COLUMNS, row_id="rank", highlight="params.data.flag")
    assert isinstance(g, dag.AgGrid)
    assert g.defaultColDef["sortable"] and g.defaultColDef["filter"]
    assert g.getRowId == "params.data.rank"
    assert g.getRowStyle["styleConditions"][0]["condition"] == "params.data.flag"
    assert g.dashGridOptions["domLayout"] == "autoHeight"


def test_collective_rows() -> None:
    stats = collective_figures.collective_stats(js.collectives("job", js.collective("all_reduce", "grads", range(3),
                                                                          transfer=0.002)))
    (row,) = job_tables.collective_rows(stats)
    assert row["kind"] == "all_reduce/grads" and row["bits_per_param"] == 32.0
    assert row["bandwidth"] == 2.0 and row["wire_per_rank"] == "4 MB" and row["slowest_rank"] == 3


def test_checkpoint_rows_say_why_invalid_and_which_restart_restored_each() -> None:
    c20, c40 = js.checkpoint(1, 20), js.checkpoint(2, 40, valid=False)
    restores = [(js.marker("restart", 45), c20), (js.marker("restart", 47), c20)]
    rows = job_tables.checkpoint_rows([c20, c40], {"/ckpt/step-40": "sha256 mismatch"}, restores)
    assert [(r["step"], r["valid"], r["why"], r["restored_by"]) for r in rows] == [
        (40, "NO", "sha256 mismatch", ""), (20, "yes", "", "restart 1, restart 2")]
    assert rows[1]["size"] == "2.5 MB"


def test_event_rows() -> None:
    rows = job_tables.event_rows(EventsPublic(data=[make_event(3, "fault_fired", "hang_rank: rank 1", "j", "node-2")],
                                          count=1))
    assert rows == [{"id": 3, "time": "2026-01-02 03:04:08", "kind": "fault_fired", "node": "node-2",
                     "message": "hang_rank: rank 1"}]


def test_stack_comparison_shows_the_odd_rank_against_the_majority() -> None:
    view = incident_views.stack_comparison(js.stacks(ranks=8, odd=1))
    groups = [c for c in _walk(view) if getattr(c, "className", None) == "vigil-stack-group"]
    assert [g.to_plotly_json()["props"]["data-ranks"] for g in groups] == ["0,2,3,4,5,6,7", "1"]
    assert "odd rank out: 1" in _text(view)
    assert _by_id(view, "job-detail-stack-majority").children == js.WAITING_STACK
    odd = _by_id(view, "job-detail-stack-odd")
    assert odd.to_plotly_json()["props"]["data-rank"] == "1"
    diff = [c.children.strip() for c in _walk(odd) if getattr(c, "className", None) == "vigil-stack-diff"]
    assert "forward (vigil/model.py:120)" in diff
    assert not any("all_reduce" in line for line in diff)


def test_incident_card_timeline_action_evidence_and_stacks() -> None:
    inc = js.incident(3, evidence={"idle_s": 31.5, "odd_ranks": [1], "stack_groups": [{"ranks": [0], "signature": "s"}]})
    fault = js.fault(1, fired_s=80)
    card = incident_views.incident_card(inc, joins.incident_phases(inc, fault), fault, js.stacks())
    text = _text(card)
    assert card.id == "job-detail-incident-3"
    assert "fault 03:05:25 -> detected +20 s -> acted +2.0 s -> recovered +28 s" in text
    assert "killed rank 1, evicted node-2" in text and "#1 hang_rank rank 1 at step 40" in text
    assert "idle_s" in text and "31.5" in text and "stack_groups" not in text  # shown as stacks instead
    assert _by_id(card, "job-detail-stack-odd").to_plotly_json()["props"]["data-rank"] == "1"


def test_goodput_summary_shows_the_ettr() -> None:
    view = panels.goodput_summary(js.goodput())
    assert _by_id(view, "job-detail-ettr").children == "0.750"
    assert "productive 2 min of 3 min wall; 1 restart, 9 steps re-run" in _text(view)
    assert "restart: 20 s (10.0%)" in _text(_by_id(view, "job-detail-lost"))
    assert "no goodput yet" in _text(panels.goodput_summary(None))


def test_marker_detail_and_rank_detail() -> None:
    m = js.marker("incident", 28, "hang detected", ref="3")
    detail = panels.marker_detail([m.kind, m.step, m.label, m.ref, m.ts], js.incident(3, evidence={"idle_s": 20.0}))
    assert "incident at step 28: " in _text(detail) and "idle_s" in _text(detail)
    assert "click a marker" in _text(panels.marker_detail(None))
    ov = js.overview(steps=range(3))
    assert "rank 5 on node-2: mean step 0.5 s, 5.00x the median rank" == _text(panels.rank_detail(5, ov.slowest_ranks[0]))


def test_more_formatters() -> None:
    assert [fmt.fmt_duration(s) for s in (None, 1.25, 45.0, 600.0, 3 * 3600 + 300.0)] == [
        "–", "1.2 s", "45 s", "10 min", "3 h 05 min"]
    assert [fmt.fmt_bytes(n) for n in (None, 512, 1500, 2_250_000, 3.1e9)] == ["–", "512 B", "1.5 kB", "2.25 MB", "3.1 GB"]
    assert fmt.fmt_rank_list([7, 0, 1, 2, 3, 5, 8, 9]) == "0-3, 5, 7-9"
    assert fmt.fmt_rank_list(list(range(0, 100, 2)), limit=3) == "0, 2, 4, ... (50 ranks)"


def test_incident_card_tells_what_the_adapt_policy_did() -> None:
    adapt = {"version": 1, "params": {"tau": 16}, "requested_step": 64, "switched_step": 80, "step_s_before": 0.412,
             "step_s_after": 0.151, "step_s_healthy": 0.12,
             "eviction": {"worth": False, "projected_lost_s": 6.2, "steps_left": 200, "restart_s": 60.0},
             "revert": {"version": 2, "switched_step": 240, "why": "no NIC finding"}}
    inc = js.incident(4, IncidentKind.NIC_DEGRADED, status=IncidentStatus.CLOSED, rank=None,
                      evidence={"class": "capacity", "adapt": adapt})
    text = _text(incident_views.incident_card(inc, joins.incident_phases(inc, None)))
    assert "adapted to tau 16 (version 1) from step 80" in text
    assert "step time 0.412 s before, 0.151 s after (healthy 0.120 s)" in text
    assert "eviction not worth it (6.2 s over 200 steps left vs a 60.0 s restart)" in text
    assert "back to the spec's setting from step 240" in text and '"tau"' not in text  # not the raw JSON row
    waiting = {**adapt, "switched_step": None, "step_s_after": None, "eviction": None, "revert": None}
    assert "asked at step 64, waiting for the next checkpoint boundary" in incident_views.adapt_line(waiting)
    assert "0.412 s before, ? after" in incident_views.adapt_line(waiting)


def test_incident_card_shows_a_live_recovery_phase_by_phase() -> None:
    timeline = [{"phase": "quorum_without", "ts": 99.6, "after_s": -0.4, "detail": "rank 0 and its peers re-formed"},
                {"phase": "detected", "ts": 100.0, "after_s": 0.0, "detail": "rank_died of rank 1"},
                {"phase": "acted", "ts": 100.0, "after_s": 0.0, "detail": "live: left to Ray"},
                {"phase": "heal_started", "ts": 104.0, "after_s": 4.0, "detail": "asked for a quorum"},
                {"phase": "healed", "ts": 105.5, "after_s": 5.5, "detail": "123456 bytes of state in 1.50 s"},
                {"phase": "first_step_together", "ts": 106.7, "after_s": 6.7, "detail": "step 21: all 2 ranks"},
                {"phase": "recovered", "ts": 107.0, "after_s": 7.0, "detail": "the replaced rank stepped"}]
    inc = js.incident(5, IncidentKind.RANK_DIED, status=IncidentStatus.RECOVERED, rank=1,
                      evidence={"pid": 1001, "timeline": timeline})
    card = incident_views.incident_card(inc, joins.incident_phases(inc, None))
    text = _text(card)
    assert "training together again +6.70 s after the detection; heal 1.50 s" in text
    assert "-0.40 s" in text and "quorum without it" in text and "123456 bytes of state in 1.50 s" in text
    assert '"phase"' not in text  # not the raw JSON in the evidence table
    assert text.index("quorum without it") < text.index("heal started") < text.index("first step together")
