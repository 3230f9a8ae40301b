"""Commands from the controller, carried out on this node for real (docs/RECOVERY.md).

The controller queues :class:`~controller.schemas.NodeCommand` s per node; the agent polls
``GET /nodes/{node}/commands?status=PENDING`` once per heartbeat interval (and again at once after
it has done one), carries each one out, in id order, and answers with ``POST .../result``.

Three pieces, each a seam for tests:

- :class:`CommandRunner` - the state machine: ``step()`` polls, runs each new command (at most once
  per agent process: it remembers the ids it has done), posts the results in order and keeps
  unposted ones for the next step. Every command runs in a worker thread with a timeout, so a
  stuck ``py-spy`` or a process in uninterruptible sleep costs that command, not the agent.
- :class:`CommandLoop` - the thread that steps the runner; it never touches the shipper, so
  commands never hold up heartbeats or telemetry.
- :class:`CommandExecutor` - what each kind does. After an agent restart the controller may still
  list a command the previous agent did as PENDING (its answer was lost), so every kind is safe to
  redo: killing a pid that is gone, stopping a raylet that is not running, starting one that runs,
  or corrupting bytes already corrupted all answer ok without doing harm twice.

The controller may only touch processes of this node's training: a pid is acted on only if it is a
rank this agent has received samples from (and the process started before that sample: a reused
pid is refused) or a descendant of this node's raylet; never the agent itself or its ancestors.
``corrupt_files`` only writes under ``storage_root`` (resolved, symlinks refused).

This module must never import torch, ray or the trainer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent import netfaults
from controller.client import ApiError, VigilClient
from controller.schemas import INT32_MAX, TEXT_MAX, CommandKind, CommandResult, NodeCommand
from controller.settings import fault_file_path

log = logging.getLogger(__name__)

#: Environment variables never passed to processes the agent starts (the raylet would hand the
#: agent's token to every Ray worker); the same list `vigil up` keeps out of Ray's environment.
SECRET_ENV = ("VIGIL_AGENT_TOKEN", "VIGIL_TOKEN", "VIGIL_DASHBOARD_TOKEN")
#: ``corrupt_files`` leaves files whose name contains this alone (the checkpoint's manifest).
MANIFEST_MARKER = "manifest"
#: Bytes overwritten in the middle of each data file. A fixed pattern, so a redo finds the bytes
#: already corrupted and reports that instead of undoing (an XOR would) or re-randomising them.
CORRUPTION = (b"VIGIL-CORRUPTED!" * 4)[:64]
#: Longest stack text kept per rank (a process with thousands of threads stays postable).
MAX_STACK_CHARS = 256 * 1024
#: The rank renames its fault file to ``rank-<r>.json`` + this when the fault fires (trainer/faults.py).
FIRED_SUFFIX = ".fired"
#: Most command ids remembered as done.
MAX_REMEMBERED = 10_000

_STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
_GONE_STATES = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_NODE_FLAGS = ("--node-name", "--node_name", "--node-id", "--node_id")


class CommandError(Exception):
    """A command that cannot or must not be carried out; its text is the answer's message."""


# --------------------------------------------------------------------------------------------------
# Transport (the HTTP side)
# --------------------------------------------------------------------------------------------------


class CommandTransport(Protocol):
    """Fetches this node's pending commands and posts answers; raises on failure."""

    def fetch(self) -> list[NodeCommand]: ...

    def post_result(self, command_id: int, result: CommandResult) -> None: ...


class ClientCommandTransport:
    """The real transport: :meth:`VigilClient.node_commands` / :meth:`VigilClient.post_command_result`."""

    def __init__(self, client: VigilClient, node_id: str) -> None:
        self.client = client
        self.node_id = node_id

    def fetch(self) -> list[NodeCommand]:
        return list(self.client.node_commands(self.node_id, status="PENDING").data)

    def post_result(self, command_id: int, result: CommandResult) -> None:
        self.client.post_command_result(self.node_id, command_id, result)


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------


def live_process(pid: int) -> psutil.Process | None:
    """The process ``pid`` if it exists and is not a zombie, else None."""
    try:
        p = psutil.Process(pid)
        return None if p.status() in _GONE_STATES else p
    except (psutil.NoSuchProcess, ValueError):
        return None


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() in _GONE_STATES
    except psutil.NoSuchProcess:
        return True


def _state(p: psutil.Process) -> str:
    try:
        return str(p.status())
    except psutil.NoSuchProcess:
        return "gone"


def _wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited (a zombie counts); returns those still there."""
    left = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in left if not _gone(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _wait_state(p: psutil.Process, want: Callable[[str], bool], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        s = _state(p)
        if want(s) or time.monotonic() >= deadline:
            return s
        time.sleep(0.01)


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _session_members(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except OSError:
            continue
    return out


def protected_pids() -> set[int]:
    """Processes no command may signal: pid 0 and 1, the agent and its ancestors."""
    me = psutil.Process()
    return {0, 1, me.pid, *(p.pid for p in me.parents())}


def parse_signal(value: int | str) -> signal.Signals:
    """``9``, ``"9"``, ``"KILL"`` or ``"SIGKILL"`` -> ``signal.SIGKILL``; ValueError otherwise."""
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        return signal.Signals(int(value))
    name = str(value).strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {value!r}") from None


def _names_node(cmdline: Sequence[str], node: str) -> bool:
    for i, arg in enumerate(cmdline):
        flag, eq, val = arg.partition("=")
        if flag in _NODE_FLAGS and ((eq and val == node) or (not eq and cmdline[i + 1 : i + 2] == [node])):
            return True
    return False


def _looks_like_ray_start(p: psutil.Process) -> bool:
    """``[python] .../ray start ...``: the process ``ray start`` (``--block`` in ``vigil up``)."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return False
    head = argv[:3]
    return "start" in head and any(Path(a).name == "ray" for a in head[:2])


def _named_raylet(p: psutil.Process) -> bool:
    try:
        return p.name() == "raylet"
    except psutil.Error:
        return False


class RayletLocator:
    """Finds this node's raylet and the ``ray start`` process that owns it.

    The raylet is the process named ``raylet`` whose command line names this node
    (``--node-name=<node>`` as Ray 2.x passes it, ``--node_name=``, or ``--node_id=<hex>`` for nodes
    known by their Ray id); failing that, a configured ``raylet_pid`` that still names a raylet (a
    pid can be reused). ``ray start`` is the configured ``ray_start_pid``, or the join command the
    agent started, or the raylet's parent when that is a ``ray start`` process.
    """

    def __init__(
        self,
        node: str,
        raylet_pid: int | None = None,
        ray_start_pid: int | None = None,
        join_child: Callable[[], psutil.Process | None] = lambda: None,
    ) -> None:
        self.node = node
        self.raylet_pid = raylet_pid
        self.ray_start_pid = ray_start_pid
        self._join_child = join_child

    def raylets(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["name", "cmdline"]):
            named = p.info["name"] == "raylet" and _names_node(p.info["cmdline"] or [], self.node)
            if named and not _gone(p):
                found.append(p)
        if not found and self.raylet_pid is not None:
            p = live_process(self.raylet_pid)
            if p is not None and _named_raylet(p):
                found.append(p)
        return found

    def raylet(self) -> psutil.Process | None:
        """This node's raylet; CommandError when several processes claim to be it."""
        found = self.raylets()
        if len(found) > 1:
            raise CommandError(
                f"{len(found)} raylets name node {self.node!r} (pids {sorted(p.pid for p in found)}); "
                "refusing to guess"
            )
        return found[0] if found else None

    def ray_start(self, raylet: psutil.Process | None) -> psutil.Process | None:
        if self.ray_start_pid is not None:
            p = live_process(self.ray_start_pid)
            if p is not None and _looks_like_ray_start(p):
                return p
        child = self._join_child()
        if child is not None and not _gone(child):
            return child
        if raylet is not None:
            try:
                parent = raylet.parent()
            except psutil.Error:
                parent = None
            if parent is not None and _looks_like_ray_start(parent):
                return parent
        return None


# --------------------------------------------------------------------------------------------------
# Throttling
# --------------------------------------------------------------------------------------------------


class Throttle:
    """SIGCONT / SIGSTOP duty cycle in a thread: the process runs ``1/factor`` of each period.

    Ends (with a SIGCONT, so the process is left running) on :meth:`stop` or when the process is
    gone; psutil refuses to signal a pid that now names another process.
    """

    def __init__(self, proc: psutil.Process, factor: float, period_s: float) -> None:
        self.proc = proc
        self.factor = factor
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"vigil-throttle-{proc.pid}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> bool:
        try:
            self.proc.send_signal(sig)
            return True
        except psutil.Error:
            return False

    def _run(self) -> None:
        on = self.period_s / self.factor
        try:
            while not self._stop.is_set():
                if not self._signal(signal.SIGCONT):
                    return
                if self._stop.wait(on):
                    return
                if not self._signal(signal.SIGSTOP):
                    return
                self._stop.wait(self.period_s - on)
        finally:
            self._signal(signal.SIGCONT)


# --------------------------------------------------------------------------------------------------
# Arguments (validated at the edge: a bad one is an answer with ok=false)
# --------------------------------------------------------------------------------------------------


class _Args(BaseModel):
    # Extra keys are ignored: the controller may add context (job id, rank) for its own records.
    model_config = ConfigDict(extra="ignore")


class PidArgs(_Args):
    pid: int = Field(..., ge=2, le=INT32_MAX)


class KillArgs(PidArgs):
    signal: int | str = Field("SIGKILL", description="Name (SIGKILL, KILL) or number; default SIGKILL.")


class ThrottleArgs(PidArgs):
    factor: float = Field(3.0, ge=1.0, le=1000.0, description="The process runs 1/factor of each period.")
    period_s: float = Field(0.1, ge=0.01, le=10.0, description="Length of one run/stop cycle.")


class FaultFileArgs(_Args):
    job_id: str = Field(..., min_length=1, max_length=128)
    rank: int = Field(..., ge=0, le=1_000_000)
    fault: dict[str, Any] = Field(default_factory=dict)


class CorruptArgs(_Args):
    path: str = Field(..., min_length=1, max_length=4096)
    newest_under: bool = Field(False, description="path is a folder of checkpoints: corrupt the newest complete one "
                                                   "(the highest-numbered subfolder holding a manifest) as storage "
                                                   "has it now, which the controller may not have heard of yet.")


class PyspyArgs(_Args):
    job_id: str = Field("", max_length=128)
    pids: dict[int, int] = Field(..., max_length=4096, description="rank -> pid")


def _validate(model: type[_Args], args: Mapping[str, Any]) -> Any:
    try:
        return model.model_validate(dict(args))
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        what = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errs[:5])
        raise CommandError(f"bad args: {what}") from None


def _fit(text: str, limit: int = TEXT_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------------------


@dataclass
class ExecutorConfig:
    """What the commands need to know about this node (from :class:`agent.main.AgentConfig`)."""

    #: The node's name as its raylet knows it (``--node-name``) or its Ray node id.
    node_id: str
    #: Node-local runtime folder: fault files go to ``<run_dir>/faults/...``.
    run_dir: Path
    #: ``corrupt_files`` only touches files under this folder (resolved).
    storage_root: Path
    #: Fallbacks when the raylet or ``ray start`` cannot be found by command line.
    raylet_pid: int | None = None
    ray_start_pid: int | None = None
    #: argv that (re)joins this node to the cluster (``start_raylet``); None: readmission unsupported.
    ray_join_cmd: list[str] | None = None
    #: Longest one ``py-spy dump`` may take.
    pyspy_timeout_s: float = 10.0
    #: ``stop_raylet``: seconds between SIGTERM and SIGKILL.
    raylet_stop_grace_s: float = 5.0
    #: ``start_raylet``: how long to wait for the raylet to show up.
    raylet_start_wait_s: float = 60.0
    #: Timeout of every kind without its own.
    default_timeout_s: float = 30.0
    pyspy_workers: int = 4
    #: ``py-spy`` binary; default: next to ``sys.executable`` (the venv), else on PATH.
    pyspy_path: str | None = None


Handler = Callable[[Mapping[str, Any]], CommandResult]


class CommandExecutor:
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
            config.node_id, config.raylet_pid, config.ray_start_pid, join_child=self._join_process
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
        """The live process ``pid`` if the controller may act on it; CommandError otherwise."""
        if pid in protected_pids():
            raise CommandError(f"refused: pid {pid} is the agent, one of its ancestors, or init")
        proc = live_process(pid)
        if proc is None:
            raise CommandError(f"no such process: {pid}")
        seen = self._rank_pids().get(pid)
        if seen is not None:
            try:
                started = proc.create_time()
            except psutil.Error as exc:
                raise CommandError(f"no such process: {pid} ({exc})") from None
            if started <= seen + 1.0:
                return proc
            raise CommandError(f"refused: pid {pid} started after this rank's last sample (a reused pid)")
        try:
            raylet = self.locator.raylet()
        except CommandError:
            raylet = None
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

    # -- kinds: files -----------------------------------------------------------------------------
    def write_fault_file(self, args: Mapping[str, Any]) -> CommandResult:
        a: FaultFileArgs = _validate(FaultFileArgs, args)
        path = fault_file_path(self.config.run_dir, a.job_id, a.rank)
        try:
            data = json.dumps(a.fault, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise CommandError(f"bad args: fault is not JSON: {exc}") from None
        fired = path.with_name(path.name + FIRED_SUFFIX)
        with contextlib.suppress(OSError):
            if fired.read_bytes() == data:
                # A redo of a fault the rank already took: writing it again would fire it twice.
                return CommandResult(
                    ok=True, message=f"{path} already fired", output={"path": str(path), "fired": True}
                )
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: the rank's once-per-step stat sees either no file or the whole file.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return CommandResult(ok=True, message=f"wrote {path}", output={"path": str(path)})

    def _inside_storage(self, raw: str) -> Path:
        root = self.config.storage_root.resolve()
        given = Path(raw).expanduser()
        candidate = given if given.is_absolute() else root / given
        try:
            target = candidate.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise CommandError(f"no such path: {raw} ({type(exc).__name__})") from None
        if target == root or not target.is_relative_to(root):
            raise CommandError(f"refused: {raw} resolves to {target}, not inside the storage root {root}")
        return target

    def corrupt_files(self, args: Mapping[str, Any]) -> CommandResult:
        a: CorruptArgs = _validate(CorruptArgs, args)
        root = self.config.storage_root.resolve()
        target = self._inside_storage(a.path)
        if a.newest_under:
            target = self._newest_complete(target)
        files: list[Path] = []
        if target.is_dir():
            for dirpath, dirnames, filenames in os.walk(target, followlinks=False):
                dirnames.sort()
                files.extend(Path(dirpath) / n for n in sorted(filenames))
        else:
            files.append(target)
        touched: list[str] = []
        already: list[str] = []
        skipped: dict[str, str] = {}
        for f in files:
            why = self._corrupt_one(f, root)
            if why == "corrupted":
                touched.append(str(f))
            elif why == "already":
                already.append(str(f))
            else:
                skipped[str(f)] = why
        output = {
            "path": str(target),
            "files": touched,
            "already_corrupted": already,
            "skipped": skipped,
            "bytes_per_file": len(CORRUPTION),
        }
        if not touched and not already:
            return CommandResult(ok=False, message=f"no data file to corrupt under {target}", output=output)
        return CommandResult(
            ok=True,
            message=f"corrupted {len(touched)} file(s) under {target}"
            + (f" ({len(already)} already corrupted)" if already else ""),
            output=output,
        )

    def _newest_complete(self, folder: Path) -> Path:
        """The highest-numbered subfolder of ``folder`` (``step-00000030``: by its trailing number) that
        holds a manifest, i.e. a checkpoint its writer finished."""
        if not folder.is_dir():
            raise CommandError(f"newest_under: {folder} is not a folder")
        found: list[tuple[int, str, Path]] = []
        for sub in folder.iterdir():
            digits = sub.name.rsplit("-", 1)[-1].rsplit("_", 1)[-1]
            if not sub.is_symlink() and sub.is_dir() and digits.isdigit() and any(
                    MANIFEST_MARKER in f.name.lower() for f in sub.iterdir() if f.is_file()):
                found.append((int(digits), sub.name, sub))
        if not found:
            raise CommandError(f"newest_under: no complete checkpoint (a numbered folder with a manifest) in {folder}")
        return self._inside_storage(str(max(found)[2]))

    @staticmethod
    def _corrupt_one(path: Path, root: Path) -> str:
        """'corrupted', 'already', or why the file was skipped."""
        if MANIFEST_MARKER in path.name.lower():
            return "manifest"
        if path.name.startswith("."):
            return "hidden (metadata or a temporary file)"
        try:
            st = path.lstat()
        except OSError as exc:
            return f"cannot stat: {exc}"
        if not stat.S_ISREG(st.st_mode):  # lstat: a symlink is never followed
            return "not a regular file (symlinks are never followed)"
        if st.st_nlink > 1:
            return "has other hard links (may live outside the storage root)"
        if not path.resolve().is_relative_to(root):
            return "outside the storage root"
        if st.st_size == 0:
            return "empty"
        n = min(len(CORRUPTION), st.st_size)
        offset = (st.st_size - n) // 2
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            return f"cannot open: {exc}"
        try:
            if os.pread(fd, n, offset) == CORRUPTION[:n]:
                return "already"
            os.pwrite(fd, CORRUPTION[:n], offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        return "corrupted"

    # -- kinds: stacks ----------------------------------------------------------------------------
    def pyspy_binary(self) -> str | None:
        if self.config.pyspy_path:
            return self.config.pyspy_path if os.access(self.config.pyspy_path, os.X_OK) else None
        beside = Path(sys.executable).parent / "py-spy"
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
        return shutil.which("py-spy")

    def pyspy_dump(self, args: Mapping[str, Any]) -> CommandResult:
        a: PyspyArgs = _validate(PyspyArgs, args)
        stacks: dict[str, str] = {}
        errors: dict[str, str] = {}
        states: dict[str, str] = {}
        binary = self.pyspy_binary()
        if binary is None:
            reason = "py-spy not found (next to the agent's python or on PATH)"
            errors = {str(r): reason for r in a.pids}
            out = {"available": False, "reason": reason, "stacks": {}, "errors": errors, "states": {}}
            return CommandResult(ok=False, message=reason, output=out)
        targets: dict[int, psutil.Process] = {}
        for rank, pid in sorted(a.pids.items()):
            try:
                targets[rank] = self._target(pid)
            except CommandError as exc:
                errors[str(rank)] = str(exc)
        workers = max(1, min(self.config.pyspy_workers, len(targets)))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vigil-pyspy") as pool:
            futures = {rank: pool.submit(self._dump_one, binary, proc) for rank, proc in targets.items()}
            for rank, fut in futures.items():
                text, error, state = fut.result()
                states[str(rank)] = state
                if text is not None:
                    stacks[str(rank)] = text
                else:
                    errors[str(rank)] = error or "py-spy failed"
        out = {"available": True, "job_id": a.job_id, "stacks": stacks, "errors": errors, "states": states}
        if stacks:
            msg = f"stacks of {len(stacks)} rank(s)" + (f", {len(errors)} failed" if errors else "")
            return CommandResult(ok=True, message=msg, output=out)
        first = next(iter(errors.values()), "no pids given")
        return CommandResult(ok=False, message=_fit(f"no stack collected: {first}"), output=out)

    def _dump_one(self, binary: str, proc: psutil.Process) -> tuple[str | None, str | None, str]:
        """(stack text, error, process state). A stopped (hung) process is read without
        attaching: py-spy's default mode must suspend the process with ptrace, which fails on one
        that is already stopped, and would let it run on detach."""
        state = _state(proc)
        modes = [["--nonblocking"]] if state in _STOPPED_STATES else [[], ["--nonblocking"]]
        error = None
        for extra in modes:
            argv = [binary, "dump", "--pid", str(proc.pid), *extra]
            try:
                r = subprocess.run(
                    argv,
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=self.config.pyspy_timeout_s,
                    stdin=subprocess.DEVNULL,
                    env=_child_env(),
                )
            except subprocess.TimeoutExpired:
                error = f"py-spy timed out after {self.config.pyspy_timeout_s:g}s"
                continue
            except OSError as exc:
                return None, f"cannot run py-spy: {exc}", state
            err = (r.stderr or "").strip()
            if r.returncode == 0 and not err.startswith("Error") and r.stdout.strip():
                return r.stdout[:MAX_STACK_CHARS], None, state
            error = _pyspy_error(err or r.stdout, r.returncode)
        return None, error, state

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
        if out["left"]:
            return CommandResult(ok=False, message=f"processes survived SIGKILL: {out['left']}", output=out)
        return CommandResult(
            ok=True,
            message=f"killed node {self.config.node_id}: {len(out['signalled'])} process(es)",
            output=out,
        )

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


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV}


def _pyspy_error(text: str, rc: int) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    # py-spy prints "Error: <what>" then "Caused by:" lines and a backtrace; keep what explains.
    keep = [ln for ln in lines if not ln[:1].isdigit() and not ln.startswith("Stack backtrace")][:4]
    msg = " / ".join(keep) or f"py-spy exited with {rc}"
    if any(w in msg for w in ("Permission denied", "Operation not permitted", "EPERM")):
        msg += " (py-spy needs ptrace rights: root or CAP_SYS_PTRACE)"
    return _fit(msg, 1024)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


# --------------------------------------------------------------------------------------------------
# The runner (state machine) and its thread
# --------------------------------------------------------------------------------------------------


class Executor(Protocol):
    def run(self, kind: str | CommandKind, args: Mapping[str, Any]) -> CommandResult: ...

    def timeout_s(self, kind: str | CommandKind, args: Mapping[str, Any]) -> float: ...

    def close(self) -> None: ...


#: HTTP answers after which a result is dropped instead of posted again: the command is gone (404)
#: or the result itself is refused (400/409/422); retrying would only repeat them.
DROP_STATUSES = frozenset({400, 404, 409, 422})


@dataclass
class RunnerStats:
    polls: int = 0
    failed_polls: int = 0
    executed: int = 0
    failed_commands: int = 0
    timed_out: int = 0
    posted: int = 0
    failed_posts: int = 0
    dropped_results: int = 0


class CommandRunner:
    """Poll, execute in order at most once, answer. Single-threaded: call :meth:`step`."""

    def __init__(
        self,
        node_id: str,
        transport: CommandTransport,
        executor: Executor,
        on_node_lost: Callable[[], None] = lambda: None,
        lost_post_tries: int = 3,
        log_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.transport = transport
        self.executor = executor
        self.stats = RunnerStats()
        self._on_node_lost = on_node_lost
        self._lost_post_tries = lost_post_tries
        self._done: OrderedDict[int, None] = OrderedDict()
        self._unposted: list[tuple[int, CommandResult]] = []
        self._log_every_s = log_every_s
        self._clock = clock
        self._last_warning = float("-inf")
        #: Set after kill_node: the node is lost; the runner does nothing more.
        self.stopped = False
        self._halt = threading.Event()

    def halt(self) -> None:
        """Agent shutdown: finish the command under way, start no other (thread-safe)."""
        self._halt.set()

    @property
    def unposted(self) -> int:
        return len(self._unposted)

    def done(self, command_id: int) -> bool:
        return command_id in self._done

    def step(self) -> bool:
        """One poll: post what is owed, fetch, run each new command in id order and answer it.

        Returns True when a command was carried out (the caller should poll again at once).
        """
        if self.stopped or self._halt.is_set():
            return False
        self._post_unposted()
        try:
            commands = self.transport.fetch()
            self.stats.polls += 1
        except Exception as exc:  # noqa: BLE001 - HTTP, validation, anything: try again next interval
            self.stats.failed_polls += 1
            self._warn(f"cannot fetch commands for node {self.node_id}: {_describe(exc)}")
            return False
        did = False
        for cmd in sorted(commands, key=lambda c: c.id):
            if self._halt.is_set():
                break
            if cmd.id in self._done:
                continue
            result = self._execute(cmd)
            self._remember(cmd.id)
            did = True
            self._unposted.append((cmd.id, result))
            if cmd.kind == CommandKind.KILL_NODE and result.ok:
                self._post_unposted(tries=self._lost_post_tries)
                log.warning("node %s killed by command %d: the agent stops", self.node_id, cmd.id)
                self.stopped = True
                self._on_node_lost()
                return True
            self._post_unposted()
        return did

    def _execute(self, cmd: NodeCommand) -> CommandResult:
        kind, args = cmd.kind, dict(cmd.args)
        if cmd.node_id != self.node_id:
            result = CommandResult(
                ok=False,
                message=_fit(f"command for node {cmd.node_id!r} sent to the agent of {self.node_id!r}"),
            )
        else:
            timeout = self.executor.timeout_s(kind, args)
            box: list[CommandResult] = []
            worker = threading.Thread(
                target=lambda: box.append(self.executor.run(kind, args)),
                name=f"vigil-command-{cmd.id}",
                daemon=True,
            )
            started = self._clock()
            worker.start()
            worker.join(timeout)
            if box:
                result = box[0]
            else:
                self.stats.timed_out += 1
                result = CommandResult(
                    ok=False,
                    message=f"{_kind(kind)} timed out after {timeout:g}s (it may still complete on the node)",
                )
            result.output.setdefault("duration_s", round(self._clock() - started, 3))
        self.stats.executed += 1
        if not result.ok:
            self.stats.failed_commands += 1
        (log.info if result.ok else log.warning)(
            "command %d %s %s: %s%s",
            cmd.id,
            _kind(kind),
            _summary(args),
            "ok" if result.ok else "FAILED",
            f" ({result.message})" if result.message else "",
        )
        return result

    def _remember(self, command_id: int) -> None:
        self._done[command_id] = None
        while len(self._done) > MAX_REMEMBERED:
            self._done.popitem(last=False)

    def _post_unposted(self, tries: int = 1) -> None:
        """Post owed results in command order; stop at the first failure (the rest wait for it)."""
        while self._unposted:
            command_id, result = self._unposted[0]
            if not self._post_one(command_id, result, tries):
                return
            self._unposted.pop(0)

    def _post_one(self, command_id: int, result: CommandResult, tries: int) -> bool:
        """True when the result is settled (posted, or refused for good); False: try again later."""
        error: BaseException | None = None
        for attempt in range(tries):
            if attempt:
                time.sleep(min(1.0, 0.2 * 2 ** (attempt - 1)))
            try:
                self.transport.post_result(command_id, result)
            except ApiError as exc:
                if exc.status_code in DROP_STATUSES:
                    self.stats.dropped_results += 1
                    log.error(
                        "result of command %d refused with HTTP %d (%s); dropping it",
                        command_id,
                        exc.status_code,
                        exc.detail,
                    )
                    return True
                error = exc
            except (httpx.HTTPError, ValidationError, OSError) as exc:
                error = exc
            else:
                self.stats.posted += 1
                return True
            self.stats.failed_posts += 1
        self._warn(f"cannot post the result of command {command_id}: {_describe(error)}")
        return False

    def _warn(self, message: str) -> None:
        now = self._clock()
        if now - self._last_warning >= self._log_every_s:
            log.warning("%s", message)
            self._last_warning = now
        else:
            log.debug("%s", message)

    def close(self) -> None:
        self.executor.close()


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, ApiError):
        return f"HTTP {exc.status_code}: {exc.detail}"
    return f"{type(exc).__name__}: {exc}"


def _kind(kind: str | CommandKind) -> str:
    return kind.value if isinstance(kind, CommandKind) else str(kind)


def _summary(args: Mapping[str, Any]) -> str:
    text = json.dumps(args, sort_keys=True, default=str)
    return text if len(text) <= 200 else text[:197] + "..."


class CommandLoop:
    """Steps a :class:`CommandRunner` in its own thread: every ``interval_s``, at once after a
    command was done, and stops when the runner does (kill_node)."""

    def __init__(self, runner: CommandRunner, interval_s: float = 1.0) -> None:
        self.runner = runner
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="vigil-agent-commands", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling (a command under way gets ``timeout`` to finish), then end throttles."""
        self._stop.set()
        self.runner.halt()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                log.warning("command thread still busy after %.0fs; leaving it", timeout)
        self._thread = None
        self.runner.close()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.runner.stopped:
            try:
                again = self.runner.step()
            except Exception:  # never let a surprise end command handling
                log.exception("command step failed")
                again = False
            if not again:
                self._stop.wait(self.interval_s)
