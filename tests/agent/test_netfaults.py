"""agent/netfaults.py with a recording runner: what each network fault asks of ``ip``/``tc``, stacking,
``clear``, the partition's own timer, and the refusals (no interface, not a Vigil namespace, bad params).

No root needed: nothing is run (the same code against real namespaces is tests/netns/).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from agent import netfaults
from agent.netfaults import LinkCollector, NetFaults
from controller.recovery import nic
from vigil.contract.link import LinkSpec, shape_commands

NS = "vigil-abc123-n1"


class Recorder:
    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        bad = self.fail is not None and self.fail in argv
        return subprocess.CompletedProcess(list(argv), 2 if bad else 0, "", "Error: unknown qdisc" if bad else "")

    def joined(self) -> list[str]:
        return [" ".join(c) for c in self.calls]


class ManualTimer:
    """threading.Timer stand-in that fires only when told to."""

    made: ClassVar[list[ManualTimer]] = []

    def __init__(self, seconds: float, fn: Any) -> None:
        self.seconds, self.fn, self.daemon, self.cancelled = seconds, fn, False, False
        ManualTimer.made.append(self)

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.fn()


def faults(rec: Recorder, base: LinkSpec | None = None) -> NetFaults:
    return NetFaults("eth0", base or LinkSpec(rate="1gbit"), netns=NS, runner=rec, timer=ManualTimer)


def test_degrade_then_loss_stack_and_clear_restores_the_configured_link() -> None:
    rec = Recorder()
    nf = faults(rec)
    ok, msg, out = nf.run({"kind": "degrade_nic", "fraction": 0.25})
    assert ok and "1000 -> 250 Mbit/s" in msg and out["link"]["rate"] == "250000000bit"
    assert any("htb rate 250000000bit" in c for c in rec.joined())
    ok, msg, out = nf.run({"kind": "nic_loss", "percent": 2})
    assert ok and out["link"] == {**out["link"], "rate": "250000000bit", "loss": 2.0}
    assert any("ifb1" in c and "bpf" in c for c in rec.joined())
    ok, msg, out = nf.run({"kind": "clear"})
    assert ok and out["link"] == out["configured"] and nf.current == LinkSpec(rate="1gbit")
    assert f"ip netns exec {NS} ip link set eth0 up" in rec.joined()


def test_default_fraction_and_bounds() -> None:
    nf = faults(Recorder())
    ok, msg, _ = nf.run({"kind": "degrade_nic"})
    assert ok and "-> 250 Mbit/s" in msg
    for bad in ({"kind": "degrade_nic", "fraction": 0}, {"kind": "degrade_nic", "fraction": "x"},
                {"kind": "nic_loss", "percent": 101}, {"kind": "flap_nic", "seconds": -1}, {"kind": "reboot"}):
        ok, msg, _ = nf.run(bad)
        assert not ok and msg, bad


def test_a_failed_shape_keeps_the_previous_link() -> None:
    rec = Recorder(fail="netem")
    nf = faults(rec)
    nf.run({"kind": "degrade_nic", "fraction": 0.5})
    ok, msg, _out = nf.run({"kind": "nic_latency", "delay_ms": 5})
    assert not ok and "unknown qdisc" in msg
    assert nf.current.rate == "500000000bit" and nf.current.latency is None
    assert rec.calls[-1][-2:] != ["10:", "netem"]  # the last thing done was restoring the degraded link


def test_partition_is_lifted_by_its_own_timer() -> None:
    ManualTimer.made.clear()
    nf = faults(Recorder())
    ok, _msg, _out = nf.run({"kind": "partition_node", "seconds": 5})
    assert ok and nf.current.partitioned and ManualTimer.made[-1].seconds == 5
    ManualTimer.made[-1].fire()
    assert not nf.current.partitioned and nf.current.rate == "1gbit"


def test_flap_runs_down_and_up_in_a_thread() -> None:
    rec = Recorder()
    nf = faults(rec)
    ok, _, _ = nf.run({"kind": "flap_nic", "seconds": 0.05, "times": 2, "up_s": 0.05})
    assert ok
    deadline = time.monotonic() + 5
    while sum("eth0 up" in c for c in rec.joined()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    ups = [c for c in rec.joined() if c.endswith("link set eth0 up")]
    downs = [c for c in rec.joined() if c.endswith("link set eth0 down")]
    assert len(downs) == 2 and len(ups) == 2
    nf.run({"kind": "clear"})
    assert not [t for t in threading.enumerate() if t.name.startswith("vigil-flap")]


def test_refusals_without_an_interface_or_outside_a_vigil_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(netfaults.ENV_IFACE, raising=False)
    ok, msg, _ = netfaults.shape_nic({"kind": "degrade_nic"})
    assert not ok and "not supported on this node" in msg
    ok, msg, _ = NetFaults("eth0", LinkSpec(rate="1gbit"), netns="someone-elses", runner=Recorder()).run(
        {"kind": "degrade_nic"})
    assert not ok and "not one of Vigil's" in msg
    rec = Recorder()
    ok, msg, _ = NetFaults("eth0", LinkSpec(rate="1gbit"), runner=rec).run({"kind": "degrade_nic"})
    assert not ok and "not inside a Vigil node namespace" in msg and rec.calls == []


def test_link_collector_parses_tc() -> None:
    qdiscs = ('[{"kind":"htb","dev":"eth0","root":true,"bytes":1000,"packets":10,"drops":1,"overlimits":5,'
              '"requeues":0,"backlog":300,"qlen":2},{"kind":"htb","dev":"ifb0","root":true,"bytes":50,'
              '"packets":1,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0}]')
    now = [100.0]

    def runner(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        if "qdisc" in argv:
            return subprocess.CompletedProcess(list(argv), 0, qdiscs, "")
        return subprocess.CompletedProcess(list(argv), 0, "class htb 1:1 root leaf 10: prio 0 rate 250Mbit ceil 250Mbit", "")

    c = LinkCollector("eth0", runner=runner, clock=lambda: now[0])
    first = c.collect()
    assert first["available"] and first["rate_bps"] == 250_000_000
    assert first["egress"]["backlog_bytes"] == 300 and first["egress"]["overlimits_per_s"] is None
    qdiscs = qdiscs.replace('"overlimits":5', '"overlimits":25')
    now[0] += 2.0
    assert c.collect()["egress"]["overlimits_per_s"] == 10.0
    broken = LinkCollector("eth0", runner=lambda argv: subprocess.CompletedProcess(list(argv), 1, "", "no tc"))
    assert broken.collect()["available"] is False


def test_a_link_with_loss_only_reports_no_rate_limit() -> None:
    # Loss or latency alone ride in a class at the placeholder rate (100gbit): not a capacity. Reported
    # as one, an untouched peer at its veth's 10 Gbit/s looked 10x slower than the lossy node.
    def runner(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        if "qdisc" in argv:
            return subprocess.CompletedProcess(list(argv), 0, "[]", "")
        return subprocess.CompletedProcess(list(argv), 0, "class htb 1:1 root leaf 10: prio 0 rate 100Gbit ceil 100Gbit", "")

    assert LinkCollector("eth0", runner=runner).collect()["rate_bps"] is None
    obs = nic.observe({"nics": {"interfaces": {"eth0": {"speed_mbps": 10_000, "tx_bytes_per_s": 1.0, "rx_bytes_per_s": 1.0}}},
                       "link": LinkCollector("eth0", runner=runner).collect()}, 1.0)
    assert obs.capacity_bps == 10e9  # the NIC's own speed, as on its unshaped peers


def test_shape_commands_layout() -> None:
    cmds = [" ".join(c) for c in shape_commands(LinkSpec(rate="200mbit", partitioned=True), netns=NS)]
    assert any("eth0 root handle 1: htb" in c for c in cmds)
    assert any("ifb0 type ifb" in c for c in cmds) and any("mirred egress redirect dev ifb0" in c for c in cmds)
    assert sum("flowid 1:99" in c for c in cmds) == 2  # both directions dropped
    assert shape_commands(LinkSpec()) == []  # an unlimited link: nothing to install
