"""Fixtures of the dashboard tests.

* ``live_server``: a factory; ``live_server(make_app)`` serves ``make_app(base_url)`` with uvicorn
  in a thread on a free port and returns the base URL; every server is stopped after the test.
* ``fake_state`` / ``dashboard_site``: the controller TEST DOUBLE (:mod:`.fake_controller`) with
  the dashboard mounted at ``/dashboard`` exactly as the controller mounts it, served live.
  To point the browser tests at the real controller later, build ``dashboard_site`` from
  ``controller.app.create_app()`` instead of the double.
* ``browser``: one headless Debian Chromium for the session (fresh ``--user-data-dir``); skipped,
  with the reason, only when Chromium or chromedriver is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.dashboard.fake_controller import FakeControllerState, create_fake_controller, demo_state
from tests.dashboard.harness import (
    Browser,
    LiveServer,
    chromium_missing_reason,
    start_live_server,
    with_dashboard,
)

TOKEN = "dashboard-test-token"


@pytest.fixture
def live_server() -> Iterator[Callable[[Callable[[str], Any]], str]]:
    servers: list[LiveServer] = []

    def start(make_app: Callable[[str], Any]) -> str:
        server = start_live_server(make_app)
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def fake_state() -> FakeControllerState:
    return demo_state()


@dataclass
class Site:
    url: str
    """Base URL of the server; the dashboard is at ``{url}/dashboard/``."""
    state: FakeControllerState

    @property
    def dashboard(self) -> str:
        return f"{self.url}/dashboard/"


@pytest.fixture
def dashboard_site(
    live_server: Callable[[Callable[[str], Any]], str], fake_state: FakeControllerState
) -> Site:
    """The controller double with the dashboard mounted at /dashboard, polling every 500 ms."""
    url = live_server(
        with_dashboard(lambda _url: create_fake_controller(fake_state), token=TOKEN, refresh_ms=500)
    )
    return Site(url=url, state=fake_state)


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    reason = chromium_missing_reason()
    if reason:
        pytest.skip(reason)
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield b
    finally:
        b.quit()


@pytest.fixture
def page(browser: Browser, dashboard_site: Site) -> Iterator[Browser]:
    """The browser, left on about:blank after the test so nothing polls a stopped server."""
    browser.blank()
    yield browser
    browser.blank()
