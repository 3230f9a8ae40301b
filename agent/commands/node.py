"""The node kinds of the executor: ``kill_node``, ``stop_raylet`` and ``start_raylet`` (the raylet,
``ray start``, their descendants and ``ray start``'s session), and ``shape_nic`` (agent/netfaults.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from agent import netfaults
from agent.commands.config import ExecutorConfig
from agent.commands.errors import CommandError, _fit
from agent.commands.pids import _child_env, _descendants, _gone, _session_members, _wait_gone, protected_pids
from agent.commands.raylet import RayletLocator
from vigil.contract.schemas import CommandResult


def _parents(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.parents()
    except psutil.Error:
        return []


class NodeKinds:
    """``kill_node``, ``stop_raylet``, ``start_raylet`` and ``shape_nic``.

    Mixed into :class:`~agent.commands.executor.CommandExecutor`, which provides what is declared here.
    """

    config: ExecutorConfig
    locator: RayletLocator
    _join: subprocess.Popen[bytes] | None
    _last_words: list[psutil.Process] = []  # noqa: RUF012 - replaced per instance by _node_processes

    # -- kinds: the node --------------------------------------------------------------------------
    def _join_process(self) -> psutil.Process | None:
        j = self._join
        if j is None or j.poll() is not None:
            return None
        try:
            return psutil.Process(j.pid)
        except psutil.NoSuchProcess:
            return None

    def _node_processes(
        self,
    ) -> tuple[psutil.Process | None, psutil.Process | None, list[psutil.Process], int | None]:
        """(raylet, ray start, every process of the node, the session killed with it)."""
        raylet = self.locator.raylet()
        start = self.locator.ray_start(raylet)
        protected = protected_pids()
        my_sid = os.getsid(0)
        procs: dict[int, psutil.Process] = {}
        session: int | None = None
        for root in (start, raylet):
            if root is None:
                continue
            procs[root.pid] = root
            procs.update((p.pid, p) for p in _descendants(root))
        if start is not None:
            # `vigil up` runs `ray start --block` as a session leader: what else runs in that
            # session belongs to the node (never the agent's own session: that is the agent).
            with contextlib.suppress(OSError):
                sid = os.getsid(start.pid)
                if sid == start.pid and sid != my_sid:
                    session = sid
                    procs.update((p.pid, p) for p in _session_members(sid))
        # An agent Ray itself runs (a fleet actor, controller/agent_host.py) lives under its raylet: those of its
        # ancestors that are the node's die last, after the answer went out (:meth:`kill_own_ancestors`).
        mine = [p for pid, p in procs.items() if pid in protected and pid not in (0, 1, os.getpid())]
        self._last_words = sorted(mine, key=lambda p: len(_parents(p)))  # outermost first
        return raylet, start, [p for pid, p in procs.items() if pid not in protected], session

    def _take_down(self, graceful: bool) -> dict[str, Any]:
        raylet, start, procs, session = self._node_processes()
        if raylet is None and start is None:
            return {}
        if graceful:
            for p in (start, raylet):
                if p is not None:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(signal.SIGTERM)
            _wait_gone(procs, self.config.raylet_stop_grace_s)
        killed: set[int] = set()
        for _ in range(3):  # a process forked meanwhile is caught by the next pass
            for p in procs:
                if not _gone(p):
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(signal.SIGKILL)
                        killed.add(p.pid)
            left = _wait_gone(procs, 5.0)
            # Newcomers: children of survivors and members of the session.
            extra = {c.pid: c for p in procs if not _gone(p) for c in _descendants(p)}
            if session is not None:
                extra.update((p.pid, p) for p in _session_members(session))
            protected = protected_pids()
            procs = [p for p in left + list(extra.values()) if p.pid not in protected and not _gone(p)]
            if not procs:
                break
        if self._join is not None:
            self._join.poll()  # reap our own child
        return {
            "raylet_pid": raylet.pid if raylet else None,
            "ray_start_pid": start.pid if start else None,
            "session": session,
            "signalled": sorted(killed),
            "left": sorted(p.pid for p in procs),
        }

    def kill_node(self, args: Mapping[str, Any]) -> CommandResult:
        out = self._take_down(graceful=False)
        if not out:
            raise CommandError(f"no raylet (or ray start) found for node {self.config.node_id}")
        out["after_answer"] = sorted(p.pid for p in self._last_words)
        if out["left"]:
            return CommandResult(ok=False, message=f"processes survived SIGKILL: {out['left']}", output=out)
        return CommandResult(
            ok=True,
            message=f"killed node {self.config.node_id}: {len(out['signalled'])} process(es)",
            output=out,
        )

    def kill_own_ancestors(self) -> list[int]:
        """After ``kill_node`` was answered: SIGKILL the node's processes above this agent (its raylet, ``ray
        start``, the Ray worker hosting it), outermost first; this agent goes with them. Returns their pids."""
        pids = [p.pid for p in self._last_words]
        for p in self._last_words:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        self._last_words = []
        return pids

    def stop_raylet(self, args: Mapping[str, Any]) -> CommandResult:
        out = self._take_down(graceful=True)
        if not out:
            return CommandResult(ok=True, message=f"no raylet running for node {self.config.node_id}")
        if out["left"]:
            return CommandResult(ok=False, message=f"processes survived: {out['left']}", output=out)
        return CommandResult(ok=True, message=f"stopped the raylet of node {self.config.node_id}", output=out)

    def start_raylet(self, args: Mapping[str, Any]) -> CommandResult:
        cmd = self.config.ray_join_cmd
        if not cmd:
            raise CommandError("no join command configured (agent flag --ray-join-cmd)")
        raylet = self.locator.raylet()
        if raylet is not None:
            return CommandResult(
                ok=True,
                message=f"raylet already running (pid {raylet.pid})",
                output={"raylet_pid": raylet.pid},
            )
        if self._join_process() is not None:
            assert self._join is not None
            return CommandResult(
                ok=True,
                message=f"join command already running (pid {self._join.pid})",
                output={"pid": self._join.pid, "raylet_pid": None},
            )
        log_path = Path(self.config.run_dir) / "logs" / f"ray-join-{self.config.node_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            # A child of the agent in the agent's own session: whoever stops the agent's session
            # stops the node it readmitted.
            try:
                self._join = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=_child_env(),
                    close_fds=True,
                )
            except OSError as exc:
                raise CommandError(f"cannot run the join command {cmd[0]!r}: {exc}") from None
        join = self._join
        deadline = time.monotonic() + self.config.raylet_start_wait_s
        while True:
            raylet = self.locator.raylet()
            rc = join.poll()
            if raylet is not None:
                return CommandResult(
                    ok=True,
                    message=f"raylet of node {self.config.node_id} started (pid {raylet.pid})",
                    output={"pid": join.pid, "raylet_pid": raylet.pid, "log": str(log_path)},
                )
            if rc is not None:
                tail = _tail(log_path)
                return CommandResult(
                    ok=False,
                    message=_fit(f"join command exited with {rc} and no raylet runs: {tail}"),
                    output={"pid": join.pid, "returncode": rc, "log": str(log_path)},
                )
            if time.monotonic() >= deadline:
                return CommandResult(
                    ok=True,
                    message=f"join command running (pid {join.pid}); no raylet yet after "
                    f"{self.config.raylet_start_wait_s:g}s",
                    output={"pid": join.pid, "raylet_pid": None, "log": str(log_path)},
                )
            time.sleep(0.5)

    def shape_nic(self, args: Mapping[str, Any]) -> CommandResult:
        # Network faults (issue 6) on this node's NIC, from inside its namespace: agent/netfaults.py.
        ok, message, output = netfaults.shape_nic(args)
        return CommandResult(ok=ok, message=_fit(message), output=output)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()
