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

import pytest

from agent.receiver import RankTracker, Receiver, SampleBuffer
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
