"""``vigil up`` starts a dead agent again while its node's raylet runs (ops/agentkeeper.py).

Real child processes stand in for agents (a sleeping python); the raylet's liveness is a switch.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from agent.main import EXIT_NODE_KILLED as AGENT_EXIT_NODE_KILLED
from ops.agentkeeper import EXIT_NODE_KILLED, AgentKeeper
from ops.processes import ProcessGroup
from vigil.contract.probe import wait_for

SLEEPER = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"]


@pytest.fixture
def group(tmp_path: Path):
    procs = ProcessGroup(tmp_path / "pids.json")
    yield procs
    procs.stop_all(grace_s=1)


def pid_of(procs: ProcessGroup, name: str) -> int | None:
    live = [c.proc.pid for c in procs.children if c.name == name and c.proc.poll() is None]
    return live[0] if live else None


def test_the_exit_status_is_the_agents(group) -> None:
    assert EXIT_NODE_KILLED == AGENT_EXIT_NODE_KILLED


def test_a_killed_agent_is_started_again_with_its_command_line(group, tmp_path: Path) -> None:
    first = group.start("agent-1", [*SLEEPER, "60", "0"], dict(os.environ), tmp_path / "logs")
    keeper = AgentKeeper(group, {"agent-1": "vigil-node-1"}, interval=0.05, raylet_alive=lambda node: True,
                         settle_s=0.2)
    keeper.start()
    try:
        os.kill(first.proc.pid, signal.SIGKILL)
        # The keeper counts a restart just after it started the process: wait for both (seen under load).
        again = wait_for(lambda: keeper.restarts.get("agent-1") == 1 and pid_of(group, "agent-1") not in
                         (None, first.proc.pid) and pid_of(group, "agent-1"), 10, "the agent started again", 0.05)
        assert [c.argv for c in group.children] == [first.argv]  # one agent, the same command line
        assert keeper.restarts == {"agent-1": 1}
        os.kill(again, signal.SIGKILL)  # again, after the backoff
        wait_for(lambda: keeper.restarts.get("agent-1") == 2, 10, "the second restart", 0.05)
    finally:
        keeper.stop()


def test_not_after_it_killed_its_node_nor_while_the_raylet_is_gone(group, tmp_path: Path) -> None:
    raylet = {"vigil-node-1": False, "vigil-node-2": True}
    group.start("agent-1", [*SLEEPER, "0", "0"], dict(os.environ), tmp_path / "logs")  # its node died
    group.start("agent-2", [*SLEEPER, "0", str(EXIT_NODE_KILLED)], dict(os.environ), tmp_path / "logs")
    keeper = AgentKeeper(group, {"agent-1": "vigil-node-1", "agent-2": "vigil-node-2"}, interval=0.05,
                         backoff_s=0.0, raylet_alive=raylet.__getitem__, settle_s=0.0)
    for c in group.children:
        c.proc.wait(10)
    for _ in range(5):
        keeper.tick()
    assert keeper.restarts == {}  # killed its node: not started again
    raylet["vigil-node-1"] = True  # a raylet came back (started by hand): its agent follows
    keeper.tick()
    assert keeper.restarts == {"agent-1": 1}
    # The node killed on command is started again by hand (a bench, an operator): that agent is kept.
    group.children = [c for c in group.children if c.name != "agent-2"]
    again = group.start("agent-2", [*SLEEPER, "0", "1"], dict(os.environ), tmp_path / "logs")
    again.proc.wait(10)
    keeper.tick()
    assert keeper.restarts["agent-2"] == 1
