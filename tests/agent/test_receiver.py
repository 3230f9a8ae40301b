"""Receiver: a real unix datagram socket, valid and invalid datagrams, rank process tracking.

Needs: Linux (AF_UNIX datagram sockets), a writable /tmp. No network, no controller.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from agent.ranksocket import SocketInUseError, bind_datagram_socket
from agent.receiver import (
    ExitWatcher,
    RankTracker,
    Receiver,
    SampleBuffer,
    process_alive,
)
from tests.agent.doubles import FakeClock, collective_dict, datagram, send_datagrams, step_dict, wait_for
from vigil.contract.schemas import CollectiveSample, StepSample


@pytest.fixture
def receiver(short_dir):
    r = Receiver(short_dir / "run" / "agents" / "n1.sock", SampleBuffer(capacity=1000))
    r.bind()
    yield r
    r.stop()


def test_valid_datagrams_are_buffered_in_order(receiver):
    path = str(receiver.socket_path)
    send_datagrams(path, [datagram([step_dict(0), collective_dict(0, 0), collective_dict(0, 1)])])
    send_datagrams(path, [datagram([step_dict(1)])])
    assert receiver.step(timeout=2) and receiver.step(timeout=2)
    assert receiver.step(timeout=0) is False  # nothing else queued
    got = receiver.buffer.take(100)
    assert [type(s) for s in got] == [StepSample, CollectiveSample, CollectiveSample, StepSample]
    assert [(s.kind, s.step) for s in got] == [("step", 0), ("collective", 0), ("collective", 0), ("step", 1)]
    assert [s.seq for s in got if isinstance(s, CollectiveSample)] == [0, 1]
    assert receiver.stats.datagrams == 2 and receiver.stats.samples == 4
    assert receiver.stats.invalid_datagrams == 0


def test_invalid_datagrams_are_counted_and_do_not_stop_the_receiver(receiver):
    path = str(receiver.socket_path)
    bad_item = step_dict(5)
    bad_item["step_time_s"] = -1.0  # violates ge=0
    send_datagrams(
        path,
        [
            b"this is not json",
            b"\xff\xfe\x00 not utf-8",
            b'{"kind": "step"}',  # JSON, but not an array
            datagram([{"kind": "gpu", "rank": 0}]),  # unknown kind
            datagram([step_dict(4), bad_item, collective_dict(4)]),  # one bad item among good ones
            datagram([step_dict(6)]),
        ],
    )
    for _ in range(6):
        assert receiver.step(timeout=2)
    assert receiver.stats.datagrams == 6
    assert receiver.stats.invalid_datagrams == 5
    assert receiver.stats.invalid_samples == 2  # the unknown kind and the negative step time
    got = receiver.buffer.take(100)
    # The good neighbours of the bad item are kept, in order.
    assert [(s.kind, s.step) for s in got] == [("step", 4), ("collective", 4), ("step", 6)]


def test_receiver_thread_survives_bad_input(receiver):
    receiver.start()
    path = str(receiver.socket_path)
    send_datagrams(path, [b"[1, 2, 3]", b"\x00" * 100, datagram([step_dict(i) for i in range(10)])])
    wait_for(lambda: len(receiver.buffer) == 10, timeout=10, what="10 samples")
    assert receiver._thread is not None and receiver._thread.is_alive()
    assert receiver.stats.invalid_datagrams == 2


def test_stop_takes_in_queued_datagrams_and_removes_the_socket(receiver):
    path = str(receiver.socket_path)
    send_datagrams(path, [datagram([step_dict(i)]) for i in range(5)])
    receiver.stop()
    assert len(receiver.buffer) == 5
    assert not os.path.exists(path)


def test_bind_creates_parents_replaces_stale_socket_and_sets_mode(short_dir):
    path = short_dir / "a" / "b" / "n.sock"
    # A stale socket file: bound once by a process that went away without removing it.
    path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()
    assert stat.S_ISSOCK(path.lstat().st_mode)
    sock = bind_datagram_socket(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        send_datagrams(str(path), [b"[]"])
        assert sock.recv(100) == b"[]"
        # A live listener is never taken over.
        with pytest.raises(SocketInUseError):
            bind_datagram_socket(path)
    finally:
        sock.close()


def test_bind_refuses_to_remove_a_regular_file(short_dir):
    path = short_dir / "n.sock"
    path.write_text("not a socket")
    with pytest.raises(FileExistsError):
        bind_datagram_socket(path)
    assert path.read_text() == "not a socket"


def test_buffer_is_bounded_and_counts_overflow():
    buf = SampleBuffer(capacity=3, wake_at=2)
    samples = [StepSample.model_validate(step_dict(i)) for i in range(5)]
    assert buf.put_many(samples[:1]) == 1 and not buf.wake.is_set()
    assert buf.put_many(samples[1:]) == 2
    assert buf.wake.is_set()
    assert buf.overflow == 2 and len(buf) == 3
    first = buf.take(2)
    assert [s.step for s in first] == [0, 1] and not buf.wake.is_set()
    buf.put_front(first)
    assert [s.step for s in buf.take(10)] == [0, 1, 2]


def test_rank_tracker_reports_alive_and_dead_then_forgets():
    clock = FakeClock()
    alive = {100: True, 200: True}
    tracker = RankTracker(is_alive=lambda pid: alive[pid], clock=clock, forget_dead_after_s=60)
    tracker.observe(
        [
            StepSample.model_validate(step_dict(0, rank=0, pid=100)),
            StepSample.model_validate(step_dict(0, rank=1, pid=200)),
            CollectiveSample.model_validate(collective_dict(0, rank=2)),  # no pid: not tracked
        ]
    )
    procs = {(p.rank, p.pid): p.alive for p in tracker.processes()}
    assert procs == {(0, 100): True, (1, 200): True}
    alive[200] = False
    clock.advance(30)
    assert {p.rank: p.alive for p in tracker.processes()} == {0: True, 1: False}
    clock.advance(31)  # dead and silent for more than 60 s: forgotten; the live one stays
    assert [(p.rank, p.alive) for p in tracker.processes()] == [(0, True)]


def test_rank_tracker_follows_a_restarted_rank():
    tracker = RankTracker(is_alive=lambda pid: True)
    tracker.observe([StepSample.model_validate(step_dict(0, rank=0, pid=100))])
    tracker.observe([StepSample.model_validate(step_dict(9, rank=0, pid=101))])
    assert [(p.rank, p.pid) for p in tracker.processes()] == [(0, 101)]


def test_a_ranks_former_process_is_reported_once_dead_beside_its_successor_then_forgotten():
    """A live job's replacement on the same node reports the rank at once: the former process's death is
    still reported (dead, with its time), or the controller would never see that the rank died."""
    clock = FakeClock()
    alive = {100: True, 101: True}
    tracker = RankTracker(is_alive=lambda pid: alive[pid], clock=clock, forget_dead_after_s=60,
                          wall_clock=lambda: 1000.0 + clock())
    tracker.observe([StepSample.model_validate(step_dict(5, rank=1, pid=100))])
    tracker.observe([StepSample.model_validate(step_dict(6, rank=1, pid=101))])
    assert [(p.rank, p.pid, p.alive) for p in tracker.processes()] == [(1, 101, True)]  # the former one runs
    alive[100] = False
    clock.advance(2)
    procs = tracker.processes()
    assert [(p.rank, p.pid, p.alive) for p in procs] == [(1, 100, False), (1, 101, True)]
    assert procs[0].dead_since is not None and procs[1].dead_since is None
    assert set(tracker.pids()) == {100, 101}
    clock.advance(61)
    tracker.observe([StepSample.model_validate(step_dict(7, rank=1, pid=101))])
    assert [(p.rank, p.pid, p.alive) for p in tracker.processes()] == [(1, 101, True)]
    assert set(tracker.pids()) == {101}


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux >= 5.3 only")
def test_exit_watcher_orders_deaths_seen_in_one_check():
    """Two real processes die 0.5 s apart; the tracker looks only afterwards, once. The watcher's exit
    times still say which died first (a check-time stamp would give both the same time)."""
    first, second = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    exits = ExitWatcher()
    tracker = RankTracker(exits=exits)
    try:
        tracker.observe([StepSample.model_validate(step_dict(0, rank=r, pid=p.pid))
                         for r, p in ((0, first), (1, second))])
        first.kill()
        first.wait()
        time.sleep(0.5)
        second.kill()
        second.wait()
        time.sleep(0.3)
        checked = time.time()
        dead = {p.rank: p.dead_since for p in tracker.processes() if not p.alive}
        assert set(dead) == {0, 1}
        assert dead[1] - dead[0] == pytest.approx(0.5, abs=0.2)
        assert dead[1] < checked - 0.1
    finally:
        exits.close()
        for p in (first, second):
            p.kill()
            p.wait()


def test_process_alive_on_real_processes():
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)
