"""Loss and partition, carried out by the agent's code inside a real node namespace, seen from the wire.

``nic_loss`` must make TCP retransmit (the drop happens after TCP handed the packet over) at about
the asked rate, ``partition_node`` must stop every packet both ways while the link stays up and lift
itself after its ``seconds``, and ``clear`` must give back the configured link.

Needs: root, iproute2 (``ip``, ``tc``); skipped otherwise with the reason. About 30 s.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.netfaults import NetFaults
from ops import netns
from tests.netns.harness import agent_view, network, skip_reason

pytestmark = [pytest.mark.links, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
              pytest.mark.timeout(300)]

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5001)); s.listen(1)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    n += len(d)
c.sendall(str(n).encode()); c.close()
"""
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5001), timeout=float(sys.argv[3])); b = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])):
    s.sendall(b)
s.shutdown(socket.SHUT_WR); print(s.recv(64).decode())
"""


def _send(net: netns.NetnsCluster, mib: int, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    src, dst = net.node(1), net.node(2)
    server = subprocess.Popen(dst.exec_argv([sys.executable, "-c", SERVER, dst.address]))
    try:
        time.sleep(0.5)
        return subprocess.run(src.exec_argv([sys.executable, "-c", CLIENT, dst.address, str(mib), str(timeout)]),
                              capture_output=True, text=True, timeout=timeout + 30, check=False)
    finally:
        server.kill()
        server.wait(10)


def _retransmits(node: netns.NodeNet) -> int:
    """The namespace's TCP retransmits as its agent's NIC collector reads them (``host.nics.tcp``), checked
    against the kernel's own table read here."""
    seen = int(agent_view(node)["tcp"]["retrans_segs"])
    r = subprocess.run(node.exec_argv(["cat", "/proc/net/snmp"]), capture_output=True, text=True, check=True)
    head, values = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("Tcp:")][:2]
    assert 0 <= int(values[head.index("RetransSegs")]) - seen <= 5
    return seen


def test_loss_makes_tcp_retransmit_and_clear_restores(tmp_path: Path) -> None:
    with network(tmp_path, 2, netns.LinkSpec(rate="200mbit")) as net:
        nf = NetFaults("eth0", net.link, netns=net.node(1).namespace)
        clean0 = _retransmits(net.node(1))
        assert _send(net, 16).stdout.strip() == str(16 << 20)
        clean = _retransmits(net.node(1)) - clean0
        ok, msg, _ = nf.run({"kind": "nic_loss", "percent": 3})
        assert ok, msg
        before = _retransmits(net.node(1))
        sent = agent_view(net.node(1))["interfaces"]["eth0"]["tx_packets"]
        assert _send(net, 16).stdout.strip() == str(16 << 20)  # TCP still delivers every byte
        lost = _retransmits(net.node(1)) - before
        packets = agent_view(net.node(1))["interfaces"]["eth0"]["tx_packets"] - sent
        # 3% of the packets are dropped; TCP resends each at least once, and a timeout resends a whole window
        # (on a loaded host, RTO resends and spurious ones reached 9% in a clean-clone run): the bound only
        # tells the configured loss from none and from a cut link
        assert 0.01 * packets <= lost <= 0.25 * packets, (lost, packets)
        assert clean <= 0.005 * packets, clean
        ok, msg, out = nf.run({"kind": "clear"})
        assert ok and out["link"] == out["configured"]
        before = _retransmits(net.node(1))
        assert _send(net, 8).stdout.strip() == str(8 << 20)
        assert _retransmits(net.node(1)) - before <= 20


def test_partition_drops_everything_and_lifts_itself(tmp_path: Path) -> None:
    with network(tmp_path, 2, netns.LinkSpec(rate="200mbit")) as net:
        nf = NetFaults("eth0", net.link, netns=net.node(2).namespace)
        ok, msg, _ = nf.run({"kind": "partition_node", "seconds": 6})
        assert ok, msg
        t0 = time.monotonic()
        r = _send(net, 1, timeout=2.0)
        assert r.returncode != 0 and "timed out" in r.stderr  # no SYN-ACK: nothing gets through
        assert agent_view(net.node(2))["interfaces"]["eth0"]["operstate"] == "up"  # a silent partition
        time.sleep(max(0.0, 7.5 - (time.monotonic() - t0)))
        assert not nf.current.partitioned
        assert _send(net, 4).stdout.strip() == str(4 << 20)


ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5002)); s.listen(1)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(64)):
    c.sendall(d)
"""
PING = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5002), timeout=10); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(20):
    t0 = time.perf_counter(); s.sendall(b"x"); s.recv(64); rtts.append(time.perf_counter() - t0)
print(sorted(rtts)[10])
"""


def _median_rtt_s(net: netns.NetnsCluster) -> float:
    src, dst = net.node(1), net.node(2)
    server = subprocess.Popen(dst.exec_argv([sys.executable, "-c", ECHO_SERVER, dst.address]))
    try:
        time.sleep(0.5)
        r = subprocess.run(src.exec_argv([sys.executable, "-c", PING, dst.address]), capture_output=True, text=True,
                           timeout=60, check=True)
        return float(r.stdout.strip())
    finally:
        server.kill()
        server.wait(10)


def _kernel_has_netem(node: netns.NodeNet) -> bool:
    """Whether this kernel has sch_netem: a netem qdisc on the loopback of the node's own namespace."""
    r = subprocess.run(node.exec_argv(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]),
                       capture_output=True, text=True, check=False)
    if r.returncode == 0:
        subprocess.run(node.exec_argv(["tc", "qdisc", "del", "dev", "lo", "root"]), capture_output=True, check=False)
    return r.returncode == 0


def test_latency_delays_each_round_trip_or_says_the_kernel_cannot(tmp_path: Path) -> None:
    """With sch_netem, +40 ms on node 1's egress shows in every round trip; without it (this project's
    machine), nic_latency answers that it needs sch_netem and leaves the link as configured."""
    with network(tmp_path, 2, netns.LinkSpec(rate="200mbit")) as net:
        nf = NetFaults("eth0", net.link, netns=net.node(1).namespace)
        base = _median_rtt_s(net)
        ok, msg, _ = nf.run({"kind": "nic_latency", "delay_ms": 40})
        if _kernel_has_netem(net.node(1)):
            assert ok, msg
            assert _median_rtt_s(net) >= base + 0.035
            assert nf.run({"kind": "clear"})[0]
            assert _median_rtt_s(net) < base + 0.02
        else:
            assert not ok and "netem" in msg, msg
            assert nf.current == net.link  # nothing half applied
            assert _median_rtt_s(net) < base + 0.02
            assert _send(net, 4).stdout.strip() == str(4 << 20)
