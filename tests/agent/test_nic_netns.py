"""The agent's NIC collector on a real veth pair: its rates match the bytes this test sent through it.

The test creates a network namespace and a veth pair (one end in this namespace, the other in the
new one) with addresses from 198.18.0.0/15 (set aside for benchmark tests), sends UDP datagrams
only to the peer end inside that namespace, and removes everything it created, also on failure.
No ARP or IPv6 chatter on the link: the neighbour entries are static and IPv6 is off on both ends,
so every byte counted is one of the test's packets.

Needs: root and iproute2 (``ip``); skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agent.collectors import NicCollector

pytestmark = [
    pytest.mark.links,
    pytest.mark.skipif(os.geteuid() != 0, reason="creating a network namespace and a veth pair needs root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's `ip` is not installed"),
    pytest.mark.timeout(120),
]

#: Ethernet (14) + IPv4 (20) + UDP (8) header bytes around each datagram's payload on the veth.
HEADERS = 14 + 20 + 8


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Link:
    ns: str
    host_if: str
    peer_if: str
    host_ip: str
    peer_ip: str


@pytest.fixture
def veth() -> Iterator[Link]:
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16) % 64 * 4  # a /30 inside 198.18.7.0/24, different per run
    link = Link(ns=f"vgt-{tag}", host_if=f"vgh{tag}", peer_if=f"vgp{tag}",
                host_ip=f"198.18.7.{octet + 1}", peer_ip=f"198.18.7.{octet + 2}")
    try:
        ip("netns", "add", link.ns)
        ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.peer_if)
        ip("link", "set", link.peer_if, "netns", link.ns)
        for ifname, ns in ((link.host_if, None), (link.peer_if, link.ns)):
            # No IPv6 on the link: no router or neighbour solicitations in the counters.
            sysctl = ["sysctl", "-q", "-w", f"net.ipv6.conf.{ifname}.disable_ipv6=1"]
            subprocess.run(["ip", "netns", "exec", ns, *sysctl] if ns else sysctl, check=True, timeout=30)
        ip("addr", "add", f"{link.host_ip}/30", "dev", link.host_if)
        ip("addr", "add", f"{link.peer_ip}/30", "dev", link.peer_if, ns=link.ns)
        ip("link", "set", link.host_if, "up")
        ip("link", "set", link.peer_if, "up", ns=link.ns)
        ip("link", "set", "lo", "up", ns=link.ns)
        peer_mac = ip("-o", "link", "show", link.peer_if, ns=link.ns).stdout.split("link/ether ")[1].split()[0]
        host_mac = ip("-o", "link", "show", link.host_if).stdout.split("link/ether ")[1].split()[0]
        # Static neighbours both ways: no ARP on the link (the peer answers our datagrams with ICMP).
        ip("neigh", "replace", link.peer_ip, "lladdr", peer_mac, "dev", link.host_if, "nud", "permanent")
        ip("neigh", "replace", link.host_ip, "lladdr", host_mac, "dev", link.peer_if, "nud", "permanent", ns=link.ns)
        yield link
    finally:
        ip("netns", "del", link.ns, check=False)  # takes the peer end, and with it the pair
        if ip("link", "show", link.host_if, check=False).returncode == 0:
            ip("link", "del", link.host_if, check=False)
        assert link.ns not in ip("netns", "list").stdout
        assert ip("link", "show", link.host_if, check=False).returncode != 0


def test_nic_rates_match_the_bytes_sent_through_a_veth(veth: Link) -> None:
    collector = NicCollector(interfaces=[veth.host_if])
    first = collector.collect()["interfaces"][veth.host_if]
    assert first["operstate"] == "up" and first["tx_bytes_per_s"] is None  # no rate from one reading
    time.sleep(0.3)  # let the link settle (carrier up), then take the baseline reading
    base = collector.collect()["interfaces"][veth.host_if]

    payload, count = 1000, 500
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, veth.host_if.encode())
        for i in range(count):
            sent += s.sendto(bytes([i % 256]) * payload, (veth.peer_ip, 9))  # discard port, in the namespace
            if i % 50 == 0:
                time.sleep(0.05)  # spread over about half a second
    time.sleep(0.2)
    now = collector.collect()["interfaces"][veth.host_if]

    assert sent == payload * count
    wire = sent + count * HEADERS
    assert now["tx_packets"] - base["tx_packets"] == count
    assert now["tx_bytes"] - base["tx_bytes"] == wire
    # The rate is computed from the counters over the collector's own interval: bytes, not guesses.
    assert now["interval_s"] > 0.5
    assert now["tx_bytes_per_s"] * now["interval_s"] == pytest.approx(wire, rel=1e-9)
    assert now["tx_packets_per_s"] * now["interval_s"] == pytest.approx(count, rel=1e-9)
    assert now["tx_errors_per_s"] == 0 and now["tx_dropped_per_s"] == 0
    # What came back from the namespace (port unreachable, rate-limited by its kernel) is counted
    # as received; nothing else arrives on this link.
    assert now["rx_bytes_per_s"] * now["interval_s"] == pytest.approx(now["rx_bytes"] - base["rx_bytes"])
