"""Fixtures of the dashboard tests.

* ``dashboard_site``: the REAL controller (:class:`tests.live_controller.LiveController`: the
  ``create_app()`` app on SQLite, served live) with the dashboard mounted at ``/dashboard`` as the
  controller mounts it (viewer token, polling every 500 ms), seeded through the controller's REST
  API by :func:`seed_demo`: two jobs (one RUNNING with 3 ranks of unequal length, rank 2 a
  straggler on a node whose heartbeats stopped; one PENDING with no data), two nodes known from
  agent heartbeats (one ALIVE, one DEAD), and the events all that recorded.
* ``browser``: one headless Debian Chromium for the session (fresh ``--user-data-dir``); skipped,
  with the reason, only when Chromium or chromedriver is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.harness import Browser, chromium_missing_reason, mount_dashboard
from tests.dashboard.samples import rank_series
from tests.live_controller import LiveController
from vigil.contract.schemas import JobStatus, Role, StepSample

POINTS = {0: 20, 1: 20, 2: 17}
"""Steps each rank of the running demo job reported; unequal, so a mixed-up trace shows."""
SLOW_RANKS = frozenset({2})
NODES = {"node-1": (0, 1), "node-2": (2,)}
"""Which node runs which ranks of the demo job; node-2's heartbeats stop."""
HOST = {"cpu_percent": 12.5, "mem": {"used_gb": 3.25}}


@dataclass
class Demo:
    """What :func:`seed_demo` stored; the ids are the controller's own."""

    abc: str
    """The RUNNING job ``pydoc-dsm`` (dsm, 2-4 workers, 100 steps) with step metrics of 3 ranks."""
    new: str
    """The PENDING job ``fresh`` (adamw, 2 workers) without data."""
    points: dict[int, int] = field(default_factory=lambda: dict(POINTS))
    """Steps stored so far per rank of ``abc``."""


def rank_steps(job_id: str, rank: int, start: int, stop: int) -> list[StepSample]:
    """Steps [start, stop) of ``rank`` as the rank reports them (deterministic values of
    :func:`tests.dashboard.samples.rank_series`; rank 2 a straggler)."""
    rs = rank_series(rank, stop, slow=rank in SLOW_RANKS)
    t0 = time.time() - 60
    return [
        StepSample(job_id=job_id, rank=rank, world_size=len(POINTS), step=s, ts=t0 + s, loss=rs.loss[s],
                   step_time_s=rs.step_time_s[s], tokens=512, tokens_per_s=rs.tokens_per_s[s])
        for s in range(start, stop)
    ]


def seed_demo(ctl: LiveController) -> Demo:
    """Fill the controller through its API, in the order things happen in production."""
    abc = ctl.submit_job("pydoc-dsm", steps=100, optimizer={"kind": "dsm"},
                         scaling={"min_workers": 2, "max_workers": 4}).id
    # node-2's agent reports rank 2, then falls silent: the monitor's next pass, 30 s on, finds it
    # DEAD (the jobs are not running yet, so that is all it does).
    ctl.heartbeat("node-2", [(abc, 2, 1002)], rank_steps(abc, 2, 0, POINTS[2]), address="198.18.0.3", host=HOST)
    ctl.monitor_pass(after_s=30)
    ctl.heartbeat("node-1", [(abc, 0, 1000), (abc, 1, 1001)],
                  [s for r in NODES["node-1"] for s in rank_steps(abc, r, 0, POINTS[r])],
                  address="198.18.0.2", host=HOST)
    new = ctl.submit_job("fresh", steps=100, optimizer={"kind": "adamw"},
                         scaling={"min_workers": 2, "max_workers": 2}).id
    ctl.set_job_status(abc, JobStatus.RUNNING)
    # A fault aimed at rank 2, far ahead: recorded as the job's event, never fired here.
    ctl.inject_fault(abc, "slow_rank", rank=2, step=10_000)
    return Demo(abc=abc, new=new)


@dataclass
class Site:
    url: str
    """Base URL of the server; the dashboard is at ``{url}/dashboard/``."""
    controller: LiveController
    demo: Demo

    @property
    def dashboard(self) -> str:
        return f"{self.url}/dashboard/"

    def extend_metrics(self, extra_steps: int) -> None:
        """Every rank of the running demo job reports ``extra_steps`` more steps (through its node's
        agent; node-2's batches still arrive, without heartbeats)."""
        for node, ranks in NODES.items():
            samples = [s for r in ranks
                       for s in rank_steps(self.demo.abc, r, self.demo.points[r], self.demo.points[r] + extra_steps)]
            self.controller.post_batch(node, samples)
        for r in self.demo.points:
            self.demo.points[r] += extra_steps

    def headers(self, role: Role | str = Role.VIEWER) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.controller.token(role)}"}


@pytest.fixture
def dashboard_site(tmp_path: Path) -> Iterator[Site]:
    """The real controller, seeded, with the dashboard mounted at /dashboard, polling every 500 ms."""

    def mount(app: Any, url: str) -> None:
        from tests.auth import issue_token

        mount_dashboard(app, url, token=issue_token(app, Role.VIEWER, name="dashboard"), refresh_ms=500)

    ctl = LiveController(tmp_path / "controller", extend=mount).start()
    try:
        yield Site(url=ctl.url, controller=ctl, demo=seed_demo(ctl))
    finally:
        ctl.stop()


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
