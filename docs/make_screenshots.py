"""Screenshots of the dashboard's main views, from a real run with faults (docs/img/*.png, used by the
README and docs/DASHBOARD.md).

    .venv/bin/python docs/make_screenshots.py [--out docs/img] [--steps 360] [--live]

What it does, all real: starts a local cluster as ``vigil up --nodes 3`` does (Ray head + 3 worker
raylets, an agent per node, the controller with the dashboard mounted), submits the bundled GPT demo
on 3 ranks, injects a 3x straggler (rank 2, compute) and later a hang (rank 1, SIGSTOP), lets Vigil
detect, evict / restart and finish, runs a second, fault-free job of the same model under another
optimizer for the compare page, then drives Debian's Chromium through every view and saves a PNG of
each. Takes 5-10 minutes on this 2-core machine. ``--live`` instead runs the demo under ``recovery.policy:
live`` with rank 1 killed mid-run and saves its Incidents tab (the recovery's phases) as
``job-incidents-live.png`` (2-4 minutes). Needs root-free Ray, chromium and chromium-driver
(``make browser``) and selenium (the test extras).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ops.cli.jobs import demo_job_spec
from ops.localcluster import start_local_cluster
from vigil.contract.client import VigilClient
from vigil.contract.probe import free_port
from vigil.contract.schemas import FaultCreate, FaultKind, JobCreate

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TABS = ("training", "ranks", "breakdown", "communication", "incidents", "checkpoints", "goodput")


def _spec(steps: int, name: str, optimizer: dict) -> JobCreate:
    base = demo_job_spec().model_dump(mode="json")
    base.update(name=name, steps=steps, optimizer={**base["optimizer"], **optimizer},
                scaling={"min_workers": 3, "max_workers": 3, "cpus_per_worker": 1},
                checkpoint={"interval_steps": 40, "keep_last": 3}, eval_interval=60)
    return JobCreate.model_validate(base)


def _wait_done(client: VigilClient, job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get_job(job_id)
        if job.status.is_terminal():
            return job.status.value
        time.sleep(2.0)
    raise TimeoutError(f"{job_id} did not finish in {timeout_s:.0f} s")


def _browser():  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                 "--hide-scrollbars"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _shot(driver, path: Path, settle_s: float = 3.0, height: int | None = None) -> None:  # type: ignore[no-untyped-def]
    time.sleep(settle_s)
    h = height or min(2400, int(driver.execute_script("return document.body.scrollHeight;")) + 40)
    driver.set_window_size(1400, max(800, h))
    time.sleep(1.0)
    driver.save_screenshot(str(path))
    print(f"saved {path}", flush=True)


def live_shot(out: Path, steps: int) -> None:
    """The demo under ``recovery.policy: live`` (3 replicas, a quorum of 2), rank 1 killed at step 60: its
    replacement heals from a peer while the others train on; the Incidents tab shows the phases."""
    home = Path(tempfile.mkdtemp(prefix="vigil-shots-"))
    cluster = start_local_cluster(home, nodes=3, cpus_per_node=2, port=free_port())
    try:
        with VigilClient(cluster.controller_url, token=cluster.admin_token, timeout=30) as client:
            spec = _spec(steps, "demo-gpt-live", {"kind": "adamw"}).model_dump(mode="json")
            spec["recovery"] = {"policy": "live"}
            spec["scaling"]["min_workers"] = 2
            job = client.submit_job(JobCreate.model_validate(spec))
            client.inject_fault(job.id, FaultCreate(kind=FaultKind.KILL_RANK, rank=1, step=60))
            print(f"{job.id} {_wait_done(client, job.id, 900)}", flush=True)
        driver = _browser()
        try:
            driver.get(f"{cluster.controller_url}/dashboard/jobs/{job.id}")
            time.sleep(2.0)
            driver.find_element("id", "job-detail-tab-incidents").click()
            _shot(driver, out / "job-incidents-live.png")
        finally:
            driver.quit()
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "img"))
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--live", action="store_true", help="Only the live recovery's Incidents tab.")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.live:
        live_shot(out, args.steps)
        return 0
    home = Path(tempfile.mkdtemp(prefix="vigil-shots-"))
    cluster = start_local_cluster(home, nodes=3, cpus_per_node=2, port=free_port())
    try:
        with VigilClient(cluster.controller_url, token=cluster.admin_token, timeout=30) as client:
            job = client.submit_job(_spec(args.steps, "demo-gpt-faults", {"kind": "adamw"}))
            client.inject_fault(job.id, FaultCreate(kind=FaultKind.SLOW_RANK, rank=2, step=60,
                                                    params={"factor": 3.0, "mode": "compute"}))
            client.inject_fault(job.id, FaultCreate(kind=FaultKind.HANG_RANK, rank=1, step=args.steps * 2 // 3))
            print(f"{job.id}: straggler at step 60, hang at step {args.steps * 2 // 3}", flush=True)
            status = _wait_done(client, job.id, 1200)
            print(f"{job.id} {status}", flush=True)
            other = client.submit_job(_spec(args.steps // 2, "demo-gpt-dsm", {"kind": "dsm", "lr": 0.001}))
            print(f"{other.id} {_wait_done(client, other.id, 900)}", flush=True)
            node = cluster.node_ids[-1]
        driver = _browser()
        try:
            dash = f"{cluster.controller_url}/dashboard/"
            driver.get(f"{dash}jobs/{job.id}")
            for tab in TABS:
                time.sleep(2.0)
                driver.find_element("id", f"job-detail-tab-{tab}").click()
                _shot(driver, out / f"job-{tab}.png")
                driver.set_window_size(1400, 1000)
            driver.get(f"{dash}nodes")
            _shot(driver, out / "nodes.png", height=900)
            driver.get(f"{dash}nodes/{node}")
            _shot(driver, out / "node.png")
            driver.get(f"{dash}compare?jobs={job.id},{other.id}")
            _shot(driver, out / "compare.png")
        finally:
            driver.quit()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
