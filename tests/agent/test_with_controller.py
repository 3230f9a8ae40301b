"""The agent against the real controller (FastAPI app + SQLite, served by uvicorn on 127.0.0.1:
fixture ``live_controller``, :mod:`tests.live_controller`).

An outage here is the controller process going away: the uvicorn server stops, and a new app on
the same database and port comes back, as after a controller restart. Every step sent meanwhile
must be stored exactly once, the node must be known with the agent's heartbeat.

Needs: the controller package (FastAPI, SQLAlchemy, Alembic, uvicorn), a writable temporary
folder, loopback networking, py-spy (the command test); a few seconds. No Ray (jobs stay PENDING
without a launcher).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent.main import AgentConfig
from tests.agent.doubles import AgentThread, collective_dict, datagram, send_datagrams, step_dict, wait_for
from tests.auth import issue_token
from tests.live_controller import LiveController
from vigil.contract.client import VigilClient
from vigil.contract.schemas import JobCreate

pytestmark = pytest.mark.timeout(180)


def send_job_steps(sock: Path, job_id: str, start: int, stop: int) -> None:
    """Rank 0 of ``job_id`` reports steps [start, stop), each with one collective."""
    payloads = [
        datagram(
            [
                x
                for i in range(s, min(s + 20, stop))
                for x in (step_dict(i, job_id=job_id, pid=os.getpid()), collective_dict(i, job_id=job_id))
            ]
        )
        for s in range(start, stop, 20)
    ]
    send_datagrams(str(sock), payloads)


def test_outage_and_controller_restart_store_every_step_once(short_dir, live_controller: LiveController):
    ctl = live_controller
    admin = issue_token(ctl.app, "admin")
    with VigilClient(ctl.url, token=admin) as client:
        # The controller stores samples of known jobs only.
        job = client.submit_job(JobCreate(name="agent-e2e", steps=10))
    cfg = AgentConfig(
        node_id="node-ctl",
        controller_url=ctl.url,
        token=issue_token(ctl.app, "agent"),  # stored in the database: still valid after the restart
        run_dir=short_dir,
        flush_interval_s=0.1,
        heartbeat_interval_s=0.2,
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
    )

    def stored_steps() -> list[int]:
        with VigilClient(ctl.url, token=admin) as c:
            m = c.job_metrics(job.id)
        return m.ranks[0].step if m.ranks else []

    with AgentThread(cfg):
        send_job_steps(cfg.socket_path, job.id, 0, 300)
        wait_for(lambda: len(stored_steps()) == 300, what="300 steps stored")
        ctl.stop()  # the controller goes away
        send_job_steps(cfg.socket_path, job.id, 300, 600)
        wait_for(lambda: any(cfg.spool_dir.glob("*.gz")), what="batches spooled")
        ctl.start()  # a new controller process on the same database and port
        wait_for(lambda: len(stored_steps()) == 600, timeout=60, what="600 steps stored")
    assert stored_steps() == list(range(600))  # each step exactly once, none lost
    with VigilClient(ctl.url, token=admin) as client:
        nodes = {n.id: n for n in client.list_nodes().data}
        assert client.get_job(job.id).last_step == 599
    node = nodes["node-ctl"]
    assert node.agent_id == cfg.agent_id and node.hostname == cfg.hostname
    assert any(r.pid == os.getpid() for r in node.ranks)
    assert node.host["agent"]["spooled_batches"] == 0
    assert not any(cfg.spool_dir.glob("*.gz"))


STUCK_RANK = """
import time

def vigil_stuck_in_collective():
    while True:
        time.sleep(0.01)

vigil_stuck_in_collective()
"""


def test_commands_from_the_controller_are_carried_out_and_answered_once(short_dir, live_controller: LiveController):
    """The real routes and auth: the controller queues commands, the agent (agent token) fetches
    them, carries them out on a real throwaway "rank" process and answers; py-spy stacks end up
    stored by the controller."""
    from sqlalchemy import select

    from controller.db import session_scope
    from controller.models import NodeCommandRow, StackDump
    from controller.recovery.commands import enqueue
    from vigil.contract.schemas import CommandKind

    ctl = live_controller
    rank = subprocess.Popen([sys.executable, "-c", STUCK_RANK])
    try:
        admin = issue_token(ctl.app, "admin")
        agent_token = issue_token(ctl.app, "agent")
        with VigilClient(ctl.url, token=admin) as client:
            job = client.submit_job(JobCreate(name="agent-commands", steps=10))
        cfg = AgentConfig(
            node_id="node-cmd",
            controller_url=ctl.url,
            token=agent_token,
            run_dir=short_dir,
            storage_root=short_dir / "storage",
            flush_interval_s=0.1,
            heartbeat_interval_s=0.2,
        )
        with AgentThread(cfg):
            # The rank reports a step: its pid becomes one the controller may act on.
            send_datagrams(str(cfg.socket_path), [datagram([step_dict(0, job_id=job.id, pid=rank.pid)])], as_pid=rank.pid)

            def rank_reported() -> bool:
                with VigilClient(ctl.url, token=admin) as c:
                    nodes = {n.id: n for n in c.list_nodes().data}
                return "node-cmd" in nodes and any(r.pid == rank.pid for r in nodes["node-cmd"].ranks)

            wait_for(rank_reported, what="the rank in a heartbeat")
            with session_scope(ctl.app.state.sessions) as s:
                ids = [
                    enqueue(s, "node-cmd", CommandKind.STOP_PID, {"pid": rank.pid}, job_id=job.id).id,
                    enqueue(s, "node-cmd", CommandKind.PYSPY_DUMP, {"job_id": job.id, "pids": {"0": rank.pid}},
                            job_id=job.id).id,
                    enqueue(s, "node-cmd", CommandKind.KILL_PID, {"pid": os.getppid(), "signal": 9}).id,
                    enqueue(s, "node-cmd", CommandKind.WRITE_FAULT_FILE,
                            {"job_id": job.id, "rank": 0, "fault": {"kind": "nan_loss", "step": 3}}).id,
                ]  # fmt: skip

            def rows() -> dict[int, NodeCommandRow]:
                with session_scope(ctl.app.state.sessions) as s:
                    found = s.scalars(select(NodeCommandRow).where(NodeCommandRow.id.in_(ids))).all()
                    s.expunge_all()
                    return {r.id: r for r in found}

            wait_for(lambda: all(r.status != "PENDING" for r in rows().values()), timeout=60, what="answers")
            done = rows()
            assert [done[i].status for i in ids] == ["DONE", "DONE", "FAILED", "DONE"], [
                (done[i].status, done[i].message) for i in ids
            ]
            assert "refused" in (done[ids[2]].message or "")
            assert psutil.Process(rank.pid).status() == psutil.STATUS_STOPPED  # hung, and still hung
            assert (short_dir / "faults" / job.id / "rank-0.json").exists()
            with session_scope(ctl.app.state.sessions) as s:
                stacks = s.scalars(select(StackDump).where(StackDump.job_id == job.id)).all()
                assert len(stacks) == 1 and stacks[0].pid == rank.pid
                assert "vigil_stuck_in_collective" in stacks[0].stack and "stopped" in stacks[0].stack
            with VigilClient(ctl.url, token=agent_token) as c:
                assert c.node_commands("node-cmd").count == 0
    finally:
        rank.kill()
        rank.wait(10)
