"""The dashboard in a real browser against the REAL controller (``controller.app.create_app``).

The controller runs live (:class:`tests.live_controller.LiveController`: uvicorn, SQLite in
``tmp_path``, a fake Ray launcher that leaves the submitted job PENDING) with the dashboard mounted by
the controller itself (``create_app`` with ``ops.dashboard_mount.mount_dashboard``, as ``vigil controller``
builds it: its own URL, its own internal token). The job and its per-rank steps
enter through the public REST API (``POST /jobs`` with an admin token, ``POST /telemetry`` with an
agent token, as agents send them), so what the browser shows went through the controller's
storage and its metrics endpoint; the dashboard reads it with its own (server-side) viewer token.

Needs: ``apt-get install -y chromium chromium-driver`` (skipped without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.dashboard.harness import Browser
from tests.live_controller import LiveController
from vigil.contract.client import VigilClient
from vigil.contract.schemas import Heartbeat, JobCreate, RankProcess, StepSample, TelemetryBatch

POINTS = {0: 12, 1: 9}  # steps reported per rank; unequal, so a mixed-up trace shows


def _feed(ctl: LiveController) -> str:
    with ctl.client("admin") as client:
        job = client.submit_job(JobCreate(name="browser-e2e", steps=50))
        now = time.time()
        samples = [
            StepSample(
                job_id=job.id,
                rank=rank,
                world_size=len(POINTS),
                step=step,
                ts=now + step,
                loss=4.0 - 0.1 * step,
                step_time_s=0.2,
                tokens=512,
                tokens_per_s=2560.0,
            )
            for rank, n in POINTS.items()
            for step in range(n)
        ]
        heartbeat = Heartbeat(
            ts=now, hostname="h1", ranks=[RankProcess(job_id=job.id, rank=r, pid=100 + r) for r in POINTS]
        )
    with VigilClient(ctl.url, token=ctl.token("agent")) as agent:
        ack = agent.post_telemetry(
            TelemetryBatch(
                agent_id="agent-1", node_id="node-1", seq=0, sent_at=now, samples=samples, heartbeat=heartbeat
            )
        )
        assert ack.accepted and ack.stored >= len(samples), ack
        return job.id


def test_real_controller_jobs_and_job_page(browser: Browser, tmp_path: Path) -> None:
    ctl = LiveController(tmp_path, mount_dashboard=True).start()
    url = ctl.url
    job_id = _feed(ctl)
    browser.blank()
    try:
        browser.get(f"{url}/dashboard/")
        (row,) = browser.wait_css(f'tr[data-job-id="{job_id}"]')
        assert "browser-e2e" in row.text and "PENDING" in row.text

        browser.get(f"{url}/dashboard/jobs/{job_id}")

        def points() -> int | None:
            graph = browser.graph("job-detail-loss")
            return graph["traces"][0]["n"] if graph and graph["traces"] else None

        # One job-wide point per step that any rank reported.
        browser.wait_equal(points, max(POINTS.values()), what="loss points from the real controller")
        assert browser.graph("job-detail-loss")["traces"][0]["name"] == "train loss"

        browser.get(f"{url}/dashboard/nodes")
        (host,) = browser.wait_css('div.ag-row[row-id="node-1"] div[col-id="hostname"]')
        assert host.text == "h1"
        assert browser.console_errors() == []
    finally:
        browser.blank()
        ctl.stop()
