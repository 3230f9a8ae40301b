"""Finding this node's raylet and the ``ray start`` process that owns it (:class:`RayletLocator`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil

from agent.commands.errors import CommandError
from agent.commands.pids import _gone, live_process

_NODE_FLAGS = ("--node-name", "--node_name", "--node-id", "--node_id")
_GCS_FLAGS = ("--gcs-address", "--gcs_address")


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _local_hosts() -> set[str]:
    """This host's own addresses (in this network namespace), loopback included."""
    hosts = {"localhost", "127.0.0.1", "::1"}
    with contextlib.suppress(OSError):
        hosts |= {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return hosts


def of_cluster(cmdline: Sequence[str], gcs_address: str | None) -> bool:
    """Whether a raylet's command line says it belongs to the Ray cluster at ``gcs_address`` (``host:port``;
    None: any cluster). Two clusters on one host may name their nodes alike (``vigil up`` twice, a test
    cluster beside an operator's): the node name alone does not tell them apart. Ray writes the address
    in its own form (a head given as 127.0.0.1 shows as the host's address): same port, and the same
    host or two addresses of this host."""
    if gcs_address is None:
        return True
    flag = _flag(cmdline, _GCS_FLAGS)
    if not flag:
        return False
    (want_host, want_port), (host, port) = _host_port(gcs_address), _host_port(flag)
    if want_port != port:
        return False
    if want_host == host:
        return True
    local = _local_hosts()
    return want_host in local and host in local


def _names_node(cmdline: Sequence[str], node: str) -> bool:
    for i, arg in enumerate(cmdline):
        flag, eq, val = arg.partition("=")
        if flag in _NODE_FLAGS and ((eq and val == node) or (not eq and cmdline[i + 1 : i + 2] == [node])):
            return True
    return False


def _looks_like_ray_start(p: psutil.Process) -> bool:
    """``[python] .../ray start ...``: the process ``ray start`` (``--block`` in ``vigil up``)."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return False
    head = argv[:3]
    return "start" in head and any(Path(a).name == "ray" for a in head[:2])


def _named_raylet(p: psutil.Process) -> bool:
    try:
        return p.name() == "raylet"
    except psutil.Error:
        return False


class RayletLocator:
    """Finds this node's raylet and the ``ray start`` process that owns it.

    The raylet is the process named ``raylet`` whose command line names this node
    (``--node-name=<node>`` as Ray 2.x passes it, ``--node_name=``, or ``--node_id=<hex>`` for nodes
    known by their Ray id); failing that, a configured ``raylet_pid`` that still names a raylet (a
    pid can be reused). With ``gcs_address`` only a raylet of that Ray cluster counts (:func:`of_cluster`).
    ``ray start`` is the configured ``ray_start_pid``, or the join command the
    agent started, or the raylet's parent when that is a ``ray start`` process.
    """

    def __init__(
        self,
        node: str,
        raylet_pid: int | None = None,
        ray_start_pid: int | None = None,
        join_child: Callable[[], psutil.Process | None] = lambda: None,
        gcs_address: str | None = None,
    ) -> None:
        self.node = node
        self.gcs_address = gcs_address
        self.raylet_pid = raylet_pid
        self.ray_start_pid = ray_start_pid
        self._join_child = join_child

    def raylets(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["name", "cmdline"]):
            argv = p.info["cmdline"] or []
            named = p.info["name"] == "raylet" and _names_node(argv, self.node) and of_cluster(argv, self.gcs_address)
            if named and not _gone(p):
                found.append(p)
        if not found and self.raylet_pid is not None:
            p = live_process(self.raylet_pid)
            if p is not None and _named_raylet(p):
                found.append(p)
        return found

    def raylet(self) -> psutil.Process | None:
        """This node's raylet; CommandError when several processes claim to be it."""
        found = self.raylets()
        if len(found) > 1:
            raise CommandError(
                f"{len(found)} raylets name node {self.node!r} (pids {sorted(p.pid for p in found)}); "
                "refusing to guess"
            )
        return found[0] if found else None

    def ray_start(self, raylet: psutil.Process | None) -> psutil.Process | None:
        if self.ray_start_pid is not None:
            p = live_process(self.ray_start_pid)
            if p is not None and _looks_like_ray_start(p):
                return p
        child = self._join_child()
        if child is not None and not _gone(child):
            return child
        if raylet is not None:
            try:
                parent = raylet.parent()
            except psutil.Error:
                parent = None
            if parent is not None and _looks_like_ray_start(parent):
                return parent
        return None


def _flag(cmdline: Sequence[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(cmdline):
        flag, eq, val = arg.partition("=")
        if flag in names:
            return val if eq else (cmdline[i + 1] if i + 1 < len(cmdline) else None)
    return None


def discover_node_id(processes: Callable[[], Iterable[psutil.Process]] | None = None,
                     gcs_address: str | None = None) -> str:
    """This host's Ray node as its raylet names it: the raylet's ``--node-name`` where the operator gave
    one (``ray start --node-name``, ``vigil up``), else its Ray node id (hex). For an agent started by hand,
    by a Kubernetes sidecar or by Ray itself, with no ``--node-id``. ValueError when no raylet, or several
    (several raylets on one host: say which with ``--node-id``, or the cluster with ``gcs_address``)."""
    found = []
    for p in (processes or psutil.process_iter)():
        try:
            if p.name() != "raylet":
                continue
            argv = p.cmdline()
        except psutil.Error:
            continue
        if not of_cluster(argv, gcs_address):
            continue
        node = _flag(argv, ("--node-name", "--node_name")) or _flag(argv, ("--node_id", "--node-id"))
        if node:
            found.append(node)
    if not found:
        raise ValueError("no Ray raylet runs on this host: start the agent beside one, or pass --node-id")
    if len(set(found)) > 1:
        raise ValueError(f"{len(found)} raylets run on this host ({', '.join(sorted(found))}): pass --node-id")
    return found[0]
