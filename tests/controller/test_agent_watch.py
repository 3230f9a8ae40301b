"""A silent agent on a live node is an event, not a lost node (controller/recovery/agents.py).

The raylet is a real listening socket here (the probe is one TCP connection); the node table is a fake.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from controller.db import session_scope
from controller.launcher import LaunchError, RayNode
from controller.models import Event
from controller.recovery.agents import AgentWatch


class Nodes:
    def __init__(self, nodes: list[RayNode] | Exception) -> None:
        self.value = nodes

    def nodes(self) -> list[RayNode]:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value

    def drain_node(self, node_name: str, deadline_s: float, reason: str) -> bool:
        raise AssertionError("not used")


@pytest.fixture
def raylet() -> Iterator[tuple[str, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()


def closed_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()  # nobody listens once closed


def events(sessions) -> list[tuple[str, str | None]]:
    with session_scope(sessions) as s:
        return [(e.kind, e.node_id) for e in s.scalars(select(Event).order_by(Event.id))]


def test_a_silent_agent_whose_raylet_answers_is_one_event_until_it_is_back(sessions, raylet) -> None:
    watch = AgentWatch(Nodes([RayNode("ab12", "vigil-node-1", "ALIVE", raylet=raylet)]))
    with session_scope(sessions) as s:
        assert watch.agent_only(s, "vigil-node-1", 7.0)
        assert watch.agent_only(s, "vigil-node-1", 8.0)  # the next pass: still the agent's problem
    assert events(sessions) == [("agent_lost", "vigil-node-1")]
    with session_scope(sessions) as s:
        watch.heard(s, {"vigil-node-2"})  # another node's heartbeat says nothing of this one
        watch.heard(s, {"vigil-node-1"})
    assert events(sessions) == [("agent_lost", "vigil-node-1"), ("agent_back", "vigil-node-1")]
    assert watch.silent == {}


def test_found_by_ray_node_id_too(sessions, raylet) -> None:
    watch = AgentWatch(Nodes([RayNode("ab12", "", "ALIVE", raylet=raylet)]))  # attached clusters: ids, no names
    with session_scope(sessions) as s:
        assert watch.agent_only(s, "ab12", 6.0)


@pytest.mark.parametrize("node", [
    RayNode("ab12", "vigil-node-1", "ALIVE", raylet=closed_port()),  # the raylet was killed: refused
    RayNode("ab12", "vigil-node-1", "DEAD", raylet=("127.0.0.1", 1)),  # Ray already knows
    RayNode("ab12", "vigil-node-1", "ALIVE", raylet=None),  # Ray gave no address: judged as before
    RayNode("ff00", "vigil-node-9", "ALIVE", raylet=("127.0.0.1", 1)),  # another node: this one Ray does not know
])
def test_a_silent_node_whose_raylet_does_not_answer_is_lost(sessions, node) -> None:
    watch = AgentWatch(Nodes([node]))
    with session_scope(sessions) as s:
        assert not watch.agent_only(s, "vigil-node-1", 7.0)
    assert events(sessions) == []


def test_without_rays_node_table_a_silent_node_is_lost(sessions) -> None:
    for cluster in (None, Nodes(LaunchError("GCS down"))):
        watch = AgentWatch(cluster)
        with session_scope(sessions) as s:
            assert not watch.agent_only(s, "vigil-node-1", 7.0)
    assert events(sessions) == []
