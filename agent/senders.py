"""Who a rank datagram's sender is: its Ray worker, the job Ray started that worker for, and so which
samples it may send (:class:`SenderJobs`, used by :class:`agent.receiver.Receiver`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from agent.ranksocket import Sender


def process_alive(pid: int) -> bool:
    """True when ``pid`` is a live process: a zombie (or missing pid) is dead, a stopped one
    (state T: a hung or throttled rank) is alive - a hang is not a death."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        # AccessDenied cannot happen for status() on Linux; be safe and fall back on existence.
        return psutil.pid_exists(pid) if pid > 0 else False


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (unix time, as psutil computes it: stable for one process), or None."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, ValueError, OSError):
        return None



@dataclass(frozen=True, slots=True)
class Worker:
    """The Ray worker a sender belongs to, and the Vigil job Ray started it for (None: not said)."""

    pid: int
    start: float
    job: str | None


def _job_in_environ(pid: int, name: bytes = b"VIGIL_JOB_ID=") -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(1 << 20)
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(name):
            return item[len(name):].decode("utf-8", "replace") or None
    return None


class WorkerRoots:
    """Which Ray worker a sender belongs to (its nearest ancestor that the node's raylet started) and
    for which job Ray started it.

    Ray runs every rank, driver and job supervisor in a worker process forked by the raylet, and a
    worker serves one Ray job for its whole life; a process a rank spawns (torchrun's children, a
    helper) stays below it. The job is the ``VIGIL_JOB_ID`` that Ray put in the environment the
    worker (or, for a driver, the driver under its supervisor) was started with: the highest process
    of the chain that has one, read once from ``/proc`` when the sender is first seen. So a process
    spawned inside job A's rank speaks for A or not at all, and a process that left the tree (double
    fork, reparented to init) or runs beside another raylet is no process of a Ray worker on this
    node and is refused. ``raylet`` returns the raylet's pid or None when it is unknown (then each
    sender stands for itself, bound to the first job it names).
    """

    def __init__(self, raylet: Callable[[], int | None], max_depth: int = 64) -> None:
        self._raylet = raylet
        self._max_depth = max_depth
        self._cache: dict[tuple[int, float], Worker | None] = {}

    def root(self, pid: int) -> Worker | None | bool:
        """The sender's worker; None: not under the raylet; False: the raylet is unknown."""
        raylet = self._raylet()
        if raylet is None:
            return False
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
        except psutil.Error:
            return None
        if key in self._cache:
            return self._cache[key]
        found: Worker | None = None
        chain: list[int] = []
        try:
            for _ in range(self._max_depth):
                chain.append(proc.pid)
                parent = proc.ppid()
                if parent == raylet:
                    job = next(filter(None, map(_job_in_environ, reversed(chain))), None)
                    found = Worker(proc.pid, proc.create_time(), job)
                    break
                if parent <= 1:
                    break
                proc = psutil.Process(parent)
        except psutil.Error:
            found = None
        if len(self._cache) >= 4096:
            self._cache.clear()
        self._cache[key] = found
        return found


class CachedRaylet:
    """The raylet's pid for :class:`WorkerRoots`, found again at most every ``every_s`` once lost."""

    def __init__(self, find: Callable[[], int | None], every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._find, self._every_s, self._clock = find, every_s, clock
        self._proc: psutil.Process | None = None
        self._next = float("-inf")

    def __call__(self) -> int | None:
        if self._proc is not None and self._proc.is_running():
            return self._proc.pid
        self._proc = None
        now = self._clock()
        if now >= self._next:
            self._next = now + self._every_s
            try:
                pid = self._find()
                self._proc = psutil.Process(pid) if pid is not None else None
            except Exception:  # noqa: BLE001 - a lookup failure leaves the raylet unknown until the next try
                self._proc = None
        return self._proc.pid if self._proc is not None else None


class SenderJobs:
    """Which job each sender may speak for (:meth:`own`), by its Ray worker where ``roots`` knows the raylet."""

    def __init__(self, roots: WorkerRoots | None = None, max_tracked: int = 4096) -> None:
        self.roots = roots
        self._max_tracked = max_tracked
        self._jobs_of: dict[int, tuple[str, float | None]] = {}  # worker (or sender) pid -> (its job, start)

    def own(self, samples: Sequence[Any], sender: Sender) -> tuple[list[Any], str]:
        """The samples ``sender`` may send, and why the rest were refused."""
        root = self.roots.root(sender.pid) if self.roots is not None else False
        if root is None:
            return [], "it is no process of a Ray worker under this node's raylet"
        # The job: the one Ray started the sender's worker for; else bound to the worker (or, the raylet
        # unknown, to the sender) by the first job it names.
        bound = isinstance(root, Worker)
        key, start = (root.pid, root.start) if isinstance(root, Worker) else (sender.pid, None)
        known = self._jobs_of.get(key)
        if isinstance(root, Worker) and root.job is not None:
            known = (root.job, root.start)
        elif (known is not None and known[0] != samples[0].job_id
                and (start if bound else process_start_time(key)) != known[1]):
            known = None  # the pid names a new process now
        if known is None:
            if len(self._jobs_of) >= self._max_tracked:  # forget senders that are gone
                self._jobs_of = {p: j for p, j in self._jobs_of.items() if process_alive(p)}
            known = self._jobs_of[key] = (samples[0].job_id, start if bound else process_start_time(key))
        job = known[0]
        mine = [s for s in samples if s.job_id == job and getattr(s, "pid", None) in (None, sender.pid)]
        bad = next((s for s in samples if s not in mine), None)
        why = "" if bad is None else (f"they name pid {getattr(bad, 'pid', None)} of job {bad.job_id!r}, the "
                                      f"sender is pid {sender.pid} of job {job!r}")
        return mine, why
