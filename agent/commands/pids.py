"""Processes the agent looks at, signals or starts.

Owns process liveness and state (:func:`live_process`, waiting for a process to exit or stop),
descendants and session members, the pids no command may signal (:func:`protected_pids`), signal
names (:func:`parse_signal`) and the environment of the processes the agent starts (secrets
removed).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable

import psutil

from vigil.contract.settings import SECRET_ENVS, child_env

#: agent's token to every Ray worker); the same list `vigil up` keeps out of Ray's environment.
SECRET_ENV = SECRET_ENVS

_STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
_GONE_STATES = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


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



def _child_env() -> dict[str, str]:
    """A raylet's environment when the agent starts one again (its workers are ranks): the allowlist of
    :func:`vigil.contract.settings.child_env`, not the agent's own (its token, VIGIL_HOME, the database URL)."""
    return child_env()
