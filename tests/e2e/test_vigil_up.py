"""`vigil up` as a user runs it: a subprocess that starts the local platform, submits a job, shows its
progress to the end, keeps serving, and on Ctrl-C (SIGINT) stops every process it started.

Also checks the bundled demo job of `make run`: a valid spec whose injected fault lands between two
checkpoints of its run.

Needs: nothing outside the venv. Takes about a minute and a half.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from controller.rankuser import private_storage
from ops.cli import demo_job_spec
from ops.localcluster import free_port
from vigil.contract.settings import admin_token_path

pytestmark = pytest.mark.slow

JOB = """name: up-e2e
model: {n_layer: 1, n_head: 2, d_model: 32, context: 32}
data: {max_bytes: 300000}
optimizer: {kind: adamw, lr: 0.01}
scaling: {min_workers: 2, max_workers: 2, cpus_per_worker: 1}
steps: 30
batch_size: 8
lr_schedule: {kind: constant, warmup_steps: 0}
checkpoint: {interval_steps: 10, keep_last: 2}
"""


def test_demo_job_is_valid_and_its_fault_lands_between_checkpoints() -> None:
    spec = demo_job_spec()
    at = spec.steps // 2  # where `vigil up` kills rank 1
    assert spec.scaling.min_workers == 2 and spec.recovery.policy.value == "evict_restart"
    assert at % spec.checkpoint.interval_steps != 0 and at > spec.checkpoint.interval_steps


def _marked(mark: str) -> list[psutil.Process]:
    """Every process that inherited the test's mark from `vigil up`: its controller and agents
    (``VIGIL_TEST_MARK``), and Ray's daemons too (`ray start` leaves them re-parented). Ray's get an allowlisted
    environment (no VIGIL_* of the operator's: docs/SECURITY.md), which keeps ``RAY_*``: they carry the mark
    as ``RAY_VIGIL_TEST_MARK`` (a name Ray has no setting for)."""
    out = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if mark in (env.get("VIGIL_TEST_MARK"), env.get("RAY_VIGIL_TEST_MARK")):
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_vigil_up_runs_a_job_serves_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(JOB)
    home, port = tmp_path / "home", free_port()
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "up", "--home", str(home), "--nodes", "2",
         "--port", str(port), "--job", str(job_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", VIGIL_TEST_MARK=mark, RAY_VIGIL_TEST_MARK=mark),
    )
    lines: list[str] = []
    serving = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "serving; Ctrl-C to stop" in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert serving.wait(420), "".join(lines)[-4000:]
        out = "".join(lines)
        assert f"dashboard:  http://127.0.0.1:{port}/dashboard/" in out
        assert "up-e2e" in out and "SUCCEEDED" in out, out[-4000:]
        # Serving: the dashboard answers, and the job is there for the CLI's token.
        token = admin_token_path(home).read_text().strip()
        assert httpx.get(f"http://127.0.0.1:{port}/dashboard/", timeout=30).status_code == 200
        jobs = httpx.get(f"http://127.0.0.1:{port}/api/v1/jobs", headers={"Authorization": f"Bearer {token}"},
                         timeout=30).json()["data"]
        assert [(j["name"], j["status"], j["last_step"]) for j in jobs] == [("up-e2e", "SUCCEEDED", 30)]
        started = [p for p in _marked(mark) if p.pid != proc.pid]
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "raylet" in names and "gcs_server" in names and " agent " in names, names[:2000]
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        reader.join(10)
    shutil.rmtree(private_storage(home), ignore_errors=True)  # the checkpoints vigil up keeps for the next start
    assert "stopped" in "".join(lines)[-300:]
    time.sleep(1)
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], [(p.pid, p.cmdline()[:4]) for p in left]
