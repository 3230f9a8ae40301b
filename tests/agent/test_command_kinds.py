"""What each agent command does, on real throwaway processes and real files.

Needs: Linux, psutil, and ``py-spy`` next to the test interpreter (installed with the agent
dependencies) with ptrace rights (root, or CAP_SYS_PTRACE); the py-spy tests are skipped without
the binary. The two tests of the agent's wiring fetch their commands from the REAL controller
(fixture ``live_controller``, :mod:`tests.live_controller`; loopback networking), which queues them
when a fault injected through its API fires. The raylet tests use *stand-ins*: small python scripts named ``raylet`` and ``ray``
(so their process name and command line look like the real ones to the agent's discovery), that
start a "worker" child and block. The real ``ray start`` / raylet path is covered by the
controller's end-to-end fault tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agent.commands import CORRUPTION, CommandExecutor, ExecutorConfig, live_process
from agent.main import Agent, AgentConfig
from agent.receiver import RankTracker
from tests.agent.doubles import state, step_dict, wait_for
from tests.live_controller import step_sample
from vigil.contract.schemas import CommandKind, StepSample, slugify

BUSY = "import time\nwhile True:\n    pass\n"
SLEEPY = textwrap.dedent(
    """
    import time

    def vigil_test_target_function():
        while True:
            time.sleep(0.01)

    vigil_test_target_function()
    """
)


class Procs:
    """Throwaway processes, killed (and reaped) at the end of the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, code: str = "import time; time.sleep(600)", **kw: object) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, **kw)  # type: ignore[call-overload]
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait(10)


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        ps.close()


class Ranks(dict[int, float]):
    """The receiver's rank table as the executor sees it: pid -> time of the rank's last sample."""

    def add(self, pid: int) -> None:
        self[pid] = time.time()


@pytest.fixture
def ranks() -> Ranks:
    return Ranks()


@pytest.fixture
def executor(tmp_path: Path, ranks: Ranks) -> Iterator[CommandExecutor]:
    storage = tmp_path / "storage"
    storage.mkdir()
    ex = CommandExecutor(
        ExecutorConfig(node_id="standin-node", run_dir=tmp_path / "run", storage_root=storage),
        rank_pids=lambda: ranks,
    )
    try:
        yield ex
    finally:
        ex.close()


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


# --------------------------------------------------------------------------------------------------
# kill / stop / cont and the pid rule
# --------------------------------------------------------------------------------------------------


def test_kill_pid_kills_a_rank_and_a_redo_is_harmless(executor, procs, ranks):
    p = procs.spawn()
    ranks.add(p.pid)
    r = executor.run(CommandKind.KILL_PID, {"pid": p.pid})
    assert r.ok and r.output["signal"] == "SIGKILL", r
    assert p.wait(5) == -signal.SIGKILL
    again = executor.run(CommandKind.KILL_PID, {"pid": p.pid})
    assert again.ok and "already gone" in again.message


def test_kill_pid_sends_the_signal_asked_for(executor, procs, ranks):
    p = procs.spawn()
    ranks.add(p.pid)
    assert executor.run(CommandKind.KILL_PID, {"pid": p.pid, "signal": "TERM"}).ok
    assert p.wait(5) == -signal.SIGTERM


def test_a_pid_that_is_not_a_rank_of_this_node_is_refused(executor, procs, ranks):
    p = procs.spawn()
    for kind in (CommandKind.KILL_PID, CommandKind.STOP_PID, CommandKind.THROTTLE_PID):
        r = executor.run(kind, {"pid": p.pid})
        assert not r.ok and "refused" in r.message, (kind, r)
    assert p.poll() is None and state(p.pid) != psutil.STATUS_STOPPED
    # The agent itself and its parent are never targets, even if a rank claimed their pid.
    for pid in (os.getpid(), os.getppid()):
        ranks.add(pid)
        r = executor.run(CommandKind.KILL_PID, {"pid": pid})
        assert not r.ok and "refused" in r.message


def test_a_reused_pid_is_refused(executor, procs, ranks):
    """The rank table says pid P sent its last sample before P's current process started: P now
    names another process."""
    p = procs.spawn()
    ranks[p.pid] = psutil.Process(p.pid).create_time() - 30
    r = executor.run(CommandKind.KILL_PID, {"pid": p.pid})
    assert not r.ok and "reused" in r.message and p.poll() is None


def test_stop_then_cont(executor, procs, ranks):
    p = procs.spawn(SLEEPY)
    ranks.add(p.pid)
    r = executor.run(CommandKind.STOP_PID, {"pid": p.pid})
    assert r.ok and state(p.pid) == psutil.STATUS_STOPPED, r
    assert executor.run(CommandKind.STOP_PID, {"pid": p.pid}).ok  # redo: still stopped
    r = executor.run(CommandKind.CONT_PID, {"pid": p.pid})
    assert r.ok and state(p.pid) in (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING), r
    assert p.poll() is None


# --------------------------------------------------------------------------------------------------
# throttle
# --------------------------------------------------------------------------------------------------


@pytest.mark.timing
def test_throttle_runs_the_process_one_factor_th_of_the_time(executor, procs, ranks):
    p = procs.spawn(BUSY)
    ranks.add(p.pid)
    time.sleep(0.3)

    def measure(seconds: float) -> tuple[float, float]:
        """(CPU seconds per wall second, fraction of the time the process was stopped)."""
        c0, t0 = cpu_s(p.pid), time.monotonic()
        samples = stopped = 0
        while time.monotonic() - t0 < seconds:
            samples += 1
            stopped += state(p.pid) == psutil.STATUS_STOPPED
            time.sleep(0.003)
        return (cpu_s(p.pid) - c0) / (time.monotonic() - t0), stopped / samples

    free, _ = measure(1.0)  # what a busy loop gets on this (shared) machine
    factor = 4.0
    r = executor.run(CommandKind.THROTTLE_PID, {"pid": p.pid, "factor": factor, "period_s": 0.1})
    assert r.ok, r
    share, stopped = measure(2.0)
    # CPU time: at most about 1/factor of the wall time (less when the machine is busy, since a
    # continued process waits for a core) ...
    assert share <= 1.6 / factor + 0.03, (free, share)
    assert share < 0.7 * free
    # ... and the duty cycle: stopped about 1 - 1/factor of the time (the throttling thread itself
    # can be late on a loaded host, which only ever lengthens the stopped part).
    assert 1 - 1 / factor - 0.1 <= stopped <= 1 - 1 / factor + 0.2, stopped
    assert executor.throttled() == {p.pid: (factor, 0.1)}
    r = executor.run(CommandKind.UNTHROTTLE_PID, {"pid": p.pid})
    assert r.ok and r.output["was_throttled"]
    assert executor.throttled() == {}
    _share_after, stopped_after = measure(1.0)
    assert stopped_after == 0  # running freely again


def test_throttles_end_with_the_agent_and_leave_the_process_running(tmp_path, procs, ranks):
    p = procs.spawn(BUSY)
    ranks.add(p.pid)
    ex = CommandExecutor(
        ExecutorConfig(node_id="n", run_dir=tmp_path, storage_root=tmp_path), rank_pids=lambda: ranks
    )
    assert ex.run(CommandKind.THROTTLE_PID, {"pid": p.pid, "factor": 10, "period_s": 0.2}).ok
    time.sleep(0.5)
    ex.close()
    time.sleep(0.2)
    c0 = cpu_s(p.pid)
    deadline = time.monotonic() + 10  # on a loaded host the running process may wait for a core
    while cpu_s(p.pid) - c0 <= 0.1 and time.monotonic() < deadline:
        assert state(p.pid) != psutil.STATUS_STOPPED
        time.sleep(0.1)
    assert state(p.pid) != psutil.STATUS_STOPPED and cpu_s(p.pid) - c0 > 0.1


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


def test_fault_file_is_written_where_the_rank_looks(executor, tmp_path):
    fault = {"kind": "nan_loss", "step": 12}
    r = executor.run(CommandKind.WRITE_FAULT_FILE, {"job_id": "job_0123abcd", "rank": 3, "fault": fault})
    path = tmp_path / "run" / "faults" / "job_0123abcd" / "rank-3.json"
    assert r.ok and r.output["path"] == str(path)
    assert json.loads(path.read_text()) == fault
    assert sorted(os.listdir(path.parent)) == ["rank-3.json"]  # no temporary left behind
    # A job id is never used as a path as it is.
    r = executor.run(CommandKind.WRITE_FAULT_FILE, {"job_id": "../../etc", "rank": "1", "fault": {}})
    assert (
        r.ok and Path(r.output["path"]) == tmp_path / "run" / "faults" / slugify("../../etc") / "rank-1.json"
    )
    assert Path(r.output["path"]).resolve().is_relative_to((tmp_path / "run").resolve())


@pytest.mark.parametrize("job_id", ["job_0123abcd", "../../etc", "a b/c"])
def test_the_agent_writes_the_fault_file_where_the_trainer_reads_it(executor, tmp_path, job_id):
    from vigil.contract.settings import fault_file_path

    r = executor.run(CommandKind.WRITE_FAULT_FILE, {"job_id": job_id, "rank": 7, "fault": {}})
    assert r.ok and Path(r.output["path"]) == fault_file_path(tmp_path / "run", job_id, 7)


def test_a_fault_the_rank_already_took_is_not_written_again(executor, tmp_path):
    """A redo (the answer was lost, the agent restarted) must not fire a one-shot fault twice: the
    rank renames the file to ``.fired`` when it takes it."""
    args = {"job_id": "job_1", "rank": 0, "fault": {"kind": "nan_loss", "step": 5, "fault_id": 9}}
    assert executor.run(CommandKind.WRITE_FAULT_FILE, args).ok
    path = tmp_path / "run" / "faults" / "job_1" / "rank-0.json"
    path.rename(path.with_name("rank-0.json.fired"))  # what the rank does when it fires
    r = executor.run(CommandKind.WRITE_FAULT_FILE, args)
    assert r.ok and r.output["fired"] and not path.exists()
    other = {**args, "fault": {"kind": "nan_loss", "step": 50, "fault_id": 10}}  # a new fault is written
    assert executor.run(CommandKind.WRITE_FAULT_FILE, other).ok and path.exists()


def test_the_adapt_file_holds_every_version_and_is_rewritten_whole(executor, tmp_path):
    """recovery.policy adapt: the rank's adapt file beside its fault file, replaced whole with each new list of
    versions (never a one-shot: the same body again is simply written again); an unknown file kind is refused."""
    from vigil.contract.settings import adapt_file_path

    v1 = {"versions": [{"version": 1, "params": {"tau": 16}}]}
    args = {"job_id": "job_1", "rank": 2, "file": "adapt", "fault": v1}
    r = executor.run(CommandKind.WRITE_FAULT_FILE, args)
    path = adapt_file_path(tmp_path / "run", "job_1", 2)
    assert r.ok and Path(r.output["path"]) == path and json.loads(path.read_text()) == v1
    v2 = {"versions": [*v1["versions"], {"version": 2, "params": {}}]}
    assert executor.run(CommandKind.WRITE_FAULT_FILE, {**args, "fault": v2}).ok
    assert json.loads(path.read_text()) == v2 and not (path.parent / "rank-2.json").exists()
    assert executor.run(CommandKind.WRITE_FAULT_FILE, {**args, "fault": v2}).ok
    bad = executor.run(CommandKind.WRITE_FAULT_FILE, {**args, "file": "../x"})
    assert not bad.ok and "file" in bad.message and json.loads(path.read_text()) == v2


def make_checkpoint(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    files = {
        "manifest.json": json.dumps({"files": ["__0_0.distcp", "__1_0.distcp"]}).encode(),
        "__0_0.distcp": os.urandom(4096),
        "__1_0.distcp": os.urandom(1000),
        "sub/extra.bin": os.urandom(300),
    }
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def test_corrupt_files_changes_the_middle_of_data_files_only(executor, tmp_path):
    ckpt = tmp_path / "storage" / "vigil-job" / "checkpoint_000003"
    before = make_checkpoint(ckpt)
    r = executor.run(CommandKind.CORRUPT_FILES, {"path": str(ckpt)})
    assert r.ok, r
    assert sorted(Path(f).name for f in r.output["files"]) == ["__0_0.distcp", "__1_0.distcp", "extra.bin"]
    assert (ckpt / "manifest.json").read_bytes() == before["manifest.json"]
    for name in ("__0_0.distcp", "__1_0.distcp", "sub/extra.bin"):
        after = (ckpt / name).read_bytes()
        old = before[name]
        assert len(after) == len(old) and after != old
        diff = [i for i in range(len(old)) if after[i] != old[i]]
        assert len(old) // 4 < diff[0] and diff[-1] < 3 * len(old) // 4  # the middle
        assert after[: diff[0]] == old[: diff[0]] and CORRUPTION[:8] in after
    snapshot = {n: (ckpt / n).read_bytes() for n in before}
    # A redo finds the bytes already corrupted and leaves them (an XOR would have repaired them).
    again = executor.run(CommandKind.CORRUPT_FILES, {"path": "vigil-job/checkpoint_000003"})  # relative
    assert again.ok and again.output["files"] == [] and len(again.output["already_corrupted"]) == 3
    assert {n: (ckpt / n).read_bytes() for n in before} == snapshot


def test_corrupt_newest_complete_checkpoint_under_a_folder(executor, tmp_path):
    root = tmp_path / "storage" / "job_x" / "checkpoints"
    old, newest = make_checkpoint(root / "step-00000020"), make_checkpoint(root / "step-00000100")
    partial = root / "step-00000110"  # being written: no manifest yet
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 400)
    r = executor.run(CommandKind.CORRUPT_FILES, {"path": str(root), "newest_under": True})
    assert r.ok, r
    assert r.output["path"] == str((root / "step-00000100").resolve())
    assert (root / "step-00000100" / "__0_0.distcp").read_bytes() != newest["__0_0.distcp"]
    assert (root / "step-00000020" / "__0_0.distcp").read_bytes() == old["__0_0.distcp"]
    assert (partial / "__0_0.distcp").read_bytes() == b"x" * 400
    empty = tmp_path / "storage" / "job_y"
    empty.mkdir()
    r = executor.run(CommandKind.CORRUPT_FILES, {"path": str(empty), "newest_under": True})
    assert not r.ok and "no complete checkpoint" in r.message


def test_corrupt_files_refuses_paths_outside_the_storage_root(executor, tmp_path):
    outside = tmp_path / "outside"
    original = make_checkpoint(outside)
    storage = tmp_path / "storage"
    (storage / "job").mkdir()
    (storage / "job" / "escape").symlink_to(outside, target_is_directory=True)
    cases = [
        str(outside),  # plainly outside
        "/etc",
        "../outside",  # relative, climbing out
        str(storage / "job" / ".." / ".." / "outside"),
        str(storage / "job" / "escape"),  # a symlink inside that points out
        str(storage),  # the root itself is not a checkpoint
    ]
    for path in cases:
        r = executor.run(CommandKind.CORRUPT_FILES, {"path": path})
        assert not r.ok and "refused" in r.message, (path, r)
    assert not executor.run(CommandKind.CORRUPT_FILES, {"path": str(storage / "nope")}).ok
    # A checkpoint folder holding a symlink to a file outside: the symlink is never followed.
    ckpt = storage / "job" / "checkpoint_1"
    make_checkpoint(ckpt)
    (ckpt / "linked.distcp").symlink_to(outside / "__0_0.distcp")
    r = executor.run(CommandKind.CORRUPT_FILES, {"path": str(ckpt)})
    assert r.ok and str(ckpt / "linked.distcp") in r.output["skipped"]
    assert {n: (outside / n).read_bytes() for n in original} == original  # nothing outside changed


# --------------------------------------------------------------------------------------------------
# py-spy
# --------------------------------------------------------------------------------------------------

needs_pyspy = pytest.mark.skipif(
    not (Path(sys.executable).parent / "py-spy").exists(), reason="py-spy is not installed next to python"
)


@needs_pyspy
def test_pyspy_dump_of_a_running_and_of_a_stopped_process(executor, procs, ranks):
    a, b = procs.spawn(SLEEPY), procs.spawn(SLEEPY)
    ranks.add(a.pid)
    ranks.add(b.pid)
    time.sleep(0.5)  # let the interpreter reach the function
    os.kill(b.pid, signal.SIGSTOP)  # a hung rank
    wait_for(lambda: state(b.pid) == psutil.STATUS_STOPPED, timeout=5, what="stopped")
    r = executor.run(CommandKind.PYSPY_DUMP, {"job_id": "j", "pids": {"0": a.pid, "1": b.pid}})
    assert r.ok and r.output["errors"] == {}, r
    assert set(r.output["stacks"]) == {"0", "1"}
    for rank in ("0", "1"):
        assert "vigil_test_target_function" in r.output["stacks"][rank]
    assert (
        r.output["states"] == {"0": psutil.STATUS_SLEEPING, "1": psutil.STATUS_STOPPED}
        or r.output["states"]["1"] == psutil.STATUS_STOPPED
    )
    assert state(b.pid) == psutil.STATUS_STOPPED  # the dump did not let the hung rank run on


@needs_pyspy
def test_pyspy_dump_reports_refused_and_missing_pids_per_rank(executor, procs, ranks):
    a, stranger = procs.spawn(SLEEPY), procs.spawn()
    ranks.add(a.pid)
    time.sleep(0.5)
    r = executor.run(CommandKind.PYSPY_DUMP, {"job_id": "j", "pids": {0: a.pid, 1: stranger.pid}})
    assert r.ok and set(r.output["stacks"]) == {"0"} and "refused" in r.output["errors"]["1"]


def test_pyspy_missing_is_reported_as_data(tmp_path, procs, ranks):
    p = procs.spawn()
    ranks.add(p.pid)
    ex = CommandExecutor(
        ExecutorConfig(
            node_id="n", run_dir=tmp_path, storage_root=tmp_path, pyspy_path=str(tmp_path / "nope")
        ),
        rank_pids=lambda: ranks,
    )
    r = ex.run(CommandKind.PYSPY_DUMP, {"job_id": "j", "pids": {"0": p.pid}})
    assert not r.ok and r.output["available"] is False and "not found" in r.output["reason"]


def test_pyspy_without_ptrace_rights_is_reported_as_data(tmp_path, procs, ranks):
    """A *stand-in* py-spy that fails the way the real one does without ptrace rights (we run as
    root here, so the real refusal cannot be provoked)."""
    fake = tmp_path / "py-spy"
    fake.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "print('Error: Failed to suspend process\\n\\nCaused by:\\n    Operation not permitted (os error 1)',"
        " file=sys.stderr)\nsys.exit(1)\n"
    )
    fake.chmod(0o755)
    p = procs.spawn()
    ranks.add(p.pid)
    ex = CommandExecutor(
        ExecutorConfig(node_id="n", run_dir=tmp_path, storage_root=tmp_path, pyspy_path=str(fake)),
        rank_pids=lambda: ranks,
    )
    r = ex.run(CommandKind.PYSPY_DUMP, {"job_id": "j", "pids": {"0": p.pid}})
    assert not r.ok and "Operation not permitted" in r.output["errors"]["0"] and "ptrace" in r.message


# --------------------------------------------------------------------------------------------------
# the heartbeat's view of rank processes
# --------------------------------------------------------------------------------------------------


def test_rank_alive_in_heartbeats_stopped_is_alive_zombie_and_missing_are_not(procs):
    stopped, zombie, missing = procs.spawn(), procs.spawn(), procs.spawn()
    tracker = RankTracker()
    tracker.observe(
        [
            StepSample.model_validate(step_dict(0, rank=r, pid=p.pid))
            for r, p in enumerate((stopped, zombie, missing))
        ]
    )
    os.kill(stopped.pid, signal.SIGSTOP)
    os.kill(zombie.pid, signal.SIGKILL)  # not reaped: a zombie
    wait_for(lambda: state(zombie.pid) == psutil.STATUS_ZOMBIE, timeout=5, what="zombie")
    missing.kill()
    missing.wait()  # reaped: the pid is gone
    wait_for(lambda: state(stopped.pid) == psutil.STATUS_STOPPED, timeout=5, what="stopped")
    assert {p.rank: p.alive for p in tracker.processes()} == {0: True, 1: False, 2: False}
    assert live_process(zombie.pid) is None


def test_rank_whose_pid_was_reused_is_dead():
    starts = {500: 1000.0}
    tracker = RankTracker(is_alive=lambda pid: True, start_time=lambda pid: starts.get(pid))
    tracker.observe([StepSample.model_validate(step_dict(0, rank=0, pid=500))])
    assert [p.alive for p in tracker.processes()] == [True]
    starts[500] = 1234.5  # the rank died and another process got its pid
    assert [p.alive for p in tracker.processes()] == [False]
    assert tracker.pids().keys() == {500}


def test_agent_passes_its_rank_table_to_the_commands(short_dir, procs, live_controller):
    """The controller aims at a pid the node reported as a rank; the agent acts on it only once its
    own rank table holds it. Commands come from faults injected through the real controller's API."""
    p = procs.spawn()
    live = live_controller
    job = live.submit_job("rank-table", steps=10).id
    # What the controller knows of the node: rank 0 of the job is process p, at step 0.
    live.heartbeat("n-ranks", [(job, 0, p.pid)], [step_sample(job, 0, 0)])
    cfg = AgentConfig(node_id="n-ranks", run_dir=short_dir, controller_url=live.url, token=live.token("agent"))
    agent = Agent(cfg)  # the real transports; the command runner is stepped by hand
    try:
        assert agent.commands is not None
        (stop,) = live.fire(job, "hang_rank", rank=0, params={"mode": "agent"})  # stop_pid of p: not a rank of this agent yet
        assert (stop.kind, stop.args) == ("stop_pid", {"pid": p.pid})
        agent.commands.step()
        row = live.command_rows()[stop.id]
        assert row.status == "FAILED" and "refused" in (row.message or ""), row
        agent.receiver.ranks.observe([StepSample.model_validate(step_dict(0, job_id=job, rank=0, pid=p.pid))])
        (kill,) = live.fire(job, "kill_rank", rank=0, params={"mode": "agent"})  # kill_pid of p, SIGKILL
        agent.commands.step()
        row = live.command_rows()[kill.id]
        assert row.status == "DONE", row
        assert p.wait(5) == -signal.SIGKILL
    finally:
        agent.close()
