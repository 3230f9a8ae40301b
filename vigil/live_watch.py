"""The live driver's watch on the nodes its replicas run on: a node lost is answered before Ray notices it.

Ray declares a node dead only after its health checks fail for a while (by default 5 checks 3 s apart,
after the first is late: 15-30 s), and only then starts the node's actors again elsewhere; live recovery's
replacement waited for that (25.3 s in ``vigil bench recovery --policy live``). The driver can tell sooner:
every second it connects to the raylet of each node that runs one of its replicas (the port Ray itself
uses, from ``ray.nodes()``). A raylet that refuses the connection is gone while its host answers (a killed
raylet, the local cluster's ``kill_node``); one that does not answer at all is a host down or cut off. After
:data:`REFUSED_MISSES` refusals or :data:`SILENT_MISSES` silences in a row, the replicas on that node are
killed through Ray (``ray.kill``, no restart) and started again as new actors on any other node
(a ``ray.io/node-id`` label selector leaves the lost node out), where they heal from a live peer.

What it cannot tell apart: a host cut off for longer than :data:`SILENT_MISSES` seconds and then back, while
Ray still counts it alive. Its old replica comes back to a quorum it no longer belongs to; it finds itself
behind (healed past) and ends (:class:`vigil.live.LiveError`), and Ray does not start it again (it was
killed). One step may then average its stale contribution (docs/RECOVERY.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

REFUSED_MISSES = 2
"""Refused connections in a row (the raylet's process is gone; its host answered) before a node is lost."""
SILENT_MISSES = 5
"""Connections in a row that were not answered within :data:`CONNECT_TIMEOUT_S` (a host down, or cut off)
before a node is lost: more than refusals, a network blip must not replace ranks."""
CONNECT_TIMEOUT_S = 1.0
WATCH_INTERVAL_S = 1.0
"""How often the driver looks (between its waits for the replicas' results)."""

REFUSED, SILENT, OK = "refused", "silent", "ok"


def probe(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> str:
    """Whether a TCP connection to ``host:port`` is accepted: :data:`OK`, :data:`REFUSED` or :data:`SILENT`."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return OK
    except ConnectionRefusedError:
        return REFUSED
    except OSError as e:
        return REFUSED if e.errno in (errno.ECONNREFUSED, errno.ECONNRESET) else SILENT


@dataclass
class NodeWatch:
    """Counts each node's failed raylet probes in a row; :meth:`look` returns the nodes newly lost."""

    probe: Callable[[str, int], str] = probe
    refused_misses: int = REFUSED_MISSES
    silent_misses: int = SILENT_MISSES
    misses: dict[str, tuple[int, int]] = field(default_factory=dict)  # node id -> (refused, silent) in a row
    lost: set[str] = field(default_factory=set)

    def look(self, raylets: Mapping[str, tuple[str, int]], watched: Iterable[str]) -> set[str]:
        """Probe the raylet of each ``watched`` node (``raylets``: node id -> (host, port) of the nodes Ray
        counts alive) and return the nodes that crossed a bound at this look. A node Ray no longer counts
        alive is Ray's to handle (it restarts the actors itself) and a lost node is not probed again."""
        newly: set[str] = set()
        for node in sorted(set(watched) - self.lost):
            where = raylets.get(node)
            if where is None:
                self.misses.pop(node, None)
                continue
            result = self.probe(*where)
            refused, silent = self.misses.get(node, (0, 0))
            refused, silent = (refused + 1, silent) if result == REFUSED else (
                (refused, silent + 1) if result == SILENT else (0, 0))
            self.misses[node] = (refused, silent)
            if refused >= self.refused_misses or silent >= self.silent_misses or refused + silent >= self.silent_misses:
                self.lost.add(node)
                newly.add(node)
                log.warning("live recovery: the raylet of node %s stopped answering (%d refused, %d silent probes in "
                            "a row); its replicas are replaced without waiting for Ray", node, refused, silent)
        return newly


def alive_raylets() -> dict[str, tuple[str, int]]:
    """Node id -> (address, raylet port) of the nodes Ray counts alive."""
    import ray

    return {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in ray.nodes() if n.get("Alive")}


def actor_nodes(names: Iterable[str]) -> dict[str, str]:
    """Actor name -> node id, for this job's named actors Ray counts alive (Ray's state API, served by its
    dashboard; nothing if that fails: the watch then waits for Ray, as before it)."""
    import ray
    from ray.util.state import list_actors

    wanted = set(names)
    with contextlib.suppress(Exception):
        job = ray.get_runtime_context().get_job_id()
        found = list_actors(filters=[("job_id", "=", job), ("state", "=", "ALIVE")], limit=10_000, timeout=5,
                            raise_on_missing_output=False)
        return {a.name: a.node_id for a in found if a.name in wanted and a.node_id}
    return {}


def avoiding(nodes: Iterable[str]) -> dict[str, str]:
    """A Ray label selector that keeps an actor off ``nodes`` (empty: anywhere)."""
    nodes = sorted(nodes)
    return {"ray.io/node-id": f"!in({', '.join(nodes)})"} if nodes else {}
