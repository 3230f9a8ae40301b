"""Two nodes in network namespaces, gloo between them over their veth ``eth0``, one link shaped.

Checks that (a) a collective's time grows as the shaped bandwidth predicts, (b) the agent's NIC
collector, reading the namespace's own counters, counts the bytes the communication layer reports
(plus TCP/IP overhead), (c) every namespace, link and process is gone afterwards - also the state
file's record - and that a crashed run's leftovers are removed by the next run's cleanup.

Needs: root, iproute2 (``ip``, ``tc``); skipped otherwise with the reason. About 30 s.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path

import psutil
import pytest

from ops import netns
from tests.netns.harness import agent_view, in_namespaces, network, skip_reason, timed_all_reduce
from vigil.contract.link import parse_rate

pytestmark = [pytest.mark.links, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
              pytest.mark.timeout(300)]

NBYTES = 16 * 1024 * 1024
REPEATS = 3


def _netns_pids(namespaces: list[str]) -> list[int]:
    out = []
    for ns in namespaces:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        out += [int(p) for p in r.stdout.split()]
    return out


# timing: the shaped link's all-reduce times are compared with the unshaped ones (run alone, after the
# parallel half: under -n 2 the 1 Gbit/s case is CPU-bound and read 0.31 s instead of ~0.13 s)
@pytest.mark.timing
def test_shaped_link_times_counters_and_cleanup(tmp_path: Path) -> None:
    with network(tmp_path, 2, netns.LinkSpec(rate="1gbit")) as net:
        record = net.record()
        state = netns.state_file_for(tmp_path)
        assert net.run_id in state.read_text()
        assert all(n.address.startswith("198.1") for n in net.nodes)

        fast = in_namespaces(net, timed_all_reduce, NBYTES, REPEATS)
        before = agent_view(net.node(1))["interfaces"]["eth0"]
        net.shape(1, netns.LinkSpec(rate="200mbit"))
        slow = in_namespaces(net, timed_all_reduce, NBYTES, REPEATS)
        after = agent_view(net.node(1))["interfaces"]["eth0"]
        rank_pids = [r["pid"] for r in fast + slow]

        # (a) Two ranks: each sends the whole buffer once (half in reduce-scatter, half in all-gather).
        sent = slow[0]["wire_bytes"] / REPEATS
        assert sent == pytest.approx(NBYTES, rel=0.01)
        predicted = sent * 8 / 200e6  # 0.67 s: the shaped node's egress (and ingress) is the bottleneck
        t_slow = statistics.median(max(a, b) for a, b in zip(slow[0]["times"], slow[1]["times"], strict=True))
        t_fast = statistics.median(max(a, b) for a, b in zip(fast[0]["times"], fast[1]["times"], strict=True))
        assert 0.9 * predicted <= t_slow <= 1.6 * predicted + 0.3, (t_slow, predicted)
        assert t_slow >= 2.5 * t_fast, (t_slow, t_fast)

        # (b) What the agent's collector read in node 1's namespace, against what the ranks reported.
        for r in slow:
            assert r["wire_bytes"] <= r["tx"] <= 1.08 * r["wire_bytes"] + 256 * 1024, r
            assert r["wire_bytes"] <= r["rx"] <= 1.08 * r["wire_bytes"] + 256 * 1024, r
        tx = after["tx_bytes"] - before["tx_bytes"]
        rx = after["rx_bytes"] - before["rx_bytes"]
        reported = (REPEATS + 1) * slow[0]["wire_bytes"] / REPEATS  # + the warm-up all-reduce
        assert reported <= tx <= 1.08 * reported + 1024 * 1024, (tx, reported)
        assert reported <= rx <= 1.08 * reported + 1024 * 1024, (rx, reported)
        assert after["operstate"] == "up"
        namespaces = [n.namespace for n in net.nodes]

    # (c) Nothing left: namespaces, veths, bridge, the ranks' processes, the run's record.
    assert netns.leftovers(record) == []
    assert _netns_pids(namespaces) == []
    assert not [p for p in rank_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert net.run_id not in state.read_text()
    assert not (netns.REGISTRY_DIR / f"{net.run_id}.json").exists()


def test_crashed_run_is_cleaned_by_the_next(tmp_path: Path) -> None:
    # A run whose owner died without cleaning up: recorded with a pid that no longer exists.
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    net = netns.create(tmp_path, 1, netns.LinkSpec(rate="100mbit"))
    try:
        rec = net.record()
        rec.update(owner_pid=child.pid, owner_started=1.0)
        netns._remember(net.state_file, rec)  # as the crashed owner would have left it
        # A process left running inside its namespace (a raylet of the crashed run).
        sleeper = subprocess.Popen(net.node(1).exec_argv(["sleep", "300"]))
        assert netns.leftovers(rec)
        assert netns.cleanup_stale(tmp_path) >= 1
        sleeper.wait(10)
        assert netns.leftovers(rec) == []
        assert net.run_id not in net.state_file.read_text()
    finally:
        net.destroy()


def test_live_runs_are_left_alone(tmp_path: Path) -> None:
    with network(tmp_path, 1, netns.LinkSpec()) as net:
        assert netns.cleanup_stale(tmp_path) == 0 or netns.leftovers(net.record()) != []
        assert netns.leftovers(net.record()) != []  # still there: its owner (this process) is alive


def test_link_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="rate"):
        netns.LinkSpec(rate="fast")
    with pytest.raises(ValueError, match="loss"):
        netns.LinkSpec(loss=120)
    with pytest.raises(ValueError, match="jitter"):
        netns.LinkSpec(jitter="1ms")
    assert parse_rate("1gbit") == 1_000_000_000 and parse_rate("50Mbit") == 50_000_000
    assert netns.LinkSpec.from_json(netns.LinkSpec(rate="1gbit", loss=0.5).to_json()) == \
        netns.LinkSpec(rate="1gbit", loss=0.5)


def test_root_is_required_message() -> None:
    assert netns.unavailable_reason() is None if os.geteuid() == 0 else "root" in (netns.unavailable_reason() or "")
