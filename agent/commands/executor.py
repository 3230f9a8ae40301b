"""What each command kind does: :class:`CommandExecutor` (its :class:`~agent.commands.config.ExecutorConfig` is
in :mod:`agent.commands.config`).

The executor owns dispatch (a failure is an answer, never an exception), each kind's timeout, the
pid rule (which processes the controller may act on) and the process kinds (kill, stop, continue,
throttle); the file, stack and node kinds live in :mod:`agent.commands.files`,
:mod:`agent.commands.stacks` and :mod:`agent.commands.node`, mixed into it.
"""

from __future__ import annotations

import logging
import math
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from agent import netfaults
from agent.commands.args import KillArgs, PidArgs, ThrottleArgs, _validate
from agent.commands.config import ExecutorConfig
from agent.commands.errors import CommandError, _fit
from agent.commands.files import FileKinds
from agent.commands.node import NodeKinds
from agent.commands.pids import (
    _STOPPED_STATES,
    _descendants,
    _state,
    _wait_gone,
    _wait_state,
    live_process,
    parse_signal,
    protected_pids,
)
from agent.commands.raylet import RayletLocator
from agent.commands.stacks import StackKinds
from agent.commands.throttle import Throttle
from vigil.contract.schemas import CommandKind, CommandResult

log = logging.getLogger(__name__)


Handler = Callable[[Mapping[str, Any]], CommandResult]


class CommandExecutor(FileKinds, StackKinds, NodeKinds):
    """Carries out one command. :meth:`run` never raises: failures are answers with ``ok=false``."""

    def __init__(
        self,
        config: ExecutorConfig,
        rank_pids: Callable[[], Mapping[int, float]] = dict,
    ) -> None:
        self.config = config
        self._rank_pids = rank_pids
        self._lock = threading.Lock()  # throttles and the join child; commands run one at a time
        self._throttles: dict[int, Throttle] = {}
        self._join: subprocess.Popen[bytes] | None = None
        self.locator = RayletLocator(
            config.node_id, config.raylet_pid, config.ray_start_pid, join_child=self._join_process,
            gcs_address=config.ray_gcs_address,
        )
        self._handlers: dict[str, Handler] = {
            CommandKind.KILL_PID.value: self.kill_pid,
            CommandKind.STOP_PID.value: self.stop_pid,
            CommandKind.CONT_PID.value: self.cont_pid,
            CommandKind.THROTTLE_PID.value: self.throttle_pid,
            CommandKind.UNTHROTTLE_PID.value: self.unthrottle_pid,
            CommandKind.WRITE_FAULT_FILE.value: self.write_fault_file,
            CommandKind.CORRUPT_FILES.value: self.corrupt_files,
            CommandKind.PYSPY_DUMP.value: self.pyspy_dump,
            CommandKind.KILL_NODE.value: self.kill_node,
            CommandKind.STOP_RAYLET.value: self.stop_raylet,
            CommandKind.START_RAYLET.value: self.start_raylet,
            CommandKind.SHAPE_NIC.value: self.shape_nic,
        }

    # -- dispatch ---------------------------------------------------------------------------------
    def run(self, kind: str | CommandKind, args: Mapping[str, Any]) -> CommandResult:
        name = kind.value if isinstance(kind, CommandKind) else str(kind)
        handler = self._handlers.get(name)
        if handler is None:
            return CommandResult(ok=False, message=_fit(f"unknown command kind {name!r}"))
        try:
            return handler(args or {})
        except CommandError as exc:
            return CommandResult(ok=False, message=_fit(str(exc)))
        except Exception as exc:  # a surprise is an answer, never a dead agent
            log.exception("command %s failed", name)
            return CommandResult(ok=False, message=_fit(f"{name} failed: {type(exc).__name__}: {exc}"))

    def timeout_s(self, kind: str | CommandKind, args: Mapping[str, Any]) -> float:
        """How long the runner waits for one command of ``kind`` before answering 'timed out'."""
        name = kind.value if isinstance(kind, CommandKind) else str(kind)
        c = self.config
        if name == CommandKind.PYSPY_DUMP.value:
            pids = args.get("pids") if isinstance(args, Mapping) else None
            n = len(pids) if isinstance(pids, Mapping) else 1
            rounds = math.ceil(max(1, n) / max(1, c.pyspy_workers))
            return 2 * c.pyspy_timeout_s * rounds + 5.0  # a blocking try, then a non-blocking one
        if name == CommandKind.STOP_RAYLET.value:
            return c.raylet_stop_grace_s + c.default_timeout_s
        if name == CommandKind.START_RAYLET.value:
            return c.raylet_start_wait_s + c.default_timeout_s
        return c.default_timeout_s

    def close(self) -> None:
        """Agent shutdown: every throttled process is left running (SIGCONT)."""
        with self._lock:
            throttles, self._throttles = list(self._throttles.values()), {}
        for t in throttles:
            t.stop()
        if self._join is not None:
            self._join.poll()  # reap it if it exited; a running raylet stays (it is the node)
        netfaults.close()  # a shaped or flapping NIC is restored

    # -- the pid rule -----------------------------------------------------------------------------
    def _target(self, pid: int) -> psutil.Process:
        """The live process ``pid`` if the controller may act on it; CommandError otherwise: a rank this agent
        saw send (the kernel named the sender) or a process under this node's raylet, and, where the raylet
        is known, one that runs as the raylet's user (ranks run as that user: never a process of root's
        while ranks are unprivileged)."""
        if pid in protected_pids():
            raise CommandError(f"refused: pid {pid} is the agent, one of its ancestors, or init")
        proc = live_process(pid)
        if proc is None:
            raise CommandError(f"no such process: {pid}")
        try:
            raylet = self.locator.raylet()
        except CommandError:
            raylet = None
        if raylet is not None:
            try:
                theirs, mine = proc.uids().real, raylet.uids().real
            except psutil.Error as exc:
                raise CommandError(f"no such process: {pid} ({exc})") from None
            if theirs != mine:
                raise CommandError(f"refused: pid {pid} runs as uid {theirs}, not as node {self.config.node_id}'s "
                                   f"Ray workers (uid {mine})")
        seen = self._rank_pids().get(pid)
        if seen is not None:
            try:
                started = proc.create_time()
            except psutil.Error as exc:
                raise CommandError(f"no such process: {pid} ({exc})") from None
            if started <= seen + 1.0:
                return proc
            raise CommandError(f"refused: pid {pid} started after this rank's last sample (a reused pid)")
        if raylet is not None and pid in {p.pid for p in _descendants(raylet)}:
            return proc
        raise CommandError(
            f"refused: pid {pid} is neither a rank this agent has seen nor a process under node "
            f"{self.config.node_id}'s raylet"
        )

    def _drop_throttle(self, pid: int) -> bool:
        with self._lock:
            t = self._throttles.pop(pid, None)
        if t is not None:
            t.stop()
        return t is not None

    # -- kinds: processes -------------------------------------------------------------------------
    def kill_pid(self, args: Mapping[str, Any]) -> CommandResult:
        a: KillArgs = _validate(KillArgs, args)
        try:
            sig = parse_signal(a.signal)
        except ValueError as exc:
            raise CommandError(f"bad args: signal: {exc}") from None
        if live_process(a.pid) is None:
            # Nothing to do, and nothing was done to anyone: a redo after the kill worked.
            return CommandResult(ok=True, message=f"process {a.pid} is already gone", output={"pid": a.pid})
        proc = self._target(a.pid)
        self._drop_throttle(a.pid)
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            return CommandResult(ok=True, message=f"process {a.pid} is already gone", output={"pid": a.pid})
        exited = sig == signal.SIGKILL and not _wait_gone([proc], 5.0)
        return CommandResult(
            ok=True,
            message=f"sent {sig.name} to {a.pid}",
            output={"pid": a.pid, "signal": sig.name, "exited": exited, "state": _state(proc)},
        )

    def stop_pid(self, args: Mapping[str, Any]) -> CommandResult:
        a: PidArgs = _validate(PidArgs, args)
        proc = self._target(a.pid)
        self._drop_throttle(a.pid)  # a throttle would let it run again within a period
        proc.send_signal(signal.SIGSTOP)
        state = _wait_state(proc, lambda s: s in _STOPPED_STATES, 2.0)
        return CommandResult(
            ok=state in _STOPPED_STATES,
            message=f"SIGSTOP sent to {a.pid} (state {state})",
            output={"pid": a.pid, "state": state},
        )

    def cont_pid(self, args: Mapping[str, Any]) -> CommandResult:
        a: PidArgs = _validate(PidArgs, args)
        proc = self._target(a.pid)
        throttled = self._drop_throttle(a.pid)
        proc.send_signal(signal.SIGCONT)
        state = _wait_state(proc, lambda s: s not in _STOPPED_STATES, 2.0)
        return CommandResult(
            ok=state not in _STOPPED_STATES,
            message=f"SIGCONT sent to {a.pid} (state {state}){'; throttle ended' if throttled else ''}",
            output={"pid": a.pid, "state": state, "was_throttled": throttled},
        )

    def throttle_pid(self, args: Mapping[str, Any]) -> CommandResult:
        a: ThrottleArgs = _validate(ThrottleArgs, args)
        proc = self._target(a.pid)
        with self._lock:
            old = self._throttles.get(a.pid)
        if old is not None and old.running and (old.factor, old.period_s) == (a.factor, a.period_s):
            return CommandResult(
                ok=True,
                message=f"{a.pid} already throttled (factor {a.factor:g})",
                output={"pid": a.pid, "factor": a.factor, "period_s": a.period_s},
            )
        self._drop_throttle(a.pid)
        t = Throttle(proc, a.factor, a.period_s)
        with self._lock:
            self._throttles[a.pid] = t
        t.start()
        return CommandResult(
            ok=True,
            message=f"throttling {a.pid}: runs 1/{a.factor:g} of every {a.period_s:g}s",
            output={"pid": a.pid, "factor": a.factor, "period_s": a.period_s},
        )

    def unthrottle_pid(self, args: Mapping[str, Any]) -> CommandResult:
        a: PidArgs = _validate(PidArgs, args)
        throttled = self._drop_throttle(a.pid)  # ends with a SIGCONT
        if live_process(a.pid) is None:
            return CommandResult(ok=True, message=f"process {a.pid} is gone", output={"pid": a.pid})
        proc = self._target(a.pid)
        proc.send_signal(signal.SIGCONT)  # whatever happened before: the process is left running
        state = _wait_state(proc, lambda s: s not in _STOPPED_STATES, 2.0)
        return CommandResult(
            ok=True,
            message=f"{a.pid} {'no longer throttled' if throttled else 'was not throttled'}; running",
            output={"pid": a.pid, "was_throttled": throttled, "state": state},
        )

    def throttled(self) -> dict[int, tuple[float, float]]:
        """Throttled pids -> (factor, period_s)."""
        with self._lock:
            return {pid: (t.factor, t.period_s) for pid, t in self._throttles.items() if t.running}
