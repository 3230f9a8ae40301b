"""The home of a Ray-deployed agent: a detached Ray actor pinned to one node that runs ``vigil agent``.

On a Ray cluster Vigil did not start, the controller's :mod:`controller.fleet` creates one
:class:`AgentHost` actor per alive node (named ``vigil-agent-<node>``, namespace ``vigil``, zero CPUs,
hard node affinity, restarted by Ray for ever). The actor starts the agent as a child process (``python -m
agent``, the same Python as the Ray worker) and starts it again within a second when it dies, except after
the agent killed its own node on command (exit status 3). If the actor itself dies, Ray starts it again on
the same node, and it starts a new agent; when the node leaves, the actor goes with it.

Standard library only: this module is imported inside a Ray worker. The agent child dies with the actor
(``setpriv --pdeathsig``), so a raylet killed by ``kill_node`` leaves no agent behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

EXIT_NODE_KILLED = 3
"""``vigil agent``'s exit status after it killed its own node on command (agent/main.py)."""


def _with_parent_death(argv: list[str]) -> list[str]:
    """``argv`` under ``setpriv --pdeathsig KILL`` (util-linux) where there is one: the agent dies with its
    host (a fork hook is unsafe in a Ray worker's threads)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else argv


class AgentHost:
    """Runs one agent process and keeps it running (module docstring)."""

    def __init__(self, args: list[str], env: dict[str, str], backoff_s: float = 1.0,
                 program: list[str] | None = None) -> None:
        """``program``: what runs ``args`` (default ``python -m agent``; tests put a stand-in there)."""
        self.argv = _with_parent_death([*(program or [sys.executable, "-m", "agent"]), *args])
        self.env = {**os.environ, **env}
        self.backoff_s = backoff_s
        self.starts = 0
        self.exits: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # Every start from this one thread, which lives as long as the actor: PR_SET_PDEATHSIG fires
        # when the *thread* that started the child ends.
        threading.Thread(target=self._keep, name="vigil-agent-host", daemon=True).start()

    def _start(self) -> None:
        with self._lock:
            self._proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL)
            self.starts += 1

    def _keep(self) -> None:
        self._start()
        while not self._stop.is_set():
            proc = self._proc
            if proc is None:
                return
            rc = proc.wait()
            self.exits.append(rc)
            if self._stop.is_set() or rc == EXIT_NODE_KILLED:
                log.warning("agent exited with status %d: not started again", rc)
                return
            log.warning("agent exited with status %d: starting it again", rc)
            time.sleep(self.backoff_s if self.starts > 1 else 0.0)
            self._start()

    # -- what the fleet (and an operator with Ray access) may ask ------------------------------------
    def status(self) -> dict[str, object]:
        """The agent's pid, whether it runs, how often it was started and how it exited."""
        proc = self._proc
        return {"pid": proc.pid if proc else None, "running": proc is not None and proc.poll() is None,
                "starts": self.starts, "exits": list(self.exits[-10:]), "host_pid": os.getpid()}

    def stop(self) -> None:
        """Stop the agent for good (the fleet is told to forget this node)."""
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
