"""A controller driven one monitor step at a time (tests of detection, recovery, fault injection and their
attacks): the real app and database (SQLite), telemetry posted as agents post it, the agents' command results
posted through the API, a fake cluster control that records drains, a fake clock."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from controller.launcher import LaunchStatus, RayNode
from controller.recovery.monitor import Monitor
from tests.auth import bearer, issue_token
from tests.controller.fakes import FakeLauncher
from tests.harness import build_app, settings_for
from vigil.contract.schemas import JobStatus

API = "/api/v1"


@dataclass
class FakeCluster:
    drained: list[tuple[str, float]] = field(default_factory=list)
    head: str = "vigil-node-0"
    cpus: dict[str, float] | None = None
    """Each node's CPUs in Ray (None: not reported, as an old Ray would)."""

    def drain_node(self, node_name: str, deadline_s: float, reason: str) -> bool:
        self.drained.append((node_name, deadline_s))
        return True

    def nodes(self) -> list[RayNode]:
        return [RayNode(f"id{i}", f"vigil-node-{i}", "ALIVE", is_head=f"vigil-node-{i}" == self.head,
                        cpus=None if self.cpus is None else self.cpus.get(f"vigil-node-{i}", 0.0)) for i in range(3)]


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    client: TestClient
    monitor: Monitor
    clock: Clock
    cluster: FakeCluster
    launcher: FakeLauncher
    job_id: str = ""
    seq: int = 0
    pids: dict[int, int] = field(default_factory=lambda: {0: 1000, 1: 1001})
    nodes: dict[int, str] = field(default_factory=lambda: {0: "vigil-node-1", 1: "vigil-node-2"})
    alive: dict[int, bool] = field(default_factory=lambda: {0: True, 1: True})
    attempt: int = 1
    max_step: int = 0

    def post(self, samples: list[dict], node: str, heartbeat: bool = True) -> None:
        self.seq += 1
        ranks = [{"job_id": self.job_id, "rank": r, "pid": self.pids[r], "alive": self.alive[r]}
                 for r, n in self.nodes.items() if n == node]
        body = {"agent_id": f"agent-{node}", "node_id": node, "seq": self.seq, "sent_at": self.clock.now,
                "samples": samples}
        if heartbeat:
            body["heartbeat"] = {"ts": self.clock.now, "hostname": node, "ranks": ranks}
        r = self.client.post(f"{API}/telemetry", json=body)
        assert r.status_code == 200, r.text

    def steps(self, first: int, last: int, compute: dict[int, float] | None = None, loss: float | None = 3.0,
              dt: float = 0.2, cpu_wait: dict[int, float] | None = None) -> None:
        """Ranks report steps first..last, ``dt`` apart on the fake clock, with heartbeats (``cpu_wait``: a rank's
        run-queue wait per step, else none reported). Steps reported before are a re-run after a restart: the
        ranks' next run attempt."""
        compute = compute or {}
        if first <= self.max_step:
            self.attempt += 1
        self.max_step = max(self.max_step, last)
        for st in range(first, last + 1):
            self.clock.now += dt
            for rank, node in self.nodes.items():
                c = compute.get(rank, 0.05)
                self.post([{"kind": "step", "job_id": self.job_id, "rank": rank, "step": st, "attempt": self.attempt,
                            "ts": self.clock.now, "loss": loss, "step_time_s": 0.2, "fwd_bwd_s": c, "comm_s": 0.01,
                            "cpu_wait_s": (cpu_wait or {}).get(rank)}], node)

    def heartbeats(self, nodes: list[str] | None = None) -> None:
        for node in nodes or sorted(set(self.nodes.values())):
            self.post([], node)

    def incidents(self) -> list[dict]:
        return self.client.get(f"{API}/jobs/{self.job_id}/incidents").json()["data"]

    def commands(self, node: str) -> list[dict]:
        return self.client.get(f"{API}/nodes/{node}/commands").json()["data"]

    def answer(self, node: str, command_id: int, ok: bool = True, output: dict | None = None) -> dict:
        r = self.client.post(f"{API}/nodes/{node}/commands/{command_id}/result",
                             json={"ok": ok, "output": output or {}})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def env(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Env]:
    launcher, cluster, clock = FakeLauncher(), FakeCluster(), Clock()
    app = build_app(settings_for(tmp_path), launcher=launcher, cluster=cluster)
    monitor = Monitor(app.state.sessions, launcher, cluster, clock=clock)
    app.state.monitor = monitor
    with TestClient(app, headers=bearer(issue_token(app, "admin"))) as c:
        e = Env(c, monitor, clock, cluster, launcher)
        spec = {"name": "r", "steps": 1000, "scaling": {"min_workers": 2, "max_workers": 2},
                "recovery": {"policy": "evict_restart", "max_restarts": 2}, **getattr(request, "param", {})}
        e.job_id = c.post(f"{API}/jobs", json=spec).json()["id"]
        app.state.supervisor.step()
        launcher.statuses[f"fake-{e.job_id}"] = LaunchStatus(JobStatus.RUNNING)
        app.state.supervisor.step()
        # The controller stamps a heartbeat max(its ts, real now): a fake clock left behind real time by a slow
        # setup (a loaded host) made test_node_lost_after_heartbeat_timeout's silent node look 1-2 s younger.
        clock.now = max(clock.now, time.time())
        yield e
