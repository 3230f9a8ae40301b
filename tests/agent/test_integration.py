"""The agent against a real HTTP server: outages, lost acks and agent restarts lose nothing and
duplicate nothing.

The server is ``doubles.TelemetryServer``, a test double of the controller's ingest endpoint
(http.server on 127.0.0.1, port 0), which can be switched down (listening socket closed,
connections cut) and up again on the same port. Ranks are played by this test, sending real
datagrams to the agent's real unix socket. The restart test runs ``python -m agent`` as a child
process and stops it with SIGTERM.

Needs: Linux, loopback networking, a writable /tmp; about 10-20 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.main import AgentConfig
from agent.spool import _NAME
from tests.agent.doubles import (
    AgentThread,
    TelemetryServer,
    collective_dict,
    datagram,
    send_datagrams,
    socket_ready,
    step_dict,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def send_steps(sock: Path, start: int, stop: int, per_datagram: int = 25) -> None:
    """Rank 0 reports steps [start, stop): each datagram a few steps, each step with a collective."""
    payloads = []
    for s in range(start, stop, per_datagram):
        items = []
        for i in range(s, min(s + per_datagram, stop)):
            items += [step_dict(i, pid=os.getpid()), collective_dict(i)]
        payloads.append(datagram(items))
    send_datagrams(str(sock), payloads)


def step_numbers(server: TelemetryServer) -> list[int]:
    return [s.step for s in server.samples() if s.kind == "step"]


def arrival_seqs(server: TelemetryServer) -> list[int]:
    return [b.seq for b in server.snapshot()]


def spooled_files(spool: Path) -> list[tuple[int, int]]:
    out = []
    for p in spool.iterdir():
        m = _NAME.match(p.name)
        if m:
            out.append((int(m.group(1)), int(m.group(2))))
    return sorted(out)


@pytest.fixture
def server():
    srv = TelemetryServer()
    srv.up()
    yield srv
    srv.down()


def fast_config(server: TelemetryServer, run_dir: Path, node_id: str) -> AgentConfig:
    return AgentConfig(
        node_id=node_id,
        controller_url=server.url,
        token="vgl_test",
        run_dir=run_dir,
        flush_interval_s=0.1,
        heartbeat_interval_s=0.2,
        backoff_initial_s=0.05,
        backoff_max_s=0.3,
        http_timeout_s=2.0,
    )


def test_outage_every_sample_arrives_exactly_once_and_in_order(server, short_dir):
    cfg = fast_config(server, short_dir, "node-out")
    with AgentThread(cfg):
        send_steps(cfg.socket_path, 0, 500)
        wait_for(lambda: len(step_numbers(server)) == 500, what="500 steps before the outage")

        server.down()
        send_steps(cfg.socket_path, 500, 1000)
        wait_for(
            lambda: sum(n for _, n in spooled_files(cfg.spool_dir)) == 1000, what="outage samples spooled"
        )
        send_steps(cfg.socket_path, 1000, 1500)  # more while still down: they queue behind
        assert len(step_numbers(server)) == 500  # nothing got through the outage

        server.up()
        wait_for(lambda: len(step_numbers(server)) == 1500, what="all 1500 steps after the outage")
    # Exactly once, in order, and the batches arrived in numbering order.
    assert step_numbers(server) == list(range(1500))
    assert len(server.samples()) == 3000  # plus one collective per step
    seqs = arrival_seqs(server)
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert spooled_files(cfg.spool_dir) == []  # the spool drained
    hbs = server.heartbeats()
    assert len(hbs) >= 3 and hbs[-1].dropped_samples == 0
    assert any(r.pid == os.getpid() and r.alive for hb in hbs for r in hb.ranks)


def test_lost_acks_and_5xx_are_retried_and_stored_once(server, short_dir):
    cfg = fast_config(server, short_dir, "node-ack")
    with AgentThread(cfg):
        server.mode = "drop"  # the server stores each batch but the answer never comes back
        send_steps(cfg.socket_path, 0, 300)
        # The oldest batch is stored, its answer lost, retried (a duplicate), lost again...; the
        # batches behind it wait in the spool.
        wait_for(
            lambda: server.duplicates >= 2 and len(spooled_files(cfg.spool_dir)) >= 2, what="retried batch"
        )
        server.mode = "503"
        posts = server.posts
        send_steps(cfg.socket_path, 300, 600)
        wait_for(lambda: server.posts >= posts + 3, what="posts answered 503")
        assert len(step_numbers(server)) < 600
        server.mode = "ok"
        wait_for(lambda: len(step_numbers(server)) == 600, what="all 600 steps")
    assert step_numbers(server) == list(range(600))
    assert server.duplicates >= 1  # the replays happened, and were recognised
    seqs = arrival_seqs(server)
    assert seqs == sorted(seqs)


def test_agent_process_restart_keeps_spooled_batches_and_continues_numbering(server, short_dir):
    sock, spool = short_dir / "agents" / "node-rst.sock", short_dir / "spool-rst"
    argv = [
        sys.executable, "-m", "agent",
        "--node-id", "node-rst",
        "--controller", server.url,
        "--socket", str(sock),
        "--spool-dir", str(spool),
        "--run-dir", str(short_dir),
        "--flush-interval", "0.1",
        "--heartbeat-interval", "0.2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "VIGIL_TOKEN": "vgl_test"}

    def start(log: Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        wait_for(
            lambda: socket_ready(sock) or proc.poll() is not None, timeout=30, what="agent process socket"
        )
        assert proc.poll() is None, log.read_text()
        return proc

    def terminate(proc: subprocess.Popen[bytes], log: Path) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()

    log1, log2 = short_dir / "agent1.log", short_dir / "agent2.log"
    first = start(log1)
    try:
        send_steps(sock, 0, 200)
        wait_for(lambda: len(step_numbers(server)) == 200, what="first run delivered")
        server.down()
        send_steps(sock, 200, 400)
        terminate(first, log1)  # stopped during the outage
    finally:
        if first.poll() is None:
            first.kill()
    left = spooled_files(spool)
    assert sum(n for _, n in left) == 400  # 200 steps + 200 collectives wait on disk
    first_run_seqs = arrival_seqs(server) + [seq for seq, _ in left]
    assert not sock.exists()

    server.up()
    second = start(log2)
    try:
        send_steps(sock, 400, 600)
        wait_for(lambda: len(step_numbers(server)) == 600, what="spool replayed and second run delivered")
        terminate(second, log2)
    finally:
        if second.poll() is None:
            second.kill()
    assert step_numbers(server) == list(range(600))
    seqs = arrival_seqs(server)
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    second_run_seqs = [b.seq for b in server.snapshot() if b.seq not in first_run_seqs]
    assert second_run_seqs and min(second_run_seqs) > max(first_run_seqs)  # numbering continued
    assert spooled_files(spool) == []
    assert "controller unreachable" in log1.read_text()
