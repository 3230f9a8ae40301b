"""The root agent signals only processes of its node's Ray workers (agent/commands/executor.py ``_target``).

Before: a pid a rank had reported was a target whatever process it named. Now the sender is the kernel's
(test_agent_sender.py), and where the node's raylet is known, a target must run as the raylet's user: with
ranks unprivileged (controller/rankuser.py), no root process is ever signalled, stopped, throttled or py-spied.
Real processes: a stand-in raylet (a process named ``raylet`` naming the node) running as ``nobody``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from agent.commands import CommandExecutor, ExecutorConfig
from vigil.contract.schemas import CommandKind

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root to run a stand-in raylet as another user")


@pytest.fixture
def node() -> str:
    return f"standin-{os.getpid()}-uid"


@pytest.fixture
def raylet(node: str):
    folder = Path(tempfile.mkdtemp(prefix="vgr-", dir="/tmp"))
    folder.chmod(0o755)
    (folder / "raylet").symlink_to("/bin/sh")  # its name (comm) is "raylet"
    p = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                          str(folder / "raylet"), "-c", "sleep 600; :", f"--node-name={node}"])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(p.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield psutil.Process(p.pid)
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_root_process_is_never_a_target_while_ranks_run_as_another_user(tmp_path: Path, node: str,
                                                                           raylet: psutil.Process) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    seen = {victim.pid: time.time()}  # as if a (root) sender had claimed it
    ex = CommandExecutor(ExecutorConfig(node_id=node, run_dir=tmp_path / "run", storage_root=tmp_path),
                         rank_pids=lambda: seen)
    try:
        for kind in (CommandKind.KILL_PID, CommandKind.STOP_PID, CommandKind.THROTTLE_PID):
            r = ex.run(kind, {"pid": victim.pid})
            assert not r.ok and "runs as uid 0" in r.message, (kind, r)
        assert victim.poll() is None and psutil.Process(victim.pid).status() != psutil.STATUS_STOPPED
        (worker,) = raylet.children()  # a Ray worker of the node: its user, under its raylet
        r = ex.run(CommandKind.STOP_PID, {"pid": worker.pid})
        assert r.ok, r
        assert ex.run(CommandKind.KILL_PID, {"pid": worker.pid}).ok
    finally:
        ex.close()
        victim.kill()
        victim.wait(10)


def test_a_fault_file_is_the_unprivileged_ranks_to_mark_fired() -> None:
    """Ranks run as another user: the job's fault folder is their group's (they rename a file to ``.fired``
    before acting on it); the run folder above stays the agent's."""
    run = Path(tempfile.mkdtemp(prefix="vgf-", dir="/tmp"))
    run.chmod(0o755)
    try:
        ex = CommandExecutor(ExecutorConfig(node_id="n", run_dir=run, storage_root=run, rank_group=65534))
        try:
            r = ex.run(CommandKind.WRITE_FAULT_FILE, {"job_id": "job-1", "rank": 0, "fault": {"kind": "nan_loss",
                                                                                             "step": 3}})
        finally:
            ex.close()
        path = Path(r.output["path"])
        mark = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "mv", str(path),
                               f"{path}.fired"], capture_output=True, text=True, check=False)
        assert mark.returncode == 0, mark.stderr
        assert (run.stat().st_uid, run.stat().st_mode & 0o777) == (0, 0o755)
        planted = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "touch",
                                  str(run / "x")], capture_output=True, text=True, check=False)
        assert planted.returncode != 0  # nothing of its own beside the agent's socket
    finally:
        shutil.rmtree(run, ignore_errors=True)
