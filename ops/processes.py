"""Child processes of ``vigil up``, each in a session of its own, stopped with their whole trees."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

RAY_NODE_PREFIX = "ray-"
"""Children named so are Ray nodes (``ray start --block``), stopped after :data:`RAY_GRACE_S`."""
RAY_GRACE_S = 2.0
"""How long a Ray node gets after SIGTERM before its session is killed. ``ray start --block`` answers SIGTERM by
stopping its node's processes one after another, each with Ray's own grace: 16 to 33 s for the nodes of a
3-node local cluster (measured), always past :meth:`ProcessGroup.stop_all`'s 10 s, so each stop waited the
whole 10 s and killed them anyway. Their state is Ray's, in memory; the cluster's temp folder is removed
after. Vigil's own processes (controller, agents) exit within about a second and keep the longer grace."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """What started it (:meth:`ProcessGroup.restart` starts it again the same way)."""


@dataclass
class ProcessGroup:
    """Child processes, each in its own session, stopped together (newest first). ``lock`` is held by
    whoever changes :attr:`children` (the agent keeper starts dead agents again from its own thread)."""

    pid_file: Path
    children: list[Child] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def start(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Child:
        with self.lock:
            return self._start(name, argv, env, log_dir)

    def _start(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Child:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        child = Child(name, proc, log_path, list(argv), dict(env))
        self.children.append(child)
        self._write_pids()
        return child

    def child(self, name: str) -> Child:
        """The running child called ``name``."""
        return next(c for c in self.children if c.name == name)

    def restart(self, name: str, down_s: float = 0.0) -> Child:
        """``kill -9`` the child ``name`` (its whole session), wait ``down_s``, start it again as before."""
        with self.lock:
            old = self.child(name)
            self.stop_child(old)
            time.sleep(down_s)
            return self.start(name, old.argv, old.env, old.log_path.parent)

    def stop_child(self, child: Child) -> None:
        with self.lock:
            self._stop_child(child)

    def _stop_child(self, child: Child) -> None:
        _signal_group(child.proc.pid, signal.SIGKILL)
        kill_session(child.proc.pid)
        try:
            child.proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit", child.name, child.proc.pid)
        self.children.remove(child)
        self._write_pids()

    def _write_pids(self) -> None:
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.write_text(json.dumps({c.name: c.proc.pid for c in self.children}))

    def stop_all(self, grace_s: float = 10.0) -> None:
        # Ray's job drivers run in sessions of their own under a Ray worker: find every descendant
        # now, while the tree is intact, so that none is left behind once its parents are gone.
        descendants = [pid for child in self.children for pid in _descendants(child.proc.pid)]
        for child in reversed(self.children):
            _signal_group(child.proc.pid, signal.SIGTERM)
        start = time.monotonic()
        for child in reversed(self.children):  # newest first: the agents and the controller, then Ray's nodes
            own = min(grace_s, RAY_GRACE_S) if child.name.startswith(RAY_NODE_PREFIX) else grace_s
            try:
                child.proc.wait(max(0.1, start + own - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in any child's session (raylet workers, job drivers) goes now.
        for child in reversed(self.children):
            _signal_group(child.proc.pid, signal.SIGKILL)
            kill_session(child.proc.pid)  # members that moved to another process group
            try:
                child.proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not exit", child.name, child.proc.pid)
        _kill_pids(descendants)
        self.children.clear()
        self.pid_file.unlink(missing_ok=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _session_members(sid: int) -> list[int]:
    """Pids whose session id is ``sid`` (Ray may start helpers in their own process groups)."""
    out = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                out.append(pid)
        except OSError:
            continue
    return out


def kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid``; returns how many there were."""
    members = _session_members(sid)
    _kill_pids(members)
    return len(members)


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def clean_stale(pid_file: Path) -> int:
    """Kill the sessions a crashed ``vigil up`` left behind (from its pid file)."""
    if not pid_file.exists():
        return 0
    try:
        pids = json.loads(pid_file.read_text())
    except ValueError:
        pids = {}
    n = 0
    for name, pid in pids.items():
        killed = kill_session(int(pid))
        if killed:
            log.warning("killed %d leftover process(es) of %s from an earlier run", killed, name)
        n += killed
    pid_file.unlink(missing_ok=True)
    return n
