"""The agent's node commands (stop / start the raylet, kill_node) on *stand-ins*: small python scripts
named ``raylet`` and ``ray`` (so their process name and command line look like the real ones to the
agent's discovery), that start a "worker" child and block. The real ``ray start`` / raylet path is
covered by the controller's end-to-end fault tests. The kill_node wiring test fetches its command
from the REAL controller (fixture ``live_controller``, loopback networking).

Needs: Linux, psutil.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from agent.commands import CommandExecutor, ExecutorConfig
from agent.main import AgentConfig, run_agent
from agent.receiver import process_alive
from tests.agent.doubles import datagram, gone, send_datagrams, socket_ready, step_dict, wait_for
from vigil.contract.schemas import CommandKind

# --------------------------------------------------------------------------------------------------
# raylet stand-ins: stop / start / kill_node
# --------------------------------------------------------------------------------------------------


STANDIN_RAYLET = '''#!{python}
"""STAND-IN raylet for tests: named `raylet`, starts one "worker", then blocks."""
import os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(here, "worker-%d.pid" % os.getpid()), "w") as f:
    f.write(str(worker.pid))
time.sleep(600)
'''

STANDIN_RAY_START = '''#!{python}
"""STAND-IN for `ray start --block --node-name=NAME` (tests): starts a stand-in raylet and waits on
it; with --daemon also leaves a process in its session that is not its descendant (like the ones
Ray daemonizes)."""
import os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
name = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--node-name=")][0]
if "--daemon" in sys.argv:
    code = "import os, sys, time\\nif os.fork(): os._exit(0)\\nopen(sys.argv[1], 'w').write(str(os.getpid()))\\ntime.sleep(600)"
    subprocess.run([sys.executable, "-c", code, os.path.join(here, "daemon.pid")])
raylet = subprocess.Popen([os.path.join(here, "raylet"), "--node-name=" + name, "--node_id=ffff"])
sys.exit(raylet.wait())
'''


@pytest.fixture
def standin_bin(tmp_path: Path) -> Path:
    d = tmp_path / "standin-bin"
    d.mkdir()
    for name, text in (("raylet", STANDIN_RAYLET), ("ray", STANDIN_RAY_START)):
        (d / name).write_text(text.replace("{python}", sys.executable))
        (d / name).chmod(0o755)
    return d


def node_executor(tmp_path: Path, node: str, **kw: object) -> CommandExecutor:
    return CommandExecutor(
        ExecutorConfig(
            node_id=node,
            run_dir=tmp_path / "run",
            storage_root=tmp_path,
            raylet_stop_grace_s=2.0,
            raylet_start_wait_s=20.0,
            **kw,  # type: ignore[arg-type]
        )
    )


def worker_pids(bin_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in bin_dir.glob("worker-*.pid") if p.read_text()]


def test_start_and_stop_raylet_with_a_stand_in_join_command(tmp_path, standin_bin):
    node = f"standin-{os.getpid()}-a"
    join = [str(standin_bin / "ray"), "start", "--block", f"--node-name={node}"]
    ex = node_executor(tmp_path, node, ray_join_cmd=join)
    try:
        r = ex.run(CommandKind.START_RAYLET, {})
        assert r.ok and r.output["raylet_pid"], r
        raylet, start = r.output["raylet_pid"], r.output["pid"]
        assert psutil.Process(raylet).name() == "raylet"
        assert os.getsid(start) == os.getsid(0)  # in the agent's own session
        wait_for(lambda: worker_pids(standin_bin), timeout=10, what="stand-in worker")
        worker = worker_pids(standin_bin)[0]
        # A pid under this node's raylet may be acted on although no rank reported it.
        assert ex.run(CommandKind.STOP_PID, {"pid": worker}).ok
        assert ex.run(CommandKind.CONT_PID, {"pid": worker}).ok
        again = ex.run(CommandKind.START_RAYLET, {})
        assert again.ok and "already running" in again.message
        r = ex.run(CommandKind.STOP_RAYLET, {})
        assert r.ok and r.output["left"] == [], r
        for pid in (raylet, start, worker):
            assert gone(pid), pid
        assert process_alive(os.getpid())  # the agent keeps running
        redo = ex.run(CommandKind.STOP_RAYLET, {})
        assert redo.ok and "no raylet" in redo.message
        # Readmission: the same join command again.
        r = ex.run(CommandKind.START_RAYLET, {})
        assert r.ok and r.output["raylet_pid"] not in (None, raylet)
    finally:
        ex.run(CommandKind.STOP_RAYLET, {})
        ex.close()


def test_a_join_command_that_fails_is_reported(tmp_path):
    ex = node_executor(
        tmp_path, "standin-fail", ray_join_cmd=[sys.executable, "-c", "raise SystemExit('no GCS')"]
    )
    r = ex.run(CommandKind.START_RAYLET, {})
    assert not r.ok and "exited with 1" in r.message and "no GCS" in r.message


def test_kill_node_kills_raylet_workers_ray_start_and_its_session(tmp_path, standin_bin):
    node = f"standin-{os.getpid()}-b"
    # As `vigil up` runs it: `ray start --block` in a session of its own.
    start = subprocess.Popen(
        [str(standin_bin / "ray"), "start", "--block", f"--node-name={node}", "--daemon"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: (standin_bin / "daemon.pid").exists() and worker_pids(standin_bin),
            timeout=20,
            what="stand-in node up",
        )
        daemon = int((standin_bin / "daemon.pid").read_text())
        worker = worker_pids(standin_bin)[0]
        assert daemon not in {c.pid for c in psutil.Process(start.pid).children(recursive=True)}
        ex = node_executor(tmp_path, node, ray_start_pid=start.pid)
        r = ex.run(CommandKind.KILL_NODE, {})
        assert r.ok, r
        assert start.wait(10) == -signal.SIGKILL
        for pid in (r.output["raylet_pid"], worker, daemon):
            wait_for(lambda pid=pid: gone(pid), timeout=10, what=f"pid {pid} gone")
        assert r.output["session"] == start.pid
        assert process_alive(os.getpid())
        # An agent not under the node's raylet kills none of its own ancestors afterwards (only a Ray-deployed
        # agent, under the raylet it killed, has node processes above it).
        assert r.output["after_answer"] == [] and ex.kill_own_ancestors() == []
        assert process_alive(os.getppid())
        again = ex.run(CommandKind.KILL_NODE, {})
        assert not again.ok and "no raylet" in again.message  # nothing left to kill
    finally:
        with contextlib.suppress(OSError):
            os.killpg(start.pid, signal.SIGKILL)  # whatever a failed test left in the session
        start.wait(10)


def test_kill_node_through_the_agent_stops_it_without_a_last_heartbeat(short_dir, standin_bin, live_controller):
    """The wiring, with the real controller: faults injected through its API become commands that
    the agent's command thread fetches and carries out: a fault file first, then kill_node: the
    agent kills the node, answers, and stops: run_agent returns True and nothing more is sent."""
    live = live_controller
    node = f"standin-{os.getpid()}-c"
    start = subprocess.Popen(
        [str(standin_bin / "ray"), "start", "--block", f"--node-name={node}"], start_new_session=True
    )
    job = live.submit_job("kill-node", steps=10).id
    cfg = AgentConfig(
        node_id=node, run_dir=short_dir, controller_url=live.url, token=live.token("agent"),
        flush_interval_s=0.05, heartbeat_interval_s=0.1, storage_root=short_dir,
    )  # fmt: skip
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(run_agent(cfg, threading.Event())), daemon=True)
    try:
        wait_for(lambda: worker_pids(standin_bin), timeout=20, what="stand-in node up")
        thread.start()
        wait_for(lambda: socket_ready(cfg.socket_path), timeout=10, what="agent socket")
        # Rank 0 (the stand-in raylet's worker: the agent takes samples only from processes of this
        # node's Ray workers) reports step 0: the controller learns where it runs and that it reached step 0.
        worker = worker_pids(standin_bin)[0]
        send_datagrams(str(cfg.socket_path), [datagram([step_dict(0, job_id=job, rank=0, pid=worker)])],
                       as_pid=worker)

        def rank_on_node() -> bool:
            with live.client("viewer") as c:
                nodes = {n.id: n for n in c.list_nodes().data}
                return node in nodes and bool(nodes[node].ranks) and c.get_job(job).last_step == 0

        wait_for(rank_on_node, timeout=10, what="the rank in a heartbeat")
        (fault_file,) = live.fire(job, "nan_loss", rank=0)
        wait_for(lambda: live.command_rows()[fault_file.id].status != "PENDING", timeout=10,
                 what="first command answered")
        assert live.command_rows()[fault_file.id].status == "DONE"
        assert (short_dir / "faults" / job / "rank-0.json").exists()
        (kill,) = live.fire(job, "kill_node", node_id=node)
        thread.join(20)
        assert not thread.is_alive() and outcome == [True]
        assert live.command_rows()[kill.id].status == "DONE"
        assert live.answered() == [fault_file.id, kill.id]
        assert start.wait(10) == -signal.SIGKILL
        sent = live.batches_seen(cfg.agent_id)
        time.sleep(0.5)
        assert live.batches_seen(cfg.agent_id) == sent  # a lost node sends nothing more
    finally:
        with contextlib.suppress(OSError):
            os.killpg(start.pid, signal.SIGKILL)
        start.wait(10)
