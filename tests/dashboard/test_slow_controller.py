"""The dashboard against a controller that answers slower than the pages poll, in a real browser.

Dash drops the reply of a callback that fires again before it answered (plotly/dash#941): a page
whose refresh took longer than its polling period drew nothing, ever, as a busy controller or a big
job made it (seen in CI: a job page's header still empty after 30 s). Here every ``GET /api/...``
the dashboard makes waits :data:`DELAY_S` in the REAL controller (uvicorn, SQLite; a middleware added
before it serves) while the pages poll every :data:`REFRESH_MS`: one refresh of the job page reads
three endpoints, ~5 periods. The pages still draw, and keep refreshing as the job goes on.

Needs: ``apt-get install -y chromium chromium-driver`` (skipped without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.conftest import Site, seed_demo
from tests.dashboard.harness import Browser, mount_dashboard
from tests.live_controller import LiveController
from vigil.contract.schemas import Role

DELAY_S = 0.35
"""What every API read of the dashboard waits in the controller."""
REFRESH_MS = 200
"""The pages' polling period: well under one read."""


@pytest.fixture
def slow_site(tmp_path: Path) -> Iterator[Site]:
    """The seeded demo controller (as ``dashboard_site``), its API reads slowed once seeded."""
    delay = {"s": 0.0}

    def extend(app: Any, url: str) -> None:
        from tests.auth import issue_token

        @app.middleware("http")
        async def slow_reads(request: Any, call_next: Any) -> Any:
            if delay["s"] and request.method == "GET" and request.url.path.startswith("/api/"):
                await asyncio.sleep(delay["s"])
            return await call_next(request)

        mount_dashboard(app, url, token=issue_token(app, Role.VIEWER, name="dashboard"), refresh_ms=REFRESH_MS)

    ctl = LiveController(tmp_path / "controller", extend=extend).start()
    try:
        site = Site(url=ctl.url, controller=ctl, demo=seed_demo(ctl))
        delay["s"] = DELAY_S
        yield site
    finally:
        ctl.stop()


@pytest.fixture
def slow_page(browser: Browser, slow_site: Site) -> Iterator[Browser]:
    browser.blank()
    yield browser
    browser.blank()


def _loss_points(page: Browser) -> int | None:
    graph = page.graph("job-detail-loss")
    if not graph or not graph["traces"]:
        return None
    return next((t["n"] for t in graph["traces"] if t["name"] == "train loss"), None)


def test_pages_slower_to_refresh_than_their_period_draw_and_keep_refreshing(slow_page: Browser,
                                                                              slow_site: Site) -> None:
    page, abc = slow_page, slow_site.demo.abc
    page.get(slow_site.dashboard)
    page.wait_css(f'tr[data-job-id="{abc}"]')
    # To the job page inside the app (no reload), a refresh of the list under way: its reply finds
    # the list gone, and nothing complains.
    page.wait_for(lambda: page.css(f'tr[data-job-id="{abc}"] a')[0].click() or True, what="a click on the job")
    page.wait_for(lambda: "pydoc-dsm" in (page.text("job-detail-header") or ""), what="the job's header")
    page.wait_equal(lambda: _loss_points(page), 20, what="loss points")
    # The job goes on: its new steps reach the page, a refresh after the other.
    slow_site.extend_metrics(5)
    page.wait_equal(lambda: _loss_points(page), 25, what="loss points after more steps")

    # The tab refreshes that follow each new cursor are paced too: the ranks tab draws, and goes on.
    page.wait_css("#job-detail-tab-ranks")[0].click()
    heatmap = page.wait_for(lambda: (g := page.graph("job-detail-heatmap")) and g["traces"] and g, what="heatmap")
    assert [(t["type"], t["rows"]) for t in heatmap["traces"]] == [("heatmap", 3)]
    slow_site.extend_metrics(5)
    page.wait_equal(lambda: [t["n"] for t in (page.graph("job-detail-step-time") or {"traces": []})["traces"]],
                    [30, 30, 30], what="step time bands after more steps")
    assert page.console_errors() == []
