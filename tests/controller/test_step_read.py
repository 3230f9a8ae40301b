"""The one reader of per-step aggregates (controller/step_read.py): final and forming steps of one job read
together and alike, one cap on the forming ones for every reader, non-finite losses already None when read.

Runs the real app (``create_app``) on SQLite and PostgreSQL (``db_url``), its telemetry maintainer driven
one pass at a time; expected means are computed here from the samples.

Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from controller import step_read
from controller.goodput import job_timeline
from controller.models import Job
from controller.step_read import (
    cut_before_unshown,
    forming_aggregates,
    newest_final,
    read_steps,
    step_records,
)
from tests.controller.samples import coll_sample, step_sample
from tests.controller.telemetry_client import create_job, make_client, post

API = "/api/v1"


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(db_url, tmp_path) as c:
        yield c


def _samples(job: str, steps: range, ranks: range, t0: float, loss: dict[tuple[int, int], float]) -> list[dict]:
    """Step samples (rank r's step time 0.1 + r/100, loss 2 + r unless ``loss`` says) and one collective each."""
    out = []
    for s in steps:
        for r in ranks:
            out.append({**step_sample(job, r, s, 0.1 + r / 100, t0 + s), "loss": loss.get((s, r), 2.0 + r)})
            out.append(coll_sample(job, r, s, 0, 0.01 * (r + 1), t0 + s))
    return out


def _aggregate(client: TestClient) -> None:
    assert client.app.state.telemetry.step(now=time.time() + 10).aggregated_steps > 0


def _records(client: TestClient, job: str) -> dict[int, step_read.StepRecord]:
    with client.app.state.sessions() as s:
        return step_records(s, read_steps(s, job))


def test_final_and_forming_steps_of_one_job_read_together_and_alike(client: TestClient) -> None:
    job = create_job(client)
    t0 = time.time() - 100
    # Step 2: rank 1's loss NaN (JSON carries it; stored as null at the edge); step 3: every rank's not finite.
    nan = {(2, 1): math.nan, (3, 0): math.inf, (3, 1): math.nan, (3, 2): -math.inf}
    post(client, _samples(job, range(4), range(3), t0, nan), 0)
    _aggregate(client)
    # Steps 4 and 5 new; a late rank 3 for step 1 makes it dirty again (forming, over its aggregate).
    post(client, _samples(job, range(4, 6), range(3), t0, {}) + _samples(job, range(1, 2), range(3, 4), t0, {}), 1)
    before = _records(client, job)
    assert sorted(before) == [0, 1, 2, 3, 4, 5]
    assert [before[s].final for s in range(6)] == [True, False, True, True, False, False]
    assert before[1].reporting == 4 and before[1].slowest_rank == 3 and before[1].step_time_max_s == pytest.approx(0.13)
    assert before[2].loss == pytest.approx((2.0 + 4.0) / 2) and before[3].loss is None  # finite ones only
    assert before[4].loss == pytest.approx(3.0) and before[4].wire_bytes == 3 * 1500
    assert before[5].ts == pytest.approx(t0 + 5) and before[5].start_ts == pytest.approx(t0 + 5 - 0.12)
    # Aggregated now: every step final, and each forming figure was already the aggregator's.
    _aggregate(client)
    after = _records(client, job)
    assert all(r.final for r in after.values())
    for s in range(6):
        assert after[s]._replace(final=False) == pytest.approx(before[s]._replace(final=False)), s


def test_one_cap_on_forming_steps_for_every_reader(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cap at 2, the overview, /steps, /collectives and goodput all compute the same two newest dirty
    steps from raw rows; the older dirty ones (no aggregate yet) are not forming anywhere."""
    monkeypatch.setattr(step_read, "MAX_FORMING_STEPS", 2)
    job = create_job(client)
    t0 = time.time() - 100
    post(client, _samples(job, range(5), range(2), t0, {}), 0)
    with client.app.state.sessions() as s:
        st = read_steps(s, job)
        assert st.forming == [3, 4] and st.dirty == {0, 1, 2, 3, 4}
        records = step_records(s, st)
        assert sorted(records) == [3, 4] and not any(r.final for r in records.values())
        assert cut_before_unshown(s, st, records) == {}  # steps 0..2 cannot show yet: nothing after them either
        assert sorted(forming_aggregates(s, st)) == [3, 4]
        assert newest_final(s, job) is None
        assert [r.step for r in job_timeline(s, s.get(Job, job), time.time()).steps] == [3, 4]  # goodput
    ov = client.get(f"{API}/jobs/{job}/overview").json()
    assert ov["step"] == [] and ov["last_step"] is None
    steps = client.get(f"{API}/jobs/{job}/steps").json()["data"]
    rank0 = next(d for d in steps if d["rank"] == 0)
    assert rank0["step"] == [0, 1, 2, 3, 4] and rank0["final"] == [False] * 5
    # Forming: the wait inside collectives computed; older dirty steps: raw rows, wait unknown.
    assert rank0["comm_wait_s"][:3] == [None] * 3 and rank0["comm_wait_s"][3:] == [0.0, 0.0]
    colls = client.get(f"{API}/jobs/{job}/collectives").json()["data"]
    assert [c["step"] for c in colls] == [[3, 4]]
    _aggregate(client)
    with client.app.state.sessions() as s:
        latest = newest_final(s, job)
        assert latest is not None and latest.step == 4 and latest.loss_mean == pytest.approx(2.5)
        assert [r.step for r in job_timeline(s, s.get(Job, job), time.time()).steps] == [0, 1, 2, 3, 4]
    ov = client.get(f"{API}/jobs/{job}/overview").json()
    assert ov["step"] == [0, 1, 2, 3, 4] and ov["final"] == [True] * 5 and ov["loss"] == pytest.approx([2.5] * 5)


def test_the_overview_lists_are_the_records_fields_by_the_same_names(client: TestClient) -> None:
    """No renaming between the reader and the REST answer: each per-step list of the overview is the
    record's field of the same name."""
    job = create_job(client)
    t0 = time.time() - 100
    post(client, _samples(job, range(3), range(2), t0, {(1, 0): math.nan}), 0)
    _aggregate(client)
    post(client, _samples(job, range(3, 4), range(2), t0, {}), 1)
    records = sorted(_records(client, job).values())
    ov = client.get(f"{API}/jobs/{job}/overview").json()
    for name in step_read.StepRecord._fields:
        if name in ov:
            assert ov[name] == [getattr(r, name) for r in records], name
    assert ov["loss"][1] == pytest.approx(3.0) and ov["final"] == [True, True, True, False]
