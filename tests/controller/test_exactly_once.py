"""Exactly once per sample: a sample's key (job, rank, step, run attempt[, call seq]) is unique in the
database, so replays under any batch number, from any agent id, reordered or split differently,
store nothing twice; a newer run attempt of a step is new data and wins in every read, even when
the older attempt's samples arrive last; a rank's fault report sets the fault's ``hit_step``.

Runs the real app (``create_app``) over HTTP-less TestClient on SQLite and PostgreSQL (``db_url``).
Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controller.models import CollectiveMetric, Fault, JobStepStat, StepMetric, TelemetryBatchSeen
from tests.controller.samples import coll_sample, step_sample
from tests.controller.telemetry_client import columnar, make_client
from tests.controller.telemetry_client import create_job as _job
from tests.controller.telemetry_client import post_json as _post

API = "/api/v1"


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(db_url, tmp_path) as c:
        yield c


def _rows(client: TestClient, job: str) -> tuple[int, int]:
    with client.app.state.sessions() as s:
        steps = s.scalar(select(func.count()).select_from(StepMetric).where(StepMetric.job_id == job))
        colls = s.scalar(select(func.count()).select_from(CollectiveMetric).where(CollectiveMetric.job_id == job))
    return steps, colls


def _run(job: str, attempt: int, steps: range, ranks: int = 3, calls: int = 2, st: float = 0.1) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    now = time.time()
    for step in steps:
        for rank in range(ranks):
            out.append({**step_sample(job, rank, step, st, now + step), "attempt": attempt})
            out += [{**coll_sample(job, rank, step, q, st / 4, now + step), "attempt": attempt} for q in range(calls)]
    return out


def test_replays_under_any_batch_number_agent_or_order_store_each_sample_once(client: TestClient) -> None:
    job = _job(client)
    samples = _run(job, 1, range(1, 6))  # 15 step samples, 30 collective samples
    assert _post(client, samples, 0)["stored"] == 45
    # The same samples again: renumbered (an agent that lost its counter), from a new agent id (an
    # agent restarted under another id), shuffled and split into other batches (a spool replayed).
    assert _post(client, samples, 7)["stored"] == 0
    shuffled = random.Random(1).sample(samples, len(samples))
    acks = [_post(client, shuffled[i:i + 10], 100 + i, agent="agent-b") for i in range(0, len(shuffled), 10)]
    assert [a["duplicate"] for a in acks] == [False] * 5 and sum(a["stored"] for a in acks) == 0
    # A batch holding one sample twice, next to one that is new: only the new one is stored.
    extra = _run(job, 1, range(6, 7), ranks=1, calls=0)
    assert _post(client, [samples[0], *extra, *extra], 200)["stored"] == 1
    assert _rows(client, job) == (16, 30)
    with client.app.state.sessions() as s:  # each batch's row says what it added, not what it carried
        stored = dict(s.execute(select(TelemetryBatchSeen.seq, TelemetryBatchSeen.samples)
                                .where(TelemetryBatchSeen.agent_id == "agent-a")).all())
    assert stored == {0: 45, 7: 0, 200: 1}


def test_concurrent_replays_of_the_same_samples_store_them_once(client: TestClient) -> None:
    job = _job(client)
    samples = _run(job, 1, range(1, 21), ranks=4, calls=1)  # 160 samples
    stored: list[int] = []
    start = threading.Barrier(4)

    def replay(i: int) -> None:
        start.wait()
        stored.append(_post(client, samples, i, agent=f"agent-{i}")["stored"])

    threads = [threading.Thread(target=replay, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(stored) == [0, 0, 0, 160]
    assert _rows(client, job) == (80, 80)


def test_a_newer_attempt_is_new_data_and_wins_even_when_the_older_arrives_last(client: TestClient) -> None:
    job = _job(client)
    first = _run(job, 1, range(1, 5), st=0.9)  # steps 1-4, slow
    _post(client, first, 0)
    rerun = _run(job, 2, range(3, 7), st=0.1)  # restored from step 2: steps 3-6 again, fast
    _post(client, rerun, 1)
    # The older attempt's samples replayed after the newer one's (an agent's spool, renumbered).
    _post(client, first, 2, agent="agent-restarted")
    assert _rows(client, job) == (3 * 4 + 3 * 4, 2 * (3 * 4 + 3 * 4))  # both attempts kept, once each
    expected = {1: pytest.approx(0.9), 2: pytest.approx(0.9), **{s: pytest.approx(0.1) for s in range(3, 7)}}
    assert _rank0_step_times(client, job) == expected  # read from the raw rows while the steps form
    client.app.state.telemetry.flush()
    with client.app.state.sessions() as s:
        slowest = dict(s.execute(select(JobStepStat.step, JobStepStat.step_time_max_s)
                                 .where(JobStepStat.job_id == job)).all())
        reruns = dict(s.execute(select(JobStepStat.step, JobStepStat.reruns).where(JobStepStat.job_id == job)).all())
    assert slowest[1] == slowest[2] == pytest.approx(0.9)  # ran once
    assert [slowest[s] for s in (3, 4, 5, 6)] == [pytest.approx(0.1)] * 4  # attempt 2 wins
    assert reruns[3] and reruns[4] and not reruns[5]  # steps 3 and 4 ran twice: the earlier run is lost time
    assert _rank0_step_times(client, job) == expected  # the settled aggregates agree


def _rank0_step_times(client: TestClient, job: str) -> dict[int, float]:
    r = client.get(f"{API}/jobs/{job}/steps", params={"rank": 0})
    assert r.status_code == 200, r.text
    series = r.json()["data"][0]
    return dict(zip(series["step"], series["step_time_s"]))


def test_a_ranks_fault_report_sets_the_faults_hit_step_once(client: TestClient) -> None:
    job, other = _job(client), _job(client)
    r = client.post(f"{API}/jobs/{job}/faults", json={"kind": "kill_rank", "rank": 1, "step": 40})
    assert r.status_code == 201, r.text
    fid = r.json()["id"]

    def report(job_id: str, step: int) -> dict[str, Any]:
        return {"kind": "fault", "job_id": job_id, "rank": 1, "step": step, "attempt": 1, "ts": time.time(),
                "fault_id": fid, "fault_kind": "kill_rank"}

    _post(client, [report(other, 39)], 0)  # another job's report cannot touch this fault
    assert client.get(f"{API}/jobs/{job}/faults").json()["data"][0]["hit_step"] is None
    _post(client, [report(job, 40)], 1)
    _post(client, [report(job, 41)], 2)  # a later report (a second fire cannot happen) changes nothing
    with client.app.state.sessions() as s:
        assert s.get(Fault, fid).hit_step == 40
    assert client.get(f"{API}/jobs/{job}/faults").json()["data"][0]["hit_step"] == 40


@pytest.mark.parametrize("wire", ["json", "columnar"])
def test_a_live_heal_and_a_quorum_change_are_events_of_the_job(client: TestClient, wire: str) -> None:
    job = _job(client)
    now = time.time()
    heal = {**coll_sample(job, 1, 41, 0, 0.75, now), "op": "heal", "tag": "live", "payload_bytes": 2_000_000,
            "wire_bytes": 0, "elements": 0}
    reform = {**coll_sample(job, 0, 40, 0, 2.1, now), "op": "quorum", "tag": "reform", "payload_bytes": 0,
              "wire_bytes": 0, "elements": 0}
    plain = [coll_sample(job, r, 40, 1, 0.01, now) for r in range(2)]  # ordinary collectives: no event
    (_post if wire == "json" else columnar)(client, [step_sample(job, 0, 40, 0.1, now), *plain, reform, heal], 0)
    events = client.get(f"{API}/events", params={"job_id": job}).json()["data"]
    live = sorted((e["kind"], e["data"]["rank"], e["data"]["step"]) for e in events if e["kind"].startswith("live_"))
    assert live == [("live_heal", 1, 41), ("live_quorum", 0, 40)]
    assert len([e for e in events if e["kind"].startswith("live_")]) == 2
    text = next(e["message"] for e in events if e["kind"] == "live_heal")
    assert "healed from a live peer in 0.75 s (2.0 MB of state)" in text
