"""The aggregation passes in a process of their own (controller/aggregation_process.py).

A real ``vigil controller`` process on SQLite and on PostgreSQL (``db_url``): its aggregates are
computed by a child process, which the controller starts again when it dies and which does not
outlive a controller killed with SIGKILL. Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql case.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import func, select

from controller import migrate
from controller.aggregation_process import AggregationProcess
from controller.app import aggregation_process
from controller.db import make_engine, make_session_factory, session_scope
from controller.models import JobStepStat
from controller.tokens import create_token
from tests.harness import ControllerProcess
from vigil.contract.probe import wait_for
from vigil.contract.schemas import Role, TokenCreate
from vigil.contract.settings import Settings

API = "/api/v1"


@pytest.fixture
def controller_proc(db_url: str, tmp_path: Path) -> Iterator[tuple[ControllerProcess, dict[str, str]]]:
    """A ``vigil controller`` process on ``db_url`` (not started) and an admin and an agent token."""
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    with session_scope(make_session_factory(engine)) as s:
        tokens = {role: create_token(s, TokenCreate(role=role, name="t")).token for role in (Role.ADMIN, Role.AGENT)}
    engine.dispose()
    process = ControllerProcess(tmp_path, db_url)
    try:
        yield process, {"admin": tokens[Role.ADMIN], "agent": tokens[Role.AGENT]}
    finally:
        process.stop()


def _aggregators(pid: int) -> list[psutil.Process]:
    """The controller's aggregation children (multiprocessing spawn children, not its resource tracker)."""
    out = []
    for p in psutil.Process(pid).children():
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _post_steps(ctl: ControllerProcess, token: str, job: str, steps: range, seq: int) -> None:
    now = time.time()
    samples = []
    for step in steps:
        for rank in range(2):
            samples.append({"kind": "step", "job_id": job, "rank": rank, "world_size": 2, "step": step, "ts": now,
                            "loss": 1.0, "step_time_s": 0.1})
            samples += [{"kind": "collective", "job_id": job, "rank": rank, "step": step, "seq": q, "op": "all_reduce",
                         "payload_bytes": 8, "wire_bytes": 8, "duration_s": 0.01 * (rank + 1), "ts": now}
                        for q in range(2)]
    r = httpx.post(f"{ctl.url}{API}/telemetry", headers={"Authorization": f"Bearer {token}"}, timeout=10,
                   json={"agent_id": "agent-1", "node_id": "node-1", "seq": seq, "sent_at": now, "samples": samples})
    assert r.status_code == 200 and r.json()["stored"] == len(samples), r.text


def _aggregated(db_url: str, job: str) -> int:
    engine = make_engine(db_url)
    try:
        with engine.connect() as c:
            return int(c.scalar(select(func.count()).select_from(JobStepStat).where(JobStepStat.job_id == job)) or 0)
    finally:
        engine.dispose()


def test_a_child_aggregates_is_started_again_when_it_dies_and_ends_with_its_controller(
        controller_proc: tuple[ControllerProcess, dict[str, str]], db_url: str) -> None:
    ctl, tokens = controller_proc
    ctl.start()
    r = httpx.post(f"{ctl.url}{API}/jobs", headers={"Authorization": f"Bearer {tokens['admin']}"},
                   json={"name": "agg-process", "steps": 10}, timeout=10)
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    _post_steps(ctl, tokens["agent"], job, range(3), 0)
    wait_for(lambda: _aggregated(db_url, job) == 3, timeout=30, what="3 steps aggregated")
    children = _aggregators(ctl.proc.pid)
    assert len(children) == 1, children
    first = children[0]

    first.kill()  # the aggregator dies: the leader's loop starts another, which goes on
    first.wait(10)
    wait_for(lambda: [p.pid for p in _aggregators(ctl.proc.pid)] not in ([], [first.pid]), timeout=15,
             what="a new aggregation process")
    _post_steps(ctl, tokens["agent"], job, range(3, 5), 1)
    wait_for(lambda: _aggregated(db_url, job) == 5, timeout=30, what="steps 3-4 aggregated by the new child")

    second = _aggregators(ctl.proc.pid)[0]
    ctl.kill()  # SIGKILL: no shutdown code runs in the controller; the child notices its parent is gone
    gone, alive = psutil.wait_procs([second], timeout=10)
    for p in alive:  # (only when the test fails: leave no orphan behind)
        p.kill()
    assert second in gone and not alive, f"aggregation process {second.pid} outlived its controller"


@pytest.mark.parametrize(("url", "wanted", "expect"), [
    ("sqlite:///{home}/vigil.db", None, True),
    ("sqlite://", None, False),  # in memory: one process by construction
    ("sqlite:///{home}/vigil.db", False, False),
])
def test_where_the_passes_run(tmp_path: Path, url: str, wanted: bool | None, expect: bool) -> None:
    url = url.format(home=tmp_path)
    engine = make_engine(url)
    try:
        got = aggregation_process(Settings(home=tmp_path, database_url=url, aggregation_process=wanted), engine)
    finally:
        engine.dispose()
    assert isinstance(got, AggregationProcess) is expect
