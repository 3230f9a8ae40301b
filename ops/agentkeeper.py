"""Agents that come back: ``vigil up`` starts a node's agent again within seconds of its death.

An agent is the node's eyes and hands, but not the node: when it dies (a bug, an OOM kill, ``kill -9``)
while the node's raylet lives on, the ranks there keep training and keep their samples in their own
bounded backlog (vigil/telemetry.py) until an agent listens again. :class:`AgentKeeper` watches the
agents ``vigil up`` started and starts a dead one again with the same command line, unless

- the agent ended because it killed its node on command (``kill_node``: exit status
  :data:`EXIT_NODE_KILLED`): the node is meant to be gone;
- the node's raylet is gone too: the host (or its raylet) died, which is the controller's ``node_lost``;
  an agent that readmits the node starts its raylet itself, so there is nothing to keep alive here.

Restarts are spaced (at least ``backoff_s`` apart per agent) so that an agent that cannot start (its
socket held, a bad flag) does not spin. The controller hears of a silent agent on a live node through
its missing heartbeats and records it as an agent problem, not a lost node
(:mod:`controller.recovery.agents`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

from agent.commands.raylet import of_cluster
from vigil.contract.background import BackgroundLoop

if TYPE_CHECKING:
    from ops.processes import ProcessGroup

log = logging.getLogger(__name__)

EXIT_NODE_KILLED = 3
"""``vigil agent``'s exit status after it killed its own node on command (agent/main.py)."""


def raylet_running(node_name: str, gcs_address: str | None = None) -> bool:
    """Whether a process named ``raylet`` whose command line names ``node_name`` (of the Ray cluster at
    ``gcs_address``, where given: another cluster on this host may name its nodes alike) runs on this host."""
    flags = (f"--node-name={node_name}", f"--node_name={node_name}")
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue  # killed a moment ago: not a node to keep an agent for
        argv = p.info["cmdline"] or ()
        if p.info["name"] == "raylet" and any(a in flags for a in argv) and of_cluster(argv, gcs_address):
            return True
    return False


class AgentKeeper(BackgroundLoop):
    """Starts the agents of :attr:`agents` (child name -> node name) again when they die (module docstring)."""

    thread_name = "vigil-agent-keeper"

    def __init__(self, procs: ProcessGroup, agents: dict[str, str], interval: float = 0.5,
                 backoff_s: float = 2.0, raylet_alive: Callable[[str], bool] = raylet_running,
                 settle_s: float = 2.0) -> None:
        self.procs = procs
        self.agents = dict(agents)
        self.interval = interval
        self.backoff_s = backoff_s
        self.raylet_alive = raylet_alive
        self.restarts: dict[str, int] = {}
        """Restarts so far, per child name."""
        self._last: dict[str, float] = {}
        self._killed_nodes: set[int] = set()
        self.settle_s = settle_s
        self._dead_since: dict[int, float] = {}  # a dead agent's pid -> when first seen dead
        super().__init__()

    def tick(self) -> None:
        for name, node in list(self.agents.items()):
            with self.procs.lock:
                mine = [c for c in self.procs.children if c.name == name]
                if not mine or any(c.proc.poll() is None for c in mine):
                    continue  # running (or taken out of the group on purpose)
                dead = mine[-1]
                rc = dead.proc.returncode
                if rc == EXIT_NODE_KILLED:
                    if dead.proc.pid not in self._killed_nodes:
                        log.info("agent %s killed its node on command: not started again", name)
                        self._killed_nodes.add(dead.proc.pid)  # one started by hand later is kept again
                    continue
                if time.monotonic() - self._last.get(name, float("-inf")) < self.backoff_s:
                    continue
                # A raylet killed with its agent (a host going down) takes a moment to exit: judge it only
                # once the agent has been dead for settle_s.
                first_seen = self._dead_since.setdefault(dead.proc.pid, time.monotonic())
                if time.monotonic() - first_seen < self.settle_s:
                    continue
                if not self.raylet_alive(node):
                    continue  # the node is down: the controller's node_lost, not the agent's death
                for c in mine:
                    self.procs.children.remove(c)
                self.procs.start(name, dead.argv, dead.env, dead.log_path.parent)
                self._last[name] = time.monotonic()
                self.restarts[name] = self.restarts.get(name, 0) + 1
            log.warning("agent of %s exited (status %s) while its raylet runs: started again (restart %d)",
                        node, rc, self.restarts[name])
