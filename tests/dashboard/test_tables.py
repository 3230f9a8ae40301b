"""Unit tests of dashboard/tables.py: pure functions from wire schemas to Dash components.

Needs: dash and the wire schemas only (no server, no browser).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any

from dash import dcc, html

from controller.schemas import EventsPublic, JobsPublic, JobStatus, NodesPublic, NodeState, RankProcess
from dashboard import tables
from tests.dashboard.samples import make_event, make_job, make_node


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
    table = tables.jobs_table(jobs, "/dashboard/")
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
    (link,) = [c for c in _walk(tables.jobs_table(jobs, "/")) if isinstance(c, dcc.Link)]
    assert link.href == "/jobs/x"
    empty = tables.jobs_table(JobsPublic(data=[], count=0), "/")
    assert "no jobs yet" in _texts(empty)


def test_nodes_table_shows_state_age_ranks_host() -> None:
    node = make_node("n1", NodeState.DEAD, ranks=[("job-b", 3), ("job-a", 1), ("job-a", 0)])
    node.ranks.append(RankProcess(job_id="job-b", rank=4, pid=9, alive=False))
    table = tables.nodes_table(NodesPublic(data=[node], count=1))
    (row,) = _rows(table, "vigil-node-row")
    texts = _texts(row)
    for expected in (
        "n1",
        "host-n1",
        "DEAD",
        "1.2 s",
        "job-a: 0, 1; job-b: 3, 4†",
        "cpu_percent=12.5, mem.used_gb=3.25",
    ):
        assert expected in texts, (expected, texts)
    assert "no nodes have reported yet" in _texts(tables.nodes_table(NodesPublic(data=[], count=0)))


def test_events_table_links_jobs() -> None:
    events = EventsPublic(
        data=[make_event(7, "incident.hang", "rank 1 hung", job_id="j1"), make_event(8, "x", "m")], count=2
    )
    table = tables.events_table(events, "/dashboard/")
    rows = _rows(table, "vigil-event-row")
    assert len(rows) == 2
    links = [c for c in _walk(table) if isinstance(c, dcc.Link)]
    assert [link.href for link in links] == ["/dashboard/jobs/j1"]
    assert "rank 1 hung" in _texts(rows[0]) and "incident.hang" in _texts(rows[0])


def test_job_summary_names_status_and_spec() -> None:
    job = make_job("j9", "my run", JobStatus.FAILED, optimizer="powersgd", workers=(4, 4), last_step=7)
    job.message = "rank 3 died"
    parts = tables.job_summary(job)
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
    assert tables.fmt_time(None) == "–"
    cet = timezone(timedelta(hours=1))
    assert tables.fmt_time(datetime(2026, 1, 1, 1, 0, 0, tzinfo=cet)) == "2026-01-01 00:00:00"
    assert tables.fmt_float(None) == "–"
    assert tables.fmt_float(math.nan) == "nan"
    assert tables.fmt_float(1.23456789) == "1.235"
    assert [tables.fmt_age(s) for s in (None, 0.84, 42.0, 300.0, 9000.0)] == [
        "–",
        "0.8 s",
        "42 s",
        "5 min",
        "2.5 h",
    ]
    assert tables.fmt_ranks([]) == "–"
    assert tables.fmt_host({}) == "–"
    assert tables.fmt_host({"gpu": "unavailable", "cpu": 0.123456}) == "cpu=0.123, gpu=unavailable"
