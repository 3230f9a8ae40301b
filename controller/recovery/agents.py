"""A silent agent on a live node is the agent's problem, not a lost node.

The monitor hears of a node through its agent's heartbeats. When they stop, either the host (or its
raylet) died, and the job's ranks there with it (``node_lost``: the job restarts elsewhere), or only the
agent died and the ranks train on (they keep their samples until an agent listens again; ``vigil up``
and the Ray-deployed agents start it again within seconds). Telling the two apart costs one TCP
connection: the node's raylet (Ray's node manager port, from the GCS) accepts it while the node lives.
A killed raylet refuses at once and a cut-off host does not answer within :data:`PROBE_TIMEOUT_S`;
either is a lost node, found as fast as before and well before Ray's own health checks give up.

:class:`AgentWatch` keeps, across the monitor's passes, which nodes have a silent agent, so that the
``agent_lost`` event is recorded once per silence and ``agent_back`` (with its length) when heartbeats
resume. Where the engine cannot say (no cluster control, Ray's API down, a node Ray does not know), the
node is judged as before: lost.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from controller.jobs import record_event
from controller.launcher import ClusterControl, RayNode

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
"""How long the raylet of a silent node has to accept a connection."""
NODES_TTL_S = 5.0
"""Ray's node table is read at most this often while agents are silent."""


def raylet_answers(node: RayNode, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the node's raylet accepts a TCP connection (None: Ray gave no address)."""
    if node.state != "ALIVE":
        return False
    if node.raylet is None:
        return None
    try:
        with socket.create_connection(node.raylet, timeout=timeout_s):
            return True
    except OSError:
        return False


class AgentWatch:
    """Which silent nodes are alive (their agent died) and what was recorded about them."""

    def __init__(self, cluster: ClusterControl | None, clock: Callable[[], float] = time.time,
                 probe: Callable[[RayNode], bool | None] = raylet_answers) -> None:
        self.cluster = cluster
        self.clock = clock
        self.probe = probe
        self.silent: dict[str, float] = {}
        """Node id -> when its agent's silence was first judged an agent problem."""
        self._nodes: list[RayNode] | None = None
        self._nodes_at = float("-inf")

    def _ray_node(self, node_id: str) -> RayNode | None:
        if self.cluster is None:
            return None
        now = time.monotonic()
        if self._nodes is None or now - self._nodes_at > NODES_TTL_S:
            try:
                self._nodes = self.cluster.nodes()
            except Exception as exc:  # noqa: BLE001 - Ray's API down: the node is judged as before
                log.warning("cannot read Ray's node table to judge a silent agent: %s", exc)
                self._nodes = None
            self._nodes_at = now
        return next((n for n in self._nodes or () if node_id in (n.name, n.node_id)), None)

    def agent_only(self, s: Session, node_id: str, age_s: float) -> bool:
        """True when ``node_id``'s heartbeats stopped but its raylet answers: an ``agent_lost`` event
        (once per silence), no incident. False: judge the node lost."""
        node = self._ray_node(node_id)
        alive = self.probe(node) if node is not None else None
        if not alive:
            self.silent.pop(node_id, None)
            return False
        if node_id not in self.silent:
            self.silent[node_id] = self.clock() - age_s
            record_event(s, "agent_lost", f"no heartbeat from {node_id}'s agent for {age_s:.1f} s, but its raylet "
                         f"answers: the agent died, not the node; its ranks keep their samples until an agent "
                         f"listens again (no incident, no restart)", node_id=node_id)
        return True

    def heard(self, s: Session, alive_ids: set[str]) -> None:
        """Close the silences of nodes whose heartbeats resumed (``alive_ids``: nodes heard from in time)."""
        for node_id in [n for n in self.silent if n in alive_ids]:
            since = self.silent.pop(node_id)
            record_event(s, "agent_back", f"{node_id}'s agent is back after {self.clock() - since:.1f} s of silence",
                         node_id=node_id)
