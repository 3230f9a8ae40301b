"""The dashboard in a real browser: Debian's headless Chromium driven by selenium.

The dashboard is mounted at ``/dashboard`` of the REAL controller served live (uvicorn, SQLite),
exactly as the controller mounts it, and reads its data from that server's REST API. The data went
in through the same API (fixture ``dashboard_site``, see ``conftest.py``): jobs submitted, steps and
heartbeats posted as agents post them, a fault injected; a "live" job gets more steps the same way.

Needs: ``apt-get install -y chromium chromium-driver`` (skipped, with that reason, without them),
selenium, uvicorn, a2wsgi, the controller's dependencies.
"""

from __future__ import annotations

import re

from tests.dashboard.conftest import Site
from tests.dashboard.harness import Browser


def _loss_points(page: Browser) -> list[int] | None:
    graph = page.graph("job-detail-loss")
    if not graph or not graph["traces"]:
        return None
    return [t["n"] for t in graph["traces"]]


def _drawn(page: Browser, graph_id: str) -> dict:
    """The graph once Plotly has drawn a figure into it (traces, or a 'waiting' annotation)."""
    return page.wait_for(lambda: (g := page.graph(graph_id)) and (g["traces"] or g["annotations"]) and g,
                         what=f"{graph_id} drawn")


def test_jobs_list_shows_job_rows_linking_to_job_pages(page: Browser, dashboard_site: Site) -> None:
    abc, new = dashboard_site.demo.abc, dashboard_site.demo.new
    page.get(dashboard_site.dashboard)
    (row,) = page.wait_css(f'tr[data-job-id="{abc}"]')
    text = row.text
    # The last loss is rank 0's at step 19: 5 / (1 + 1.9).
    for expected in (abc, "pydoc-dsm", "RUNNING", "dsm", "19 / 100", "1.724"):
        assert expected in text, (expected, text)
    assert page.css(f'tr[data-job-id="{new}"]')
    (link,) = page.css(f'tr[data-job-id="{abc}"] a')
    assert link.get_attribute("href") == f"{dashboard_site.url}/dashboard/jobs/{abc}"

    # Following the link routes inside the app (no reload) to the job page under the prefix.
    link.click()
    page.wait_equal(lambda: _loss_points(page), [20, 20, 17], what="loss points per rank after navigation")
    assert page.driver.current_url == f"{dashboard_site.url}/dashboard/jobs/{abc}"
    assert page.console_errors() == []


def test_job_page_plots_one_loss_trace_per_rank_and_updates_live(page: Browser, dashboard_site: Site) -> None:
    page.get(f"{dashboard_site.dashboard}jobs/{dashboard_site.demo.abc}")
    page.wait_equal(lambda: _loss_points(page), [20, 20, 17], what="loss points per rank")
    loss = page.graph("job-detail-loss")
    assert [t["name"] for t in loss["traces"]] == ["rank 0", "rank 1", "rank 2"]
    assert loss["traces"][2]["x"] == list(range(17))
    assert loss["annotations"] == []

    step_time = _drawn(page, "job-detail-step-time")
    assert [t["n"] for t in step_time["traces"]] == [20, 20, 17]
    heatmap = _drawn(page, "job-detail-heatmap")
    assert [(t["type"], t["rows"], t["n"]) for t in heatmap["traces"]] == [("heatmap", 3, 20)]
    throughput = _drawn(page, "job-detail-throughput")
    assert [t["name"] for t in throughput["traces"]] == ["rank 0", "rank 1", "rank 2", "total"]

    header = page.text("job-detail-header")
    for expected in ("pydoc-dsm", "RUNNING", "dsm", "19 / 100"):
        assert expected in header, (expected, header)
    page.wait_for(lambda: "slow_rank at step 10000 on rank 2" in (page.text("job-detail-events") or ""),
                  what="job events")

    # The job keeps running: 5 more steps per rank reach the page through the refresh interval.
    dashboard_site.extend_metrics(5)
    page.wait_equal(
        lambda: _loss_points(page), [25, 25, 22], timeout=20, what="loss points per rank after refresh"
    )
    assert page.console_errors() == []


def test_job_without_data_waits_and_unknown_job_is_not_found(page: Browser, dashboard_site: Site) -> None:
    page.get(f"{dashboard_site.dashboard}jobs/{dashboard_site.demo.new}")
    page.wait_for(lambda: "PENDING" in (page.text("job-detail-header") or ""), what="PENDING header")
    loss = _drawn(page, "job-detail-loss")  # the header can come before the figure is drawn
    assert loss["traces"] == []
    assert loss["annotations"] == ["waiting for data"]

    page.get(f"{dashboard_site.dashboard}jobs/no-such-job")
    page.wait_for(lambda: page.css("#job-detail-not-found"), what="job not found")
    assert page.text("job-detail-not-found") == "job not found"
    assert not page.css("#job-detail-body")[0].is_displayed()
    assert page.console_errors() == []


def test_nodes_and_events_pages(page: Browser, dashboard_site: Site) -> None:
    page.get(f"{dashboard_site.dashboard}nodes")
    (dead,) = page.wait_css('tr[data-node-id="node-2"]')
    for expected in ("DEAD", f"{dashboard_site.demo.abc}: 2", "cpu_percent=12.5"):
        assert expected in dead.text, (expected, dead.text)
    assert re.search(r"\b\d+(\.\d)? s\b", dead.text), dead.text  # the heartbeat's age
    assert "ALIVE" in page.css('tr[data-node-id="node-1"]')[0].text

    stored = [e.id for e in reversed(dashboard_site.controller.events())]  # newest first
    page.css("#app-nav-events")[0].click()
    page.wait_css(f'tr[data-event-id="{stored[0]}"]')
    rows = page.css("tr.vigil-event-row")
    assert [int(r.get_attribute("data-event-id")) for r in rows] == stored  # all of them, newest first
    (lost,) = [r for r in rows if "no heartbeat from node-2" in r.text]
    assert "node_dead" in lost.text
    assert page.console_errors() == []
