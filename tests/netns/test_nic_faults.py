"""The NIC detector against real network faults on a 4-node namespace network.

Four gloo ranks, one per namespace, run a training-like loop (compute, then a gradient all-reduce)
while the agent's collectors sample every node's NIC from inside its namespace (tests/netns/sampler.py).
Part-way through, the fault is carried out by the agent's own code (agent/netfaults.py, acting in the
node's namespace) exactly as a ``shape_nic`` command would: the link of one node drops to 25%, or
flaps. Afterwards the recorded heartbeats and step samples are posted, in time order, to a real
controller (SQLite) as the agents would have posted them, and the detector runs after every
heartbeat as the monitor would. It must name the faulty node (and, for the degraded link, its rank
as communication-slow) and nobody else, and find nothing before the fault.

Needs: root, iproute2 (``ip``, ``tc``); skipped otherwise with the reason. About a minute each.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agent.netfaults import NetFaults
from controller.models import Job
from controller.recovery.nic import NicDetector, NicFinding
from ops import netns
from tests.harness import build_app, in_process, settings_for
from tests.netns.harness import Samplers, in_namespaces, in_thread, network, skip_reason, training_like
from vigil.contract.schemas import IncidentKind

pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""), pytest.mark.timeout(400),
              pytest.mark.timing]

API = "/api/v1"
LINK = "200mbit"
NODES = 4
GRAD_BYTES = 2 * 1024 * 1024  # each rank sends 1.5 x 2 MiB per step: ~0.13 s at 200 Mbit/s, ~0.5 s at 50
COMPUTE_N = 96
FAULTY = 3  # node index; its rank is FAULTY - 1


def node_id(i: int) -> str:
    return f"vigil-node-{i}"


@dataclass
class Run:
    fault_at: float
    heartbeats: dict[int, list[dict[str, Any]]]
    steps: list[list[dict[str, Any]]]
    fault: tuple[bool, str, dict[str, Any]] = field(default_factory=lambda: (False, "", {}))


def run_with_fault(home: Path, fault: dict[str, Any], before_s: float, after_s: float) -> Run:
    """Ranks and samplers on a fresh network; ``fault`` (a shape_nic command) on node FAULTY after ``before_s``."""
    with network(home, NODES, netns.LinkSpec(rate=LINK)) as net:
        samplers = Samplers(net, home, interval=1.0, duration=3600)  # until stopped
        try:
            started = home / "started"
            join = in_thread(lambda: in_namespaces(net, training_like, before_s + after_s, GRAD_BYTES, COMPUTE_N,
                                                   str(started), timeout=before_s + after_s + 120))
            deadline = time.monotonic() + 120
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(before_s)
            faults = NetFaults("eth0", net.link, netns=net.node(FAULTY).namespace)
            fault_at = time.time()
            result = faults.run(fault)
            try:
                steps = join()
            finally:
                faults.run({"kind": "clear"})
            samplers.stop()  # their last readings are on file
            heartbeats = samplers.read()
        finally:
            samplers.stop()
    return Run(fault_at, heartbeats, steps, result)


@dataclass
class Replay:
    """The recorded run posted to a real controller, the detector run after every heartbeat."""

    client: TestClient
    sessions: Any
    job_id: str
    detector: NicDetector = field(default_factory=NicDetector)
    seq: dict[str, int] = field(default_factory=dict)

    def post(self, node: str, rank: int, ts: float, host: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        self.seq[node] = self.seq.get(node, 0) + 1
        samples = [{"kind": "step", "job_id": self.job_id, "rank": rank, "loss": 3.0, **s} for s in steps]
        body = {"agent_id": f"agent-{node}", "node_id": node, "seq": self.seq[node], "sent_at": ts,
                "samples": samples,
                "heartbeat": {"ts": ts, "hostname": node, "host": host,
                              "ranks": [{"job_id": self.job_id, "rank": rank, "pid": 1000 + rank, "alive": True}]}}
        r = self.client.post(f"{API}/telemetry", json=body)
        assert r.status_code == 200, r.text

    def detect(self, now: float) -> list[NicFinding]:
        with self.sessions() as s:
            return self.detector.detect(s, s.get(Job, self.job_id), now)


@pytest.fixture
def replay(tmp_path: Path) -> Iterator[Replay]:
    app = build_app(settings_for(tmp_path), launcher=None)
    with in_process(app) as c:
        spec = {"name": "nic", "steps": 100000, "scaling": {"min_workers": NODES, "max_workers": NODES}}
        job_id = c.post(f"{API}/jobs", json=spec).json()["id"]
        yield Replay(c, app.state.sessions, job_id)


def replay_run(rp: Replay, run: Run) -> list[tuple[float, NicFinding]]:
    """Post every heartbeat (with the steps its rank made since the previous one) in time order; detect after each."""
    events = sorted((hb["ts"], i, hb["host"]) for i, hbs in run.heartbeats.items() for hb in hbs)
    sent = {i: 0 for i in run.heartbeats}
    found: list[tuple[float, NicFinding]] = []
    for ts, i, host in events:
        steps = [s for s in run.steps[i - 1] if s["ts"] <= ts][sent[i]:]
        sent[i] += len(steps)
        rp.post(node_id(i), i - 1, ts, host, steps)
        found += [(ts, f) for f in rp.detect(ts)]
    return found


def test_degraded_link_is_named_communication_slow(tmp_path: Path, replay: Replay) -> None:
    run = run_with_fault(tmp_path / "net", {"kind": "degrade_nic", "fraction": 0.25}, before_s=10, after_s=12)
    assert run.fault[0], run.fault
    assert "50 Mbit/s" in run.fault[1]
    found = replay_run(replay, run)
    before = [f for ts, f in found if ts < run.fault_at]
    after = [f for ts, f in found if ts >= run.fault_at]
    assert before == [], before
    # Only the faulty node (and its rank) is ever named.
    assert {f.node_id for f in after} == {node_id(FAULTY)}, after
    nic = [f for f in after if f.kind == IncidentKind.NIC_DEGRADED]
    classes = {f.cls for f in nic}
    assert "capacity" in classes, classes
    cap = next(f for f in nic if f.cls == "capacity").evidence
    assert cap["ratio_to_peers"] == pytest.approx(0.25, abs=0.02)
    slow = [f for f in after if f.kind == IncidentKind.STRAGGLER]
    assert slow and {(f.rank, f.cls) for f in slow} == {(FAULTY - 1, "communication-slow")}, slow
    ev = slow[-1].evidence
    assert ev["comm_s"] > ev["compute_s"], ev
    # The ring's steps got slower by about the link's factor, the compute did not.
    steps = run.steps[0]
    t_before = sorted(s["comm_s"] for s in steps if s["ts"] < run.fault_at - 1)
    t_after = sorted(s["comm_s"] for s in steps if s["ts"] > run.fault_at + 2)
    assert t_after[len(t_after) // 2] > 2.0 * t_before[len(t_before) // 2]


def test_flapping_link_is_named(tmp_path: Path, replay: Replay) -> None:
    run = run_with_fault(tmp_path / "net", {"kind": "flap_nic", "seconds": 1.0, "times": 2, "up_s": 1.0},
                         before_s=8, after_s=10)
    assert run.fault[0], run.fault
    found = replay_run(replay, run)
    assert [f for ts, f in found if ts < run.fault_at] == []
    flaps = [f for ts, f in found if f.cls == "link-flap"]
    assert flaps, found
    assert {f.node_id for f in flaps} == {node_id(FAULTY)}
    assert flaps[-1].evidence["carrier_changes"] >= 2  # down and up, counted by the kernel
    assert {f.node_id for _, f in found} == {node_id(FAULTY)}, found
