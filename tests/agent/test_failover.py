"""An agent that knows several controllers (``--controller URL1,URL2``) ships and polls through the one
that answers, and moves on when it stops answering (agent/failover.py).

- the failover rule itself, on stub HTTP transports (which errors move on, which do not, stickiness);
- the config: a comma-separated ``controller_url`` / ``VIGIL_CONTROLLER_URL`` / ``--controller``;
- a dead URL first and the REAL controller second (fixture ``live_controller``): every step stored
  exactly once, commands fetched and answered through the live one;
- two REAL controller processes on one PostgreSQL database (the leader and a standby): the leader is
  killed with SIGKILL mid-stream; the agent carries on through the standby, which takes the leadership;
  every sample is stored exactly once (counted in the database) and a command queued after the kill is
  answered.

Needs: loopback, a writable /tmp, the controller's dependencies; PostgreSQL on 127.0.0.1:5432 for the
last test (skipped without it). About 30 s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from agent.config import AgentConfig
from agent.failover import FailoverClient
from agent.main import build_parser, config_from_args
from controller import migrate
from controller.db import make_engine, make_session_factory, session_scope
from controller.models import NodeCommandRow, StepMetric
from controller.recovery.commands import enqueue
from controller.tokens import create_token
from tests.agent.crash_rig import counts, expect, send_steps
from tests.agent.doubles import AgentThread, datagram, send_datagrams, step_dict, wait_for
from tests.harness import ControllerProcess
from tests.live_controller import LiveController
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.probe import free_port
from vigil.contract.schemas import CommandKind, JobCreate, Role, TokenCreate
from vigil.contract.settings import get_settings

pytestmark = pytest.mark.timeout(240)

HEALTH = {"status": "ok", "database": "sqlite", "version": "0"}


def _stub(answer: Callable[[httpx.Request], httpx.Response], calls: list[str], name: str) -> VigilClient:
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(name)
        return answer(request)

    return VigilClient(f"http://{name}", transport=httpx.MockTransport(handler))


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _time_out(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def _ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=HEALTH)


def test_a_call_moves_on_only_when_its_controller_is_down_and_sticks(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    b_answer: list[Callable[[httpx.Request], httpx.Response]] = [_ok]
    c_answer: list[Callable[[httpx.Request], httpx.Response]] = [_ok]
    clients = [_stub(_refuse, calls, "a"), _stub(lambda r: b_answer[0](r), calls, "b"),
               _stub(lambda r: c_answer[0](r), calls, "c")]
    fo = FailoverClient(clients, ["http://a", "http://b", "http://c"], purpose="test")
    with caplog.at_level(logging.INFO, logger="agent.failover"):
        assert fo.call(lambda c: c.health()).status == "ok"
        assert calls == ["a", "b"] and fo.url == "http://b"
        calls.clear()
        fo.call(lambda c: c.health())
        assert calls == ["b"]  # sticks with the one that answered
        switches = [r for r in caplog.records if "from now on" in r.message]
        assert len(switches) == 1 and "http://a" in switches[0].message and "http://b" in switches[0].message

        calls.clear()
        b_answer[0] = lambda r: httpx.Response(503, json={"detail": "database unreachable"})
        fo.call(lambda c: c.health())
        assert calls == ["b", "c"] and fo.url == "http://c"  # a 5xx: on to the next

        calls.clear()
        c_answer[0] = lambda r: httpx.Response(401, json={"detail": "invalid token"})
        with pytest.raises(ApiError) as refused:
            fo.call(lambda c: c.health())
        assert refused.value.status_code == 401 and calls == ["c"]  # an answer, not an outage: no failover

        calls.clear()
        c_answer[0] = _time_out
        b_answer[0] = _refuse
        with pytest.raises(httpx.ConnectError):  # every one down: the last one's error
            fo.call(lambda c: c.health())
        assert calls == ["c", "a", "b"] and fo.url == "http://c"  # wraps around; stays where it was
    fo.close()


def test_config_takes_a_comma_separated_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = AgentConfig(node_id="n", run_dir=tmp_path, token="t", controller_url="http://a:1, http://b:2,")
    assert cfg.controller_urls == ["http://a:1", "http://b:2"] and cfg.controller_url == "http://a:1"
    cfg = AgentConfig(node_id="n", run_dir=tmp_path, token="t", controller_urls=["http://b:2", "http://b:2"])
    assert cfg.controller_urls == ["http://b:2"] and cfg.controller_url == "http://b:2"
    cfg = AgentConfig(node_id="n", run_dir=tmp_path, token="t", controller_url="http://a:1")
    assert cfg.controller_urls == ["http://a:1"]  # the single-URL form, as before

    monkeypatch.setenv("VIGIL_CONTROLLER_URL", "http://10.0.0.1:9000,http://10.0.0.2:9000")
    get_settings.cache_clear()
    try:
        cfg = AgentConfig(node_id="n", run_dir=tmp_path, token="t")
    finally:
        get_settings.cache_clear()
    assert cfg.controller_urls == ["http://10.0.0.1:9000", "http://10.0.0.2:9000"]

    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "t")
    args = build_parser().parse_args(["--node-id", "n", "--controller", "http://a:1,https://b:2"])
    assert config_from_args(args).controller_urls == ["http://a:1", "https://b:2"]

    with pytest.raises(ValidationError, match="controller_urls") as bad:
        AgentConfig(node_id="n", run_dir=tmp_path, token="t", controller_url="http://a:1,ftp://b")
    assert "ftp://b" in str(bad.value)
    with pytest.raises(ValidationError, match="controller_url"):
        AgentConfig(node_id="n", run_dir=tmp_path, token="t", controller_url="http://x:1",
                    controller_urls=["http://a:1"])
    with pytest.raises(ValidationError, match="controller_urls"):
        AgentConfig(node_id="n", run_dir=tmp_path, token="t", controller_urls=[])


def _steps_stored(sessions: object, job_id: str) -> tuple[int, int]:
    """(step rows, distinct (rank, step)) of ``job_id``."""
    with session_scope(sessions) as s:  # type: ignore[arg-type]
        rows = s.scalar(select(func.count()).select_from(StepMetric).where(StepMetric.job_id == job_id))
        keys = s.scalar(select(func.count()).select_from(
            select(StepMetric.rank, StepMetric.step).where(StepMetric.job_id == job_id).distinct().subquery()))
        return int(rows or 0), int(keys or 0)


def _command_status(sessions: object, command_id: int) -> str:
    with session_scope(sessions) as s:  # type: ignore[arg-type]
        row = s.get(NodeCommandRow, command_id)
        assert row is not None
        return str(row.status)


def test_a_dead_url_first_everything_goes_through_the_live_one(short_dir: Path,
                                                                 live_controller: LiveController) -> None:
    live = live_controller
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    job = live.submit_job("failover", steps=10)
    cfg = AgentConfig(node_id="node-fo", controller_url=f"{dead},{live.url}", token=live.token(Role.AGENT),
                      run_dir=short_dir, flush_interval_s=0.1, heartbeat_interval_s=0.2, backoff_initial_s=0.05,
                      backoff_max_s=0.5)
    sessions = live.app.state.sessions
    assert cfg.socket_path is not None and cfg.spool_dir is not None
    with AgentThread(cfg):
        payloads = [datagram([step_dict(i, job_id=job.id, pid=os.getpid()) for i in range(s, s + 20)])
                    for s in range(0, 200, 20)]
        send_datagrams(str(cfg.socket_path), payloads)
        wait_for(lambda: _steps_stored(sessions, job.id)[0] >= 200, 30, "200 steps stored")
        with session_scope(sessions) as s:
            cid = enqueue(s, "node-fo", CommandKind.WRITE_FAULT_FILE,
                          {"job_id": job.id, "rank": 0, "fault": {"kind": "nan_loss", "step": 3}}).id
        wait_for(lambda: _command_status(sessions, cid) != "PENDING", 30, "the command answered")
        time.sleep(0.5)  # a late duplicate would show now
    assert _steps_stored(sessions, job.id) == (200, 200)  # every step once
    assert _command_status(sessions, cid) == "DONE"
    assert (short_dir / "faults" / job.id / "rank-0.json").exists()
    assert live.answered().count(cid) == 1  # answered exactly once
    assert not any(cfg.spool_dir.glob("*.gz"))  # nothing waited for the dead one


@pytest.mark.postgres
def test_the_leader_killed_mid_stream_the_agent_goes_on_through_the_standby(
        postgres_url: str, short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    migrate.upgrade(postgres_url)
    engine = make_engine(postgres_url)
    sessions = make_session_factory(engine)
    with session_scope(sessions) as s:
        admin = create_token(s, TokenCreate(role=Role.ADMIN, name="t")).token
        agent_token = create_token(s, TokenCreate(role=Role.AGENT, name="t")).token
    monkeypatch.setenv("VIGIL_LEADER_INTERVAL_S", "0.3")
    (short_dir / "a").mkdir()
    (short_dir / "b").mkdir()
    leader, standby = ControllerProcess(short_dir / "a", postgres_url), ControllerProcess(short_dir / "b", postgres_url)
    try:
        leader.start()
        standby.start()
        assert httpx.get(f"{leader.url}/api/v1/healthz").json()["leader"] is True
        assert httpx.get(f"{standby.url}/api/v1/healthz").json()["leader"] is False
        with VigilClient(leader.url, token=admin) as c:
            job = c.submit_job(JobCreate(name="failover", steps=10_000)).id
        cfg = AgentConfig(node_id="node-crash", controller_urls=[leader.url, standby.url], token=agent_token,
                          run_dir=short_dir, flush_interval_s=0.1, heartbeat_interval_s=0.2,
                          backoff_initial_s=0.05, backoff_max_s=0.5)
        assert cfg.socket_path is not None
        sock = cfg.socket_path
        total, sent = 1000, [0]

        def stream() -> None:  # the ranks train on through the kill: 10 steps every 20 ms
            for st in range(0, total, 10):
                send_steps(sock, job, st, st + 10)
                sent[0] = st + 10
                time.sleep(0.02)

        with caplog.at_level(logging.WARNING, logger="agent.failover"), AgentThread(cfg):
            sender = threading.Thread(target=stream)
            sender.start()
            wait_for(lambda: counts(postgres_url, job)[0] >= expect(200)[0], 60, "a first part stored")
            assert sent[0] < total, "the stream ended before the kill: make it longer"
            leader.kill()  # SIGKILL: its session, and so the leader lock, end with it
            wait_for(lambda: httpx.get(f"{standby.url}/api/v1/healthz", timeout=2).json()["leader"], 10,
                     "the standby to take the leadership", 0.1)
            with session_scope(sessions) as s:
                cid = enqueue(s, "node-crash", CommandKind.WRITE_FAULT_FILE,
                              {"job_id": job, "rank": 0, "fault": {"kind": "nan_loss", "step": 3}}).id
            sender.join(120)
            assert sent[0] == total
            wait_for(lambda: counts(postgres_url, job)[0] >= expect(total)[0], 120, "every step stored", 0.2)
            wait_for(lambda: _command_status(sessions, cid) != "PENDING", 30, "the command answered")
            time.sleep(0.5)  # a late duplicate would show now
        assert counts(postgres_url, job) == expect(total)  # every sample exactly once
        assert _command_status(sessions, cid) == "DONE"
        switches = [r.message for r in caplog.records if "from now on" in r.message]
        # One switch each for telemetry and commands, from the dead leader to the standby, never back.
        assert sorted(m.split(":")[0] for m in switches) == ["commands", "telemetry"], switches
        assert all(standby.url in m.split("using")[1] for m in switches), switches
    finally:
        leader.stop()
        standby.stop()
        engine.dispose()
