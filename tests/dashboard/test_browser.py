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


def _loss_points(page: Browser) -> int | None:
    """Points of the job-wide training loss (one per step, whichever ranks reported it)."""
    graph = page.graph("job-detail-loss")
    if not graph or not graph["traces"]:
        return None
    return next((t["n"] for t in graph["traces"] if t["name"] == "train loss"), None)


def _open_tab(page: Browser, tab: str) -> None:
    page.wait_css(f"#job-detail-tab-{tab}")[0].click()


def _drawn(page: Browser, graph_id: str) -> dict:
    """The graph once Plotly has drawn a figure into it (traces, or a 'waiting' annotation)."""
    return page.wait_for(lambda: (g := page.graph(graph_id)) and (g["traces"] or g["annotations"]) and g,
                         what=f"{graph_id} drawn")


_ROWS_JS = """
return Array.from(document.querySelectorAll(arguments[0])).map(r => [r.getAttribute(arguments[1]), r.innerText]);
"""


def _rows(page: Browser, selector: str, attr: str) -> list[tuple[str, str]]:
    """``(attr, text)`` of the rows matching ``selector``, read at once: the page's polling may redraw
    the rows between two reads of an element (a stale element)."""
    return [(r[0], r[1]) for r in page.js(_ROWS_JS, selector, attr)]


def test_jobs_list_shows_job_rows_linking_to_job_pages(page: Browser, dashboard_site: Site) -> None:
    abc, new = dashboard_site.demo.abc, dashboard_site.demo.new
    page.get(dashboard_site.dashboard)
    page.wait_css(f'tr[data-job-id="{abc}"]')
    ((_, text),) = _rows(page, f'tr[data-job-id="{abc}"]', "data-job-id")
    # The last loss is rank 0's at step 19: 5 / (1 + 1.9).
    for expected in (abc, "pydoc-dsm", "RUNNING", "dsm", "19 / 100", "1.724"):
        assert expected in text, (expected, text)
    assert page.css(f'tr[data-job-id="{new}"]')
    # The list is drawn again at every refresh, which can leave an element found a moment ago stale (seen in
    # CI): the link is found afresh for each read and for the click.
    link = f'tr[data-job-id="{abc}"] a'
    assert len(page.css(link)) == 1
    page.wait_equal(lambda: page.css(link)[0].get_attribute("href"), f"{dashboard_site.url}/dashboard/jobs/{abc}",
                    what="the job row's link")

    # Following the link routes inside the app (no reload) to the job page under the prefix.
    page.wait_for(lambda: page.css(link)[0].click() or True, what="a click on the job row's link")
    page.wait_equal(lambda: _loss_points(page), 20, what="loss points after navigation")
    assert page.driver.current_url == f"{dashboard_site.url}/dashboard/jobs/{abc}"
    assert page.console_errors() == []


def test_job_page_draws_job_wide_figures_and_extends_them_live(page: Browser, dashboard_site: Site) -> None:
    page.get(f"{dashboard_site.dashboard}jobs/{dashboard_site.demo.abc}")
    page.wait_equal(lambda: _loss_points(page), 20, what="loss points")
    loss = page.graph("job-detail-loss")
    assert [t["name"] for t in loss["traces"]][:2] == ["train loss", "validation loss"]
    assert loss["traces"][0]["x"] == list(range(20))
    assert loss["annotations"] == []
    throughput = _drawn(page, "job-detail-throughput")
    assert [t["name"] for t in throughput["traces"]] == ["tokens / s (all ranks)", "ranks reporting"]

    header = page.text("job-detail-header")
    for expected in ("pydoc-dsm", "RUNNING", "dsm", "19 / 100", "ETA"):
        assert expected in header, (expected, header)

    # The job keeps running: 5 more steps per rank reach the page through the refresh interval, as
    # a patch of the drawn figures.
    dashboard_site.extend_metrics(5)
    page.wait_equal(lambda: _loss_points(page), 25, timeout=20, what="loss points after refresh")
    assert page.graph("job-detail-loss")["traces"][0]["x"] == list(range(25))

    _open_tab(page, "ranks")
    bands = page.wait_for(lambda: (g := page.graph("job-detail-step-time")) and g["traces"] and g,
                          what="step time bands")
    assert [(t["name"], t["n"]) for t in bands["traces"]] == [("p50", 25), ("p90", 25), ("max (slowest rank)", 25)]
    heatmap = page.wait_for(lambda: (g := page.graph("job-detail-heatmap")) and g["traces"] and g, what="heatmap")
    assert [(t["type"], t["rows"]) for t in heatmap["traces"]] == [("heatmap", 3)]
    # Three ranks: one line each too, the straggler's marked.
    lines = page.wait_for(lambda: (g := page.graph("job-detail-rank-lines")) and g["traces"] and g, what="rank lines")
    assert [t["name"] for t in lines["traces"]] == ["rank 0", "rank 1", "rank 2 (slow)"]

    _open_tab(page, "events")
    page.wait_for(lambda: "slow_rank at step 10000 on rank 2" in (page.text("job-detail-events") or ""),
                  what="job events")
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


def _node_cell(page: Browser, node_id: str, col: str) -> str:
    cells = page.css(f'div.ag-row[row-id="{node_id}"] div[col-id="{col}"]')
    return cells[0].text if cells else ""


def test_nodes_and_events_pages(page: Browser, dashboard_site: Site) -> None:
    page.get(f"{dashboard_site.dashboard}nodes")
    # The fleet grid (tests/dashboard/test_fleet.py covers its metrics): one row per node.
    page.wait_equal(lambda: _node_cell(page, "node-2", "state"), "DEAD", what="node-2 DEAD")
    assert _node_cell(page, "node-2", "ranks") == f"{dashboard_site.demo.abc}: 2"
    assert re.search(r"\b\d+(\.\d)? s\b", _node_cell(page, "node-2", "heartbeat_age_s"))  # the heartbeat's age
    assert _node_cell(page, "node-1", "state") == "ALIVE"
    # The demo's host dict is not in the agents' layout: n/a, never a raw key=value dump.
    assert _node_cell(page, "node-2", "cpu_percent") == "n/a"
    assert "cpu_percent=" not in page.js("return document.body.innerText;")

    stored = [e.id for e in reversed(dashboard_site.controller.events())]  # newest first
    page.css("#app-nav-events")[0].click()
    page.wait_css(f'tr[data-event-id="{stored[0]}"]')
    rows = _rows(page, "tr.vigil-event-row", "data-event-id")
    assert [int(event_id) for event_id, _ in rows] == stored  # all of them, newest first
    (lost,) = [text for _, text in rows if "no heartbeat from node-2" in text]
    assert "node_dead" in lost
    assert page.console_errors() == []
