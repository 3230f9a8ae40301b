"""A rank cannot point the root agent at a process that is not its own, nor speak for another job.

Before: the agent took a step sample's ``pid`` on the rank's word, and the controller then had the root
agent kill, stop, throttle or py-spy that pid: any process on the host. Now every datagram's sender comes
from the kernel (``SO_PASSCRED``) and samples naming another process, or a second job, are refused and
counted (agent/ranksocket.py, ``Receiver.handle_datagram``). Real sockets, real sender processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from agent.receiver import RankTracker, Receiver, SampleBuffer
from agent.senders import WorkerRoots
from tests.agent.doubles import datagram, send_datagrams, step_dict


@pytest.fixture
def receiver():
    folder = Path(tempfile.mkdtemp(prefix="vgs-", dir="/tmp"))  # short: a unix socket path has 108 bytes
    r = Receiver(folder / "agent.sock", SampleBuffer(capacity=100), ranks=RankTracker())
    r.bind()
    yield r
    r.stop()
    shutil.rmtree(folder, ignore_errors=True)


def drain(r: Receiver) -> None:
    while r.step(timeout=0.5):
        pass


def tracked(r: Receiver) -> set[int]:
    return {p.pid for p in r.ranks.processes()}


def test_a_sample_naming_another_process_is_refused_and_counted(receiver: Receiver) -> None:
    victim = os.getppid()  # any process that is not the sender: here pytest's parent
    send_datagrams(str(receiver.socket_path), [datagram([step_dict(0, job_id="job-a", pid=victim)])])
    drain(receiver)
    assert receiver.stats.forged_samples == 1
    assert len(receiver.buffer) == 0
    assert victim not in tracked(receiver)  # the controller can never be told to act on it

    send_datagrams(str(receiver.socket_path), [datagram([step_dict(1, job_id="job-a", pid=os.getpid())])])
    drain(receiver)
    assert tracked(receiver) == {os.getpid()}  # its own pid: accepted
    assert receiver.stats.forged_samples == 1


def test_a_sender_speaks_for_one_job_only(receiver: Receiver) -> None:
    path = str(receiver.socket_path)
    send_datagrams(path, [datagram([step_dict(0, job_id="job-a", pid=os.getpid())])])
    send_datagrams(path, [datagram([step_dict(0, job_id="job-b", pid=os.getpid()),
                                    step_dict(1, job_id="job-a", pid=os.getpid())])])
    drain(receiver)
    kept = receiver.buffer.take(10)
    assert [(s.job_id, s.step) for s in kept] == [("job-a", 0), ("job-a", 1)]
    assert receiver.stats.forged_samples == 1


SENDER = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
item = {"kind": "step", "job_id": "job-a", "rank": 0, "step": 0, "attempt": 0, "ts": 1.0, "loss": 1.0,
        "step_time_s": 0.1, "pid": int(sys.argv[2])}
s.sendto(json.dumps([item]).encode(), sys.argv[1])
print(__import__("os").getpid())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to start an unprivileged sender")
def test_an_unprivileged_rank_claiming_init_or_the_agent_is_refused(receiver: Receiver) -> None:
    receiver.socket_path.chmod(0o666)
    receiver.socket_path.parent.chmod(0o755)
    for claimed in (1, os.getpid()):  # init; the agent's own process
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                              SENDER, str(receiver.socket_path), str(claimed)],
                             capture_output=True, text=True, check=True, timeout=60)
        sender = int(out.stdout)
        drain(receiver)
        assert sender != claimed
    assert receiver.stats.forged_samples == 2
    assert tracked(receiver) == set()


# A stand-in node: "raylet" -> "worker" (started with VIGIL_JOB_ID, as Ray starts a job's workers) -> a
# process the worker spawned. Each prints its pid and sleeps; the agent sees the same tree as on a node.
TREE = """
import os, subprocess, sys, time
depth = int(sys.argv[1])
if depth < 2:
    env = dict(os.environ)
    if depth == 0:
        env["VIGIL_JOB_ID"] = "job-a"  # the raylet starts the worker for job-a
    else:
        env.pop("VIGIL_JOB_ID", None)  # a spawned helper may drop or change its environment
        env["VIGIL_JOB_ID"] = "job-b"
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth + 1), sys.argv[2]], env=env)
print(os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.fixture
def node_tree():
    env = {k: v for k, v in os.environ.items() if k != "VIGIL_JOB_ID"}
    raylet = subprocess.Popen([sys.executable, "-c", TREE, "0", TREE], stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    pids = [int(raylet.stdout.readline()) for _ in range(3)]  # any order: sort by parentage below
    by_parent = {psutil.Process(p).ppid(): p for p in pids}
    worker = by_parent[raylet.pid]
    helper = by_parent[worker]
    yield raylet.pid, worker, helper
    os.killpg(raylet.pid, 9)
    raylet.wait(10)


@pytest.mark.skipif(os.geteuid() != 0, reason="sends with other processes' credentials (root only)")
def test_a_process_spawned_by_a_rank_cannot_speak_for_another_job(node_tree) -> None:
    raylet, worker, helper = node_tree
    folder = Path(tempfile.mkdtemp(prefix="vgs-", dir="/tmp"))
    r = Receiver(folder / "agent.sock", SampleBuffer(capacity=100), ranks=RankTracker(),
                 roots=WorkerRoots(lambda: raylet))
    r.bind()
    try:
        path = str(r.socket_path)
        # The helper speaks first, for job-b (its own environment says job-b): refused, the worker is job-a's.
        send_datagrams(path, [datagram([step_dict(0, job_id="job-b", pid=helper)])], as_pid=helper)
        drain(r)
        assert r.stats.forged_samples == 1 and len(r.buffer) == 0
        # The same helper for job-a, and the worker itself: accepted (torchrun's ranks are such helpers).
        send_datagrams(path, [datagram([step_dict(1, job_id="job-a", pid=helper)])], as_pid=helper)
        send_datagrams(path, [datagram([step_dict(2, job_id="job-a", pid=worker)])], as_pid=worker)
        drain(r)
        assert [(s.job_id, s.pid) for s in r.buffer.take(10)] == [("job-a", helper), ("job-a", worker)]
        # A process under no worker of this raylet (here: pytest itself, or the raylet) is refused.
        for outsider in (os.getpid(), raylet):
            send_datagrams(path, [datagram([step_dict(3, job_id="job-a", pid=outsider)])], as_pid=outsider)
        drain(r)
        assert r.stats.forged_samples == 3 and len(r.buffer) == 0
    finally:
        r.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_without_a_known_raylet_each_sender_stands_for_itself(receiver: Receiver) -> None:
    receiver.jobs.roots = WorkerRoots(lambda: None)
    send_datagrams(str(receiver.socket_path), [datagram([step_dict(0, job_id="job-a", pid=os.getpid())])])
    drain(receiver)
    assert len(receiver.buffer) == 1 and receiver.stats.forged_samples == 0
