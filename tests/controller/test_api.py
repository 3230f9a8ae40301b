"""REST API over a real database (SQLite and PostgreSQL) with a fake launcher standing in for Ray.

Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases. Ray itself is covered by tests/e2e.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from controller.db import session_scope
from controller.launcher import LaunchStatus
from controller.models import CollectiveMetric, Event, Job, StepMetric, TelemetryBatchSeen
from tests.auth import bearer
from tests.controller.fakes import FakeLauncher
from tests.harness import build_app, in_process, settings_for
from tests.live_controller import LiveController
from vigil.contract.schemas import JobStatus

API = "/api/v1"


@pytest.fixture
def launcher() -> FakeLauncher:
    return FakeLauncher()


@pytest.fixture
def client(db_url: str, tmp_path: Path, launcher: FakeLauncher) -> Iterator[TestClient]:
    with in_process(build_app(settings_for(tmp_path, db_url, max_body_bytes=256 * 1024), launcher=launcher)) as c:
        yield c


def _count(client: TestClient, model: type) -> int:
    with client.app.state.sessions() as s:
        return s.scalar(select(func.count()).select_from(model))


def _job(name: str = "t", **kw: object) -> dict:
    return {"name": name, "steps": 10, **kw}


def _step(job_id: str, rank: int, step: int, loss: float = 2.0) -> dict:
    return {"kind": "step", "job_id": job_id, "rank": rank, "step": step, "ts": time.time(), "loss": loss,
            "step_time_s": 0.1, "tokens": 64, "tokens_per_s": 640.0}


def _coll(job_id: str, rank: int, step: int, seq: int) -> dict:
    return {"kind": "collective", "job_id": job_id, "rank": rank, "step": step, "seq": seq, "op": "all_reduce",
            "payload_bytes": 400, "wire_bytes": 400, "elements": 100, "duration_s": 0.01, "ts": time.time()}


def _batch(job_id: str, seq: int, agent: str = "a1", node: str = "n1", n_steps: int = 3) -> dict:
    samples = []
    for st in range(n_steps):
        for r in range(2):
            samples += [_step(job_id, r, st, 5.0 - st), _coll(job_id, r, st, 0)]
    return {"agent_id": agent, "node_id": node, "seq": seq, "sent_at": time.time(), "samples": samples,
            "heartbeat": {"ts": time.time(), "hostname": "h", "address": "127.0.0.1",
                          "ranks": [{"job_id": job_id, "rank": 0, "pid": 1}]}}


# --- jobs ---------------------------------------------------------------------------------------


def test_submit_list_get(client: TestClient) -> None:
    r = client.post(f"{API}/jobs", json=_job("first", optimizer={"kind": "adamw", "lr": 0.01}))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "PENDING" and job["spec"]["optimizer"]["lr"] == 0.01
    listed = client.get(f"{API}/jobs").json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == job["id"]
    assert client.get(f"{API}/jobs/{job['id']}").json()["name"] == "first"


@pytest.mark.parametrize(
    ("body", "field", "rule"),
    [
        ({"name": "x", "steps": 0}, "steps", "greater than or equal to 1"),
        ({"name": ""}, "name", "at least 1 character"),
        ({"name": "x" * 200}, "name", "at most 128 characters"),
        ({"name": "x", "optimizer": {"kind": "sgd"}}, "kind", "Input should be"),
        ({"name": "x", "scaling": {"min_workers": 4, "max_workers": 2}}, "scaling", "min_workers (4) must be <="),
        ({"name": "x", "model": {"d_model": 65, "n_head": 2}}, "model", "multiple of n_head"),
        ({"name": "x", "optimizer": {"lr": -1}}, "lr", "greater than 0"),
        ({"name": "x", "surprise": 1}, "surprise", "Extra inputs are not permitted"),
    ],
)
def test_invalid_job_is_422_naming_field_and_stores_nothing(client: TestClient, body: dict, field: str,
                                                            rule: str) -> None:
    r = client.post(f"{API}/jobs", json=body)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) for d in detail), detail
    assert any(rule in d["msg"] for d in detail), detail
    assert _count(client, Job) == 0 and _count(client, Event) == 0


def test_unknown_job_is_404(client: TestClient) -> None:
    for path in ("", "/metrics", "/logs"):
        assert client.get(f"{API}/jobs/job_nope{path}").status_code == 404
    assert client.post(f"{API}/jobs/job_nope/cancel").status_code == 404


def test_supervisor_launches_and_follows_status(client: TestClient, launcher: FakeLauncher) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    sup = client.app.state.supervisor
    sup.step()
    assert [s[0] for s in launcher.submitted] == [job_id]
    assert "VIGIL_RUN_DIR" in launcher.submitted[0][2]
    driver = {"Authorization": f"Bearer {launcher.submitted[0][2]['VIGIL_TOKEN']}"}
    assert client.get(f"{API}/jobs/{job_id}", headers=driver).status_code == 200  # its own job, while it runs
    launch_id = client.get(f"{API}/jobs/{job_id}").json()["ray_job_id"]
    launcher.statuses[launch_id] = LaunchStatus(JobStatus.RUNNING)
    sup.step()
    assert client.get(f"{API}/jobs/{job_id}").json()["status"] == "RUNNING"
    launcher.statuses[launch_id] = LaunchStatus(JobStatus.SUCCEEDED)
    sup.step()
    job = client.get(f"{API}/jobs/{job_id}").json()
    assert job["status"] == "SUCCEEDED" and job["finished_at"] is not None
    assert client.get(f"{API}/jobs/{job_id}", headers=driver).status_code == 401  # revoked when the job ended
    kinds = [e["message"] for e in client.get(f"{API}/events", params={"job_id": job_id}).json()["data"]]
    assert "PENDING -> RUNNING" in kinds and "RUNNING -> SUCCEEDED" in kinds


def test_a_finished_job_ends_at_the_step_its_driver_reports(client: TestClient, launcher: FakeLauncher) -> None:
    """Telemetry that never arrived (an agent killed mid-job) must not make a finished job look short."""
    short, long_, liar = (client.post(f"{API}/jobs", json=_job(steps=600)).json()["id"] for _ in range(3))
    sup = client.app.state.supervisor
    sup.step()
    # The driver log is the job's own: a line claiming more steps than the job has (or more than the
    # database's integer holds) is ignored, never stored.
    for job_id, said in ((short, 600), (long_, 3), (liar, 10**12)):
        launch_id = client.get(f"{API}/jobs/{job_id}").json()["ray_job_id"]
        launcher.log_text[launch_id] = (f"vigil trainer: job other SUCCEEDED step=900 loss=None\n"  # not this job
                                        f"vigil trainer: job {job_id} SUCCEEDED step={said} loss=0.1 val_loss=None\n")
        launcher.statuses[launch_id] = LaunchStatus(JobStatus.RUNNING)
    sup.step()
    with session_scope(client.app.state.sessions) as s:
        for job_id in (short, long_, liar):
            s.get(Job, job_id).last_step = 410
    for job_id in (short, long_, liar):
        launcher.statuses[client.get(f"{API}/jobs/{job_id}").json()["ray_job_id"]] = LaunchStatus(JobStatus.SUCCEEDED)
    sup.step()
    assert client.get(f"{API}/jobs/{short}").json()["last_step"] == 600
    assert client.get(f"{API}/jobs/{long_}").json()["last_step"] == 410  # never lowered
    assert client.get(f"{API}/jobs/{liar}").json()["last_step"] == 410  # never past the job's steps
    events = client.get(f"{API}/events", params={"job_id": short}).json()["data"]
    assert any(e["kind"] == "final_step" and "410" in e["message"] for e in events)


def test_job_finishing_between_polls_passes_through_running(client: TestClient, launcher: FakeLauncher) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    sup = client.app.state.supervisor
    sup.step()
    launcher.statuses[f"fake-{job_id}"] = LaunchStatus(JobStatus.FAILED, "rank 1 died")
    sup.step()
    job = client.get(f"{API}/jobs/{job_id}").json()
    assert job["status"] == "FAILED" and job["message"] == "rank 1 died"


def test_launch_failure_is_retried_then_fails_job(client: TestClient, launcher: FakeLauncher) -> None:
    launcher.fail_submit = True
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    sup = client.app.state.supervisor
    sup.step()
    assert client.get(f"{API}/jobs/{job_id}").json()["status"] == "PENDING"  # retried while Ray warms up
    sup.launch_retry_s = 0
    sup.step()
    job = client.get(f"{API}/jobs/{job_id}").json()
    assert job["status"] == "FAILED" and "cluster unreachable" in job["message"]


def test_launch_succeeds_after_a_transient_refusal(client: TestClient, launcher: FakeLauncher) -> None:
    launcher.fail_submit = True
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    client.app.state.supervisor.step()
    launcher.fail_submit = False
    client.app.state.supervisor.step()
    assert client.get(f"{API}/jobs/{job_id}").json()["ray_job_id"] == f"fake-{job_id}"


def test_cancel_then_cancel_again_is_409(client: TestClient, launcher: FakeLauncher) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    client.app.state.supervisor.step()
    r = client.post(f"{API}/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED"
    assert launcher.stopped == [f"fake-{job_id}"]
    assert client.post(f"{API}/jobs/{job_id}/cancel").status_code == 409
    client.app.state.supervisor.step()  # the engine's STOPPED must not move a terminal job
    assert client.get(f"{API}/jobs/{job_id}").json()["status"] == "CANCELLED"


def test_a_failed_commit_is_an_error_answer_never_a_lost_success(live_controller: LiveController) -> None:
    """Over real HTTP: a commit that fails is a 5xx, never a 2xx for a write that was never stored.
    (The session is scoped to the handler, so the commit also happens before the answer leaves: with
    FastAPI's default request scope, 1 in 200 fault posts was seen answered before its row was
    visible to the next request.)"""
    job = live_controller.submit_job("c", steps=10)
    app = live_controller.app
    real = app.state.sessions

    def failing_commit() -> Session:
        session = real()

        def commit() -> None:
            raise OperationalError("COMMIT", {}, RuntimeError("disk full"))

        session.commit = commit  # type: ignore[method-assign]
        return session

    app.state.sessions = failing_commit
    try:
        r = httpx.post(f"{live_controller.url}{API}/jobs/{job.id}/cancel", timeout=30,
                       headers=bearer(live_controller.token("admin")))
    finally:
        app.state.sessions = real
    assert r.status_code >= 500, (r.status_code, r.text)
    assert live_controller.client().get_job(job.id).status != JobStatus.CANCELLED


def test_logs_come_from_the_launcher(client: TestClient) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    client.app.state.supervisor.step()
    assert client.get(f"{API}/jobs/{job_id}/logs").json()["logs"] == f"logs of fake-{job_id}\n"


# --- telemetry ----------------------------------------------------------------------------------


def test_ingest_is_idempotent_and_feeds_metrics_and_nodes(client: TestClient) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    body = _batch(job_id, seq=0)
    first = client.post(f"{API}/telemetry", json=body).json()
    assert first == {"accepted": True, "duplicate": False, "stored": 12}
    again = client.post(f"{API}/telemetry", json=body).json()
    assert again == {"accepted": True, "duplicate": True, "stored": 0}
    assert _count(client, StepMetric) == 6 and _count(client, CollectiveMetric) == 6
    m = client.get(f"{API}/jobs/{job_id}/metrics").json()
    assert [s["rank"] for s in m["ranks"]] == [0, 1]
    assert m["ranks"][1]["step"] == [0, 1, 2] and m["ranks"][1]["loss"] == [5.0, 4.0, 3.0]
    job = client.get(f"{API}/jobs/{job_id}").json()
    assert job["last_step"] == 2 and job["last_loss"] == 3.0
    nodes = client.get(f"{API}/nodes").json()
    assert nodes["count"] == 1 and nodes["data"][0]["ranks"][0]["job_id"] == job_id
    assert nodes["data"][0]["heartbeat_age_s"] < 60


def test_gzip_batch_accepted(client: TestClient) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    raw = gzip.compress(json.dumps(_batch(job_id, seq=7)).encode())
    r = client.post(f"{API}/telemetry", content=raw,
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["stored"] == 12


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda b: b["samples"][3].update(step=-1), "step"),
        (lambda b: b["samples"][0].update(step_time_s=float("inf")), "step_time_s"),
        (lambda b: b.update(seq="x"), "seq"),
        (lambda b: b["samples"][1].update(kind="bogus"), "bogus"),
        (lambda b: b.pop("agent_id"), "agent_id"),
    ],
)
def test_bad_batch_is_422_and_stores_nothing(client: TestClient, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    body = _batch(job_id, seq=1)
    mutate(body)
    r = client.post(f"{API}/telemetry", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert needle in json.dumps(r.json()["detail"])
    assert _count(client, StepMetric) == 0 and _count(client, TelemetryBatchSeen) == 0


def test_oversized_and_garbage_bodies_rejected(client: TestClient) -> None:
    big = b"{" + b" " * (300 * 1024) + b"}"
    assert client.post(f"{API}/telemetry", content=big).status_code == 413
    bomb = gzip.compress(b" " * (2 * 1024 * 1024))
    r = client.post(f"{API}/telemetry", content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["detail"]
    assert client.post(f"{API}/telemetry", content=b"not gzip", headers={"Content-Encoding": "gzip"}).status_code == 422
    assert client.post(f"{API}/telemetry", content=b"{nope").status_code == 422
    assert _count(client, TelemetryBatchSeen) == 0


def test_samples_for_unknown_jobs_are_dropped_not_fatal(client: TestClient) -> None:
    r = client.post(f"{API}/telemetry", json=_batch("job_gone", seq=3))
    assert r.status_code == 200 and r.json()["stored"] == 0
    assert _count(client, StepMetric) == 0


def test_metrics_downsample(client: TestClient) -> None:
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    client.post(f"{API}/telemetry", json=_batch(job_id, seq=0, n_steps=50))
    m = client.get(f"{API}/jobs/{job_id}/metrics", params={"max_points": 10}).json()
    steps = m["ranks"][0]["step"]
    assert len(steps) <= 11 and steps[0] == 0 and steps[-1] == 49
    assert client.get(f"{API}/jobs/{job_id}/metrics", params={"since_step": 45}).json()["ranks"][0]["step"] == [
        45, 46, 47, 48, 49]


def test_metrics_downsampling_keeps_a_slow_step(client: TestClient) -> None:
    """Decimated series keep each run's slowest step: a straggler spike never disappears from the chart."""
    job_id = client.post(f"{API}/jobs", json=_job()).json()["id"]
    batch = _batch(job_id, seq=0, n_steps=100)
    for s in batch["samples"]:
        if s["kind"] == "step" and s["step"] == 37:
            s["step_time_s"] = 5.0
    client.post(f"{API}/telemetry", json=batch)
    for series in client.get(f"{API}/jobs/{job_id}/metrics", params={"max_points": 10}).json()["ranks"]:
        assert len(series["step"]) <= 11 and 37 in series["step"] and max(series["step_time_s"]) == 5.0


def test_healthz_and_openapi(client: TestClient) -> None:
    h = client.get(f"{API}/healthz").json()
    assert h["status"] == "ok" and h["database"] in ("sqlite", "postgresql")
    paths = client.get(f"{API}/openapi.json").json()["paths"]
    for p in ("/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/cancel", "/api/v1/jobs/{job_id}/metrics",
              "/api/v1/nodes", "/api/v1/events", "/api/v1/telemetry", "/api/v1/healthz"):
        assert p in paths
