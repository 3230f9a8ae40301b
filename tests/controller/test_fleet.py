"""Agents through Ray: the fleet's decisions (a fake Ray driver, the real database) and the agent host's
restarts (real child processes standing in for the agent). The whole path on a real Ray cluster is
tests/e2e/test_attach.py."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import pytest
from sqlalchemy import select

from agent.main import EXIT_NODE_KILLED as AGENT_EXIT_NODE_KILLED
from controller.agent_host import EXIT_NODE_KILLED, AgentHost
from controller.db import session_scope
from controller.fleet import AgentFleet, agent_fleet
from controller.models import ApiToken, Event
from controller.tokens import authenticate
from vigil.contract.probe import wait_for
from vigil.contract.settings import Settings


class FakeDriver:
    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = nodes
        self.deploys: list[dict[str, Any]] = []
        self.fail = False

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "scan":
            return {"nodes": self.nodes}
        self.deploys.append(req)
        return {"ok": not self.fail, "error": "no room" if self.fail else ""}

    def close(self) -> None:
        pass


def _node(name: str, alive: bool = True, agent: Any = None) -> dict[str, Any]:
    return {"ray_id": f"id-{name}", "name": name, "alive": alive, "agent": agent}


def test_an_alive_node_without_an_agent_gets_one_with_a_token_of_its_own(sessions) -> None:
    driver = FakeDriver([_node("w1"), _node("w2", agent={"pid": 5, "running": True}), _node("w3", alive=False),
                         _node("w4", agent="starting")])
    fleet = AgentFleet(sessions, driver, "http://ctl:8000", lambda n: ["--node-id", n])
    fleet.tick()
    (d,) = driver.deploys
    assert (d["ray_id"], d["name"], d["args"]) == ("id-w1", "w1", ["--node-id", "w1"])
    assert d["env"]["VIGIL_CONTROLLER_URL"] == "http://ctl:8000"
    with session_scope(sessions) as s:
        who = authenticate(s, d["env"]["VIGIL_TOKEN"])
        assert who is not None and who.role.value == "agent" and who.node_id == "w1"  # that node only
        assert [e.node_id for e in s.scalars(select(Event).where(Event.kind == "agent_deployed"))] == ["w1"]
    # Deployed again (its actor lost): the node's earlier fleet token is revoked.
    fleet.tick()
    with session_scope(sessions) as s:
        assert authenticate(s, d["env"]["VIGIL_TOKEN"]) is None
        live = s.scalars(select(ApiToken).where(ApiToken.node_id == "w1", ApiToken.revoked_at.is_(None))).all()
        assert len(live) == 1


def test_a_refused_deploy_leaves_no_live_token(sessions) -> None:
    driver = FakeDriver([_node("w1")])
    driver.fail = True
    AgentFleet(sessions, driver, "http://ctl:8000", lambda n: []).tick()
    with session_scope(sessions) as s:
        assert authenticate(s, driver.deploys[0]["env"]["VIGIL_TOKEN"]) is None


def test_settings_say_whether_and_how(tmp_path, sessions) -> None:
    assert agent_fleet(Settings(home=tmp_path), sessions) is None
    with pytest.raises(ValueError, match="ray_gcs_address"):
        agent_fleet(Settings(home=tmp_path, deploy_agents=True), sessions)
    fleet = agent_fleet(Settings(home=tmp_path, deploy_agents=True, ray_gcs_address="h:6379", run_dir=tmp_path / "run",
                                 agent_controller_url="http://10.0.0.1:8000"), sessions)
    assert fleet is not None
    args = fleet.agent_args("w1")
    assert args[:6] == ["--node-id", "w1", "--controller", "http://10.0.0.1:8000", "--run-dir", str(tmp_path / "run")]


SLEEPER = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"]


def test_the_host_starts_its_agent_again_unless_it_killed_its_node() -> None:
    assert EXIT_NODE_KILLED == AGENT_EXIT_NODE_KILLED
    host = AgentHost(["60", "0"], {}, backoff_s=0.1, program=SLEEPER)
    try:
        first = wait_for(lambda: host.status()["pid"], 10, "the first agent")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: host.status()["pid"] not in (None, first) and host.status()["running"], 10, "a new agent")
        assert host.status()["starts"] == 2 and host.status()["exits"] == [-signal.SIGKILL]
    finally:
        host.stop()
    done = AgentHost(["0", str(EXIT_NODE_KILLED)], {}, backoff_s=0.1, program=SLEEPER)
    wait_for(lambda: done.status()["exits"] == [EXIT_NODE_KILLED], 10, "the agent to end")
    assert done.status()["starts"] == 1
