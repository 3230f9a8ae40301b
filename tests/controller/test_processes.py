"""``vigil up``'s child processes (ops/processes.py): a stop gives Vigil's own processes their grace, a Ray node
(``ray start --block``, which takes 16 s or more to stop its processes one by one) only RAY_GRACE_S, and nothing
of either is left behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from ops.processes import RAY_GRACE_S, ProcessGroup

DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
"""A child that ignores SIGTERM (as a Ray node does for many seconds)."""


def _start_deaf(procs: ProcessGroup, name: str, tmp_path: Path) -> psutil.Process:
    child = procs.start(name, [sys.executable, "-c", DEAF], {}, tmp_path / "logs")
    deadline = time.monotonic() + 30
    while "up" not in child.log_path.read_text() and time.monotonic() < deadline:  # its handler is set
        time.sleep(0.05)
    return psutil.Process(child.proc.pid)


def test_a_ray_node_deaf_to_sigterm_is_killed_after_its_own_short_grace(tmp_path: Path) -> None:
    procs = ProcessGroup(tmp_path / "pids.json")
    node = _start_deaf(procs, "ray-node-1", tmp_path)
    t0 = time.monotonic()
    procs.stop_all(grace_s=30)
    took = time.monotonic() - t0
    assert not node.is_running() and procs.children == []
    assert RAY_GRACE_S <= took < 30  # not the whole grace of Vigil's own processes


def test_vigils_own_process_gets_the_whole_grace_before_it_is_killed(tmp_path: Path) -> None:
    procs = ProcessGroup(tmp_path / "pids.json")
    agent = _start_deaf(procs, "agent-0", tmp_path)
    node = _start_deaf(procs, "ray-node-1", tmp_path)
    grace = RAY_GRACE_S + 2
    t0 = time.monotonic()
    procs.stop_all(grace_s=grace)
    assert time.monotonic() - t0 >= grace  # waited for the agent, the Ray node's short grace notwithstanding
    assert not agent.is_running() and not node.is_running()
    assert not (tmp_path / "pids.json").exists()
