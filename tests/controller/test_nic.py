"""The NIC detector (controller/recovery/nic.py) on synthetic heartbeats, and its monitor hook.

Heartbeats and step samples are posted to a real controller app (SQLite) as agents post them; the
detector and the monitor run one pass at a time on a fake clock. The same detector against real
faults on real namespaced links is tests/netns/test_nic_faults.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.launcher import LaunchStatus
from controller.models import Job
from controller.recovery.monitor import Monitor
from controller.recovery.nic import NicDetector, NicFinding, incidents, observe, primary_interface
from tests.harness import build_app, in_process, settings_for
from vigil.contract.schemas import IncidentKind, JobStatus

API = "/api/v1"
NODES = ["vigil-node-1", "vigil-node-2", "vigil-node-3", "vigil-node-4"]


def host(tx_mbps: float, rate_mbps: float | None = 1000.0, carrier: int = 2, operstate: str = "up",
         errors: float = 0.0, overlimits: float = 0.0, retrans: float | None = 0.0005) -> dict[str, Any]:
    eth0 = {"rx_bytes": 10**9, "tx_bytes": 10**9, "operstate": operstate, "speed_mbps": 10000,
            "carrier_changes": carrier, "tx_bytes_per_s": tx_mbps * 1e6 / 8, "rx_bytes_per_s": tx_mbps * 1e6 / 8,
            "rx_errors_per_s": errors, "tx_errors_per_s": 0.0, "rx_dropped_per_s": 0.0, "tx_dropped_per_s": 0.0}
    ifb0 = {**eth0, "carrier_changes": 0}
    link = {"available": True, "iface": "eth0", "rate_bps": None if rate_mbps is None else int(rate_mbps * 1e6),
            "egress": {"overlimits_per_s": overlimits}, "ingress": None}
    tcp = {"available": True, "out_segs_per_s": 5000.0, "retrans_ratio": retrans}
    return {"nics": {"available": True, "interfaces": {"eth0": eth0, "ifb0": ifb0}, "tcp": tcp}, "link": link}


@dataclass
class Rig:
    client: TestClient
    app: Any
    job_id: str
    now: float = field(default_factory=time.time)
    seq: int = 0
    step: int = 0
    detector: NicDetector = field(default_factory=NicDetector)

    def beat(self, hosts: dict[str, dict[str, Any]], comm_s: float = 0.02, compute_s: float = 0.1,
             away: frozenset[str] = frozenset()) -> None:
        """One heartbeat of every node (a step of every rank with it, none on the nodes ``away``: their
        ranks are gone); the clock moves 1 s."""
        self.now += 1.0
        self.step += 1
        for rank, node in enumerate(NODES):
            self.seq += 1
            step = {"kind": "step", "job_id": self.job_id, "rank": rank, "step": self.step, "ts": self.now,
                    "loss": 3.0, "step_time_s": comm_s + compute_s, "fwd_bwd_s": compute_s, "comm_s": comm_s}
            ranks = [] if node in away else [{"job_id": self.job_id, "rank": rank, "pid": 100 + rank, "alive": True}]
            body = {"agent_id": f"agent-{node}", "node_id": node, "seq": self.seq, "sent_at": self.now,
                    "samples": [] if node in away else [step],
                    "heartbeat": {"ts": self.now, "hostname": node, "host": hosts[node], "ranks": ranks}}
            r = self.client.post(f"{API}/telemetry", json=body)
            assert r.status_code == 200, r.text

    def detect(self) -> list[NicFinding]:
        with self.app.state.sessions() as s:
            return self.detector.detect(s, s.get(Job, self.job_id), self.now)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    app = build_app(settings_for(tmp_path))
    with in_process(app) as c:
        spec = {"name": "nic", "steps": 10000, "scaling": {"min_workers": 4, "max_workers": 4},
                "recovery": {"policy": "observe"}}
        yield Rig(c, app, c.post(f"{API}/jobs", json=spec).json()["id"])


def healthy(**over: dict[str, Any]) -> dict[str, dict[str, Any]]:
    hosts = {n: host(300.0) for n in NODES}
    hosts.update(over)
    return hosts


def test_healthy_nodes_have_no_findings(rig: Rig) -> None:
    for _ in range(12):
        rig.beat(healthy())
        assert rig.detect() == []


def test_degraded_link_needs_k_of_m_heartbeats_and_names_the_rank_communication_slow(rig: Rig) -> None:
    for _ in range(8):
        rig.beat(healthy(), comm_s=0.02)
        rig.detect()
    found: list[list[NicFinding]] = []
    for _ in range(4):
        # Node 3 at a quarter of its peers' rate and at its limit; every node moves the same bytes.
        rig.beat({n: host(240.0, 250.0 if n == NODES[2] else 1000.0) for n in NODES}, comm_s=0.08)
        found.append(rig.detect())
    assert found[0] == [] and found[1] == []  # k = 3 heartbeats
    last = found[-1]
    assert {f.node_id for f in last} == {NODES[2]}
    assert {f.cls for f in last if f.kind == IncidentKind.NIC_DEGRADED} == {"capacity", "saturated"}
    cap = next(f for f in last if f.cls == "capacity")
    assert cap.evidence["ratio_to_peers"] == 0.25 and cap.rank == 2
    slow = [f for f in last if f.kind == IncidentKind.STRAGGLER]
    assert [(f.rank, f.cls) for f in slow] == [(2, "communication-slow")]
    assert slow[0].evidence["comm_growth"] == pytest.approx(4.0) and "compute" in slow[0].evidence["why"]
    merged = incidents(last)
    assert len(merged) == 1 and merged[0].kind == IncidentKind.STRAGGLER
    assert merged[0].evidence["nic_classes"] == ["capacity", "saturated"]


def test_a_node_that_comes_back_is_judged_on_what_it_shows_now(rig: Rig) -> None:
    # Node 3's link degraded and found; its ranks left it (evicted) and its link was repaired meanwhile.
    # When ranks return, its old heartbeats are no evidence (a chaos run re-found a cleared link so).
    for _ in range(8):
        rig.beat(healthy())
        rig.detect()
    for _ in range(4):
        rig.beat({n: host(240.0, 250.0 if n == NODES[2] else 1000.0) for n in NODES})
        found = rig.detect()
    assert "capacity" in {f.cls for f in found if f.node_id == NODES[2]}
    for _ in range(3):
        rig.beat(healthy(), away=frozenset({NODES[2]}))
        assert not [f for f in rig.detect() if f.node_id == NODES[2]]
    for _ in range(4):
        rig.beat(healthy())
        assert rig.detect() == []


def test_a_node_that_only_sends_more_is_not_saturated(rig: Rig) -> None:
    for _ in range(8):
        rig.beat({n: host(900.0 if n == NODES[0] else 300.0) for n in NODES})
        assert rig.detect() == []


def test_flap_down_and_errors(rig: Rig) -> None:
    for _ in range(4):
        rig.beat(healthy())
        rig.detect()
    rig.beat(healthy(**{NODES[1]: host(300.0, operstate="down", carrier=3)}))
    found = rig.detect()
    assert {(f.node_id, f.cls) for f in found} == {(NODES[1], "link-down"), (NODES[1], "link-flap")}
    rig.beat(healthy(**{NODES[1]: host(300.0, carrier=4)}))
    flap = [f for f in rig.detect() if f.cls == "link-flap"]
    assert flap[0].evidence["carrier_changes"] == 2
    for _ in range(3):
        rig.beat(healthy(**{NODES[3]: host(300.0, errors=50.0), NODES[1]: host(300.0, carrier=4)}))
        found = rig.detect()
    assert (NODES[3], "nic-errors") in {(f.node_id, f.cls) for f in found}


def test_a_lossy_link_is_named_by_its_retransmits(rig: Rig) -> None:
    # Loss on the wire leaves the NIC's counters clean; the sender's TCP retransmits show it.
    for _ in range(8):
        rig.beat(healthy(), comm_s=0.02)
        rig.detect()
    found: list[list[NicFinding]] = []
    for _ in range(4):
        rig.beat(healthy(**{NODES[1]: host(300.0, retrans=0.06), NODES[2]: host(300.0, retrans=None)}), comm_s=0.09)
        found.append(rig.detect())
    assert found[1] == [] and "retransmits" in {f.cls for f in found[2]}  # k = 3 heartbeats
    assert {(f.node_id, f.cls) for f in found[-1] if f.kind == IncidentKind.NIC_DEGRADED} == {(NODES[1], "retransmits")}
    lossy = next(f for f in found[-1] if f.cls == "retransmits")
    assert lossy.evidence["retrans_ratio"] == 0.06 and lossy.evidence["peers_median_retrans_ratio"] == 0.0005
    assert [(f.rank, f.cls) for f in found[-1] if f.kind == IncidentKind.STRAGGLER] == [(1, "communication-slow")]
    # Node 3's link degraded: node 4, which sends to it, retransmits what node 3's queue dropped (seen
    # on a real shaped link). Node 3's sick link explains that: only node 3 is named.
    for _ in range(4):
        rig.beat({n: host(240.0, 250.0 if n == NODES[2] else 1000.0, retrans=0.08 if n == NODES[3] else 0.0005)
                  for n in NODES}, comm_s=0.09)
        found = rig.detect()
    assert {f.node_id for f in found} == {NODES[2]}, found
    # The same ratio on every node (a congested fabric, not one node's link): nothing.
    for _ in range(4):
        rig.beat({n: host(300.0, retrans=0.06) for n in NODES}, comm_s=0.09)
        assert not [f for f in rig.detect() if f.cls == "retransmits" and f.node_id != NODES[1]]


def test_a_senders_retransmits_wait_while_a_peers_link_shows_its_fall_in_its_newest_heartbeat(rig: Rig) -> None:
    """Beats out of phase: node 4's retransmits reach k of m while node 3's fallen rate is in its newest
    heartbeat only (seen in CI: the sender was named). Node 3's slow link already explains them; node 3 is
    named once its own k heartbeats are in, node 4 never."""
    for _ in range(8):
        rig.beat(healthy(), comm_s=0.02)
        rig.detect()
    for i in range(6):
        rig.beat({n: host(240.0, 250.0 if (n == NODES[2] and i >= 2) else 1000.0,
                          retrans=0.08 if n == NODES[3] else 0.0005) for n in NODES}, comm_s=0.09)
        found = rig.detect()
        assert not [f for f in found if f.node_id == NODES[3]], (i, found)
    assert {f.node_id for f in found if f.cls == "capacity"} == {NODES[2]}, found


def test_interface_choice_and_unavailable_data() -> None:
    nics = {"lo": {"rx_bytes": 10**12}, "ifb0": {"rx_bytes": 10**12}, "ens5": {"rx_bytes": 5, "tx_bytes": 5},
            "eth1": {"rx_bytes": 1, "tx_bytes": 1}, "veth12": {"rx_bytes": 10**9}}
    assert primary_interface(nics, None) == "ens5"
    assert primary_interface(nics, {"available": True, "iface": "eth1"}) == "eth1"
    assert observe({}, 1.0).iface is None
    assert observe({"nics": {"available": False, "reason": "no /proc"}}, 1.0).iface is None


def test_monitor_hook_opens_one_incident(rig: Rig) -> None:
    launcher = rig.app.state.launcher
    rig.app.state.supervisor.step()
    launcher.statuses[f"fake-{rig.job_id}"] = LaunchStatus(JobStatus.RUNNING)
    rig.app.state.supervisor.step()
    monitor = Monitor(rig.app.state.sessions, launcher, None, clock=lambda: rig.now)
    for _ in range(8):
        rig.beat(healthy(), comm_s=0.02)
        monitor.step()
    for _ in range(5):
        rig.beat({n: host(240.0, 250.0 if n == NODES[2] else 1000.0) for n in NODES}, comm_s=0.08)
        monitor.step()
    inc = rig.client.get(f"{API}/jobs/{rig.job_id}/incidents").json()["data"]
    assert [(i["kind"], i["node_id"], i["rank"], i["evidence"]["class"]) for i in inc] == \
        [("straggler", NODES[2], 2, "communication-slow")]
    assert inc[0]["evidence"]["nic"]["ratio_to_peers"] == 0.25
