"""A hang named by collective: the ranks' progress reports stored once per rank (both wire formats, newest
wins) and lined up (controller.recovery.collectives) to name the rank that never entered the collective
the others wait in.

Needs: the database (SQLite and PostgreSQL, the ``db_url`` fixture); the app in process (TestClient).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.models import RankProgress
from controller.recovery.collectives import analyse, ranges, summary
from tests.controller.telemetry_client import columnar, make_client
from tests.controller.telemetry_client import create_job as _job
from tests.controller.telemetry_client import post_json as _post


def _state(groups: dict[str, tuple[int, int]], in_flight: list[tuple[str, int, str, float]] = (),
           last_done: tuple[str, int, str] | None = None) -> dict[str, Any]:
    return {
        "groups": [{"group": g, "last_enqueued": e, "last_completed": c} for g, (e, c) in groups.items()],
        "in_flight": [{"group": g, "seq": q, "op": op, "enqueued_ts": ts} for g, q, op, ts in in_flight],
        "last_done": {"group": last_done[0], "seq": last_done[1], "op": last_done[2]} if last_done else None,
    }


def test_the_rank_that_never_entered_the_awaited_collective_is_named() -> None:
    reports = {
        0: {"step": 41, "idle_s": 20.0, "state": _state({"world": (83, 82)}, [("world", 83, "all_reduce", 100.0)])},
        1: {"step": 41, "idle_s": 20.0, "state": _state({"world": (82, 82)}, [], ("world", 82, "all_reduce"))},
        2: {"step": 41, "idle_s": 20.0, "state": _state({"world": (83, 82)}, [("world", 83, "all_reduce", 100.2)])},
    }
    found = analyse(reports)
    assert found is not None
    assert found["waiting_in"] == {"group": "world", "seq": 83, "op": "all_reduce"}
    assert found["waiting_ranks"] == [0, 2] and found["not_entered"] == [1]
    assert found["ranks"]["1"]["last_done"]["seq"] == 82 and found["ranks"]["0"]["in_flight"]["seq"] == 83
    assert summary(found) == "ranks 0, 2 wait in all_reduce #83 of group world; rank 1 never entered it"


def test_a_subgroup_wait_names_only_that_groups_members_and_no_wait_names_nobody() -> None:
    reports = {
        0: {"step": 5, "idle_s": 9.0, "state": _state({"world": (10, 10), "pg1": (4, 3)}, [("pg1", 4, "all_gather", 50.0)])},
        1: {"step": 5, "idle_s": 9.0, "state": _state({"world": (10, 10), "pg1": (3, 3)})},
        2: {"step": 5, "idle_s": 9.0, "state": _state({"world": (10, 10)})},  # not in pg1
    }
    found = analyse(reports)
    assert found is not None and found["waiting_in"]["group"] == "pg1" and found["not_entered"] == [1]
    # Every rank entered it: a stall of the transport, nobody to blame.
    both = {r: {"step": 5, "idle_s": 9.0, "state": _state({"world": (7, 6)}, [("world", 7, "broadcast", 1.0)])}
            for r in (0, 1)}
    assert analyse(both)["not_entered"] == []  # type: ignore[index]
    assert analyse({0: {"step": 5, "idle_s": 9.0, "state": _state({"world": (7, 7)})}}) is None
    assert analyse({}) is None


def test_rank_lists_read_as_ranges() -> None:
    assert ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8" and ranges([3]) == "3" and ranges([]) == ""
    found = {"waiting_in": {"group": "world", "seq": 9, "op": "all_reduce"}, "waiting_ranks": list(range(10_000)),
             "not_entered": [4242]}
    found["waiting_ranks"].remove(4242)
    assert summary(found) == "ranks 0-4241, 4243-9999 wait in all_reduce #9 of group world; rank 4242 never entered it"


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(db_url, tmp_path) as c:
        yield c


def _progress(job: str, rank: int, attempt: int, ts: float, seq: int) -> dict[str, Any]:
    return {"kind": "progress", "job_id": job, "rank": rank, "attempt": attempt, "ts": ts, "step": 3, "idle_s": 4.5,
            **_state({"world": (seq, seq - 1)}, [("world", seq, "all_reduce", ts - 4)], ("world", seq - 1, "all_reduce"))}


@pytest.mark.parametrize("wire", ["json", "columnar"])
def test_progress_reports_are_stored_newest_first_per_rank(client: TestClient, wire: str) -> None:
    post = _post if wire == "json" else columnar
    job, now = _job(client), time.time()
    post(client, [_progress(job, 0, 1, now, 7), _progress(job, 1, 1, now, 6)], 0)
    post(client, [_progress(job, 0, 1, now - 5, 5)], 1)  # older: changes nothing
    post(client, [_progress(job, 0, 1, now + 1, 8)], 2)
    with client.app.state.sessions() as s:
        rows = {r.rank: r for r in s.query(RankProgress).filter_by(job_id=job)}
        assert sorted(rows) == [0, 1]
        assert rows[0].state["in_flight"][0]["seq"] == 8 and rows[0].ts == pytest.approx(now + 1)
        assert rows[1].state["last_done"]["seq"] == 5 and rows[1].idle_s == 4.5
    bad = {**_progress(job, 0, 1, now, 9), "in_flight": [{"group": "", "seq": 1, "op": "x"}]}
    r = client.post("/api/v1/telemetry", json={"agent_id": "a", "node_id": "n", "seq": 9, "sent_at": now, "samples": [bad]})
    assert r.status_code == 422 and "group" in r.text
