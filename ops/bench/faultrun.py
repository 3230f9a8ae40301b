"""What the fault benchmarks (``vigil bench recovery``, ``vigil bench chaos``) share: the controller's
answers about a job as JSON-like dicts, waits on a job's progress, where a rank runs, and the node
processes of a local cluster (:mod:`ops.localcluster`) that a benchmark kills and starts again.

An operator tool: it reads the controller through its typed client and may touch the cluster's processes.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import httpx

from ops.localcluster import Child, LocalCluster
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.probe import poll
from vigil.contract.schemas import FaultCreate

log = logging.getLogger("vigil.bench.faultrun")

T = TypeVar("T")

UNREACHABLE = (httpx.HTTPError, ApiError, OSError)
"""What a call to a controller that is down (or restarting) raises."""


def parse_ts(value: str | datetime | None) -> float | None:
    """Unix time of an ISO timestamp (or datetime) from the API; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(value).timestamp()


def step_at(message: str | None) -> int | None:
    """The job's step when the controller fired a fault (its message ends "... (step N)")."""
    m = re.search(r"\(step (\d+)\)", message or "")
    return int(m.group(1)) if m else None


def node_index(node_id: str) -> str:
    """``vigil-node-3`` -> ``3``: the suffix of the node's ``ray-node-<i>`` / ``agent-<i>`` children."""
    return node_id.rsplit("-", 1)[1]


class FaultRun:
    """A local cluster, a client on its controller, and the reads every fault benchmark makes."""

    def __init__(self, cluster: LocalCluster, timeout: float = 30.0) -> None:
        self.cluster = cluster
        self.client = VigilClient(cluster.controller_url, token=cluster.admin_token, timeout=timeout)

    # The controller's answers as JSON-like dicts, read through the typed client.
    def inject(self, job_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.client.inject_fault(job_id, FaultCreate.model_validate(body)).model_dump(mode="json")

    def faults(self, job_id: str) -> list[dict[str, Any]]:
        return [f.model_dump(mode="json") for f in self.client.list_faults(job_id).data]

    def incidents(self, job_id: str) -> list[dict[str, Any]]:
        return [i.model_dump(mode="json") for i in self.client.job_incidents(job_id).data]

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return [e.model_dump(mode="json") for e in self.client.list_events(job_id=job_id, limit=1000).data]

    def last_step(self, job_id: str) -> int:
        return self.client.get_job(job_id).last_step or 0

    def reach(self, job_id: str, step: int, timeout: float = 300) -> bool:
        return bool(poll(lambda: self.last_step(job_id) >= step, timeout, 0.5, UNREACHABLE))

    def finish(self, job_id: str, timeout: float = 600) -> str:
        poll(lambda: self.client.get_job(job_id).status.is_terminal(), timeout, 2, UNREACHABLE)
        return self.client.get_job(job_id).status.value

    def rank_location(self, job_id: str, rank: int, timeout: float = 30) -> tuple[str, int] | None:
        """(node, pid) of a live rank, from the agents' heartbeats (which may lag the step counter)."""
        def find() -> tuple[str, int] | None:
            for n in self.client.list_nodes().data:
                for r in n.ranks:
                    if r.job_id == job_id and r.rank == rank and r.alive:
                        return n.id, r.pid
            return None

        return poll(find, timeout, 0.5, UNREACHABLE)

    def rank0_series(self, job_id: str) -> tuple[list[int], list[float], list[float]]:
        """Rank 0's (steps, end times, step times) in the order they ran (one row per step: the newest)."""
        s = next((x for x in self.client.job_metrics(job_id, max_points=100_000).ranks if x.rank == 0), None)
        if s is None:
            return [], [], []
        rows = sorted(zip(s.ts, s.step, s.step_time_s, strict=True))  # in the order they ran
        return [r[1] for r in rows], [r[0] for r in rows], [r[2] for r in rows]

    # -- the cluster's processes ------------------------------------------------------------------
    def child(self, name: str) -> Child | None:
        """The local cluster's child process ``name`` (``controller``, ``agent-<i>``, ``ray-node-<i>``)."""
        return next((c for c in self.cluster.procs.children if c.name == name), None)

    def start_again(self, name: str, argv: Callable[[list[str]], list[str]] | None = None) -> Child:
        """Start the child ``name`` again as it was started (``argv`` may rewrite its command line), after
        it ended (its own end, or a kill); a child still running is killed first (its whole session)."""
        with self.cluster.procs.lock:  # not beside vigil up's agent keeper starting the same agent
            old = self.child(name)
            if old is None:
                raise LookupError(name)
            if old.proc.poll() is None:
                self.cluster.procs.stop_child(old)
            else:
                try:
                    old.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                self.cluster.procs.children.remove(old)
            return self.cluster.procs.start(name, argv(old.argv) if argv else old.argv, old.env, old.log_path.parent)


def safely(fn: Callable[[], T], default: T) -> T:
    """``fn()``, or ``default`` while the controller does not answer (down, restarting)."""
    try:
        return fn()
    except UNREACHABLE as exc:
        log.debug("controller did not answer: %s", exc)
        return default


def ray_alive_nodes(dashboard_url: str) -> dict[str, set[str]]:
    """Node name -> Ray node ids of the Ray nodes of that name that are ALIVE (Ray's public state API; a
    drained node and the fresh raylet that replaces it share a name)."""
    from ray.util.state import list_nodes

    out: dict[str, set[str]] = {}
    for n in list_nodes(address=dashboard_url, raise_on_missing_output=False):
        if n.state == "ALIVE":
            out.setdefault(n.node_name, set()).add(n.node_id)
    return out


def with_ray_start_pid(argv: list[str], pid: int) -> list[str]:
    """An agent's command line with ``--ray-start-pid`` naming the node's new ``ray start`` process."""
    out = list(argv)
    if "--ray-start-pid" in out:
        out[out.index("--ray-start-pid") + 1] = str(pid)
    return out
