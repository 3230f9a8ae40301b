"""Receives rank telemetry on the node's unix datagram socket.

Ranks send each datagram as a UTF-8 JSON array of sample objects (``"kind": "step"`` or
``"collective"``, see :mod:`vigil.contract.schemas`). The receiver validates them, puts the valid
samples in a bounded :class:`SampleBuffer` that the shipper drains, and remembers which process
each rank runs in so the heartbeat can report live rank processes.

A bad datagram is counted and logged; it never stops the receiver. Datagrams keep their order
(a unix datagram socket is reliable and ordered), so samples reach the buffer in the order each
rank sent them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from agent.ranksocket import Sender, bind_datagram_socket, recv_with_sender
from agent.senders import SenderJobs, WorkerRoots, process_alive, process_start_time
from vigil.contract.background import BackgroundLoop
from vigil.contract.schemas import (
    CheckpointSample,
    CollectiveSample,
    FaultSample,
    RankProcess,
    RankSample,
    StepSample,
)

log = logging.getLogger(__name__)

Sample = StepSample | CollectiveSample | CheckpointSample | FaultSample

_LIST_ADAPTER: TypeAdapter[list[Sample]] = TypeAdapter(list[RankSample])
_ITEM_ADAPTER: TypeAdapter[Sample] = TypeAdapter(RankSample)

#: Receive buffer per datagram. Ranks keep datagrams under ~60 KB; anything longer than this is
#: truncated by the kernel, fails to parse and is counted as invalid.
MAX_DATAGRAM_BYTES = 1 << 20
#: Most rank processes remembered (``Heartbeat.ranks`` holds at most 4096).
MAX_TRACKED_RANKS = 4096


class SampleBuffer:
    """Thread-safe FIFO of validated samples between the receiver and the shipper, bounded.

    When full, incoming samples are dropped (and counted in :attr:`overflow`) rather than queued
    without bound; the samples already buffered keep their order.
    """

    def __init__(self, capacity: int = 200_000, wake_at: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.overflow = 0
        #: Set when the buffer holds at least ``wake_at`` samples (a full batch is ready).
        self.wake = threading.Event()
        self._wake_at = wake_at if wake_at is not None else capacity
        self._items: deque[Sample] = deque()
        self._lock = threading.Lock()

    def put_many(self, samples: Iterable[Sample]) -> int:
        """Append samples; return how many were kept (the rest are counted as overflow)."""
        kept = 0
        with self._lock:
            for s in samples:
                if len(self._items) >= self.capacity:
                    self.overflow += 1
                    continue
                self._items.append(s)
                kept += 1
            if len(self._items) >= self._wake_at:
                self.wake.set()
        return kept

    def take(self, max_items: int) -> list[Sample]:
        """Remove and return up to ``max_items`` of the oldest samples."""
        with self._lock:
            n = min(max_items, len(self._items))
            out = [self._items.popleft() for _ in range(n)]
            if len(self._items) < self._wake_at:
                self.wake.clear()
            return out

    def put_front(self, samples: list[Sample]) -> None:
        """Give samples taken by :meth:`take` back, ahead of everything else (order kept)."""
        with self._lock:
            self._items.extendleft(reversed(samples))

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


#: Two readings of one process's start time agree to well within this (they are the same number);
#: a different start time means the pid now names another process.
_START_TIME_TOLERANCE_S = 0.05


@dataclass
class _RankSeen:
    pid: int
    last_seen: float  # tracker clock (monotonic)
    last_seen_wall: float  # unix time: compared with process start times
    started: float | None  # start time of the process when first seen: detects a reused pid
    dead_since: float | None = None  # unix time this tracker first found the process gone


class ExitWatcher:
    """When watched processes exit, to the millisecond: a Linux pidfd turns readable when its process
    ends, and one thread polls them all.

    When one rank of a worker group dies, the framework takes its peers down within a second, so
    which rank died *first* (the culprit) is decided by sub-second differences that a liveness check
    at heartbeat time cannot see. Without ``os.pidfd_open`` (not Linux, or kernels before 5.3) it
    watches nothing and callers fall back to the time they noticed the death.
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self.supported = hasattr(os, "pidfd_open")
        self._wall_clock = wall_clock
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._exited: dict[int, float] = {}  # pid -> unix time of its exit
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe() if self.supported else (-1, -1)
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, pid: int) -> None:
        if not self.supported or self._closed:
            return
        with self._lock:
            if pid in self._fds or pid in self._exited:
                return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone (its death is noticed the slow way), or not ours to watch
            return
        with self._lock:
            if pid in self._fds:
                os.close(fd)
                return
            self._fds[pid] = fd
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vigil-agent-exits", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"w")  # poll the new fd now

    def exited_at(self, pid: int) -> float | None:
        with self._lock:
            return self._exited.get(pid)

    def forget(self, pid: int) -> None:
        with self._lock:
            self._exited.pop(pid, None)
            fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        if not self.supported or self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"q")
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in [*fds, self._wake_r, self._wake_w]:
            os.close(fd)

    def _run(self) -> None:
        import select

        while not self._closed:
            with self._lock:
                by_fd = {fd: pid for pid, fd in self._fds.items()}
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _event in poller.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                now = self._wall_clock()
                with self._lock:
                    pid = by_fd[fd]
                    if self._fds.get(pid) == fd:
                        del self._fds[pid]
                        self._exited[pid] = now
                        os.close(fd)


class RankTracker:
    """Which process runs each (job_id, rank), from the ``pid`` field of step samples.

    ``start_time`` (default: psutil) is read once per new pid; when a rank's pid later names a
    process with another start time, the rank's process is gone (its pid was reused) and the
    rank is reported dead.
    """

    def __init__(
        self,
        is_alive: Callable[[int], bool] = process_alive,
        clock: Callable[[], float] = time.monotonic,
        forget_dead_after_s: float = 300.0,
        capacity: int = MAX_TRACKED_RANKS,
        start_time: Callable[[int], float | None] = process_start_time,
        wall_clock: Callable[[], float] = time.time,
        exits: ExitWatcher | None = None,
    ) -> None:
        self._exits = exits
        self._is_alive = is_alive
        self._clock = clock
        self._wall_clock = wall_clock
        self._start_time = start_time
        self._forget_after = forget_dead_after_s
        self._capacity = capacity
        self._ranks: dict[tuple[str, int], _RankSeen] = {}
        self._retired: dict[tuple[str, int, int], _RankSeen] = {}
        """Processes a rank ran in before its newest one here (a live job's replacement on this node): reported
        once dead, so that the controller sees the old one die even when its successor came at once."""
        self._lock = threading.Lock()

    def observe(self, samples: Iterable[Sample]) -> None:
        now, wall = self._clock(), self._wall_clock()
        with self._lock:
            known = {key: seen.pid for key, seen in self._ranks.items()}
        started: dict[int, float | None] = {}
        for s in samples:  # start times of new pids, read outside the lock
            if not isinstance(s, StepSample) or s.pid is None or s.pid in started:
                continue
            if known.get((s.job_id, s.rank)) != s.pid:
                started[s.pid] = self._start_time(s.pid)
                if self._exits is not None:
                    self._exits.watch(s.pid)
        with self._lock:
            for s in samples:
                if isinstance(s, StepSample) and s.pid is not None:
                    key = (s.job_id, s.rank)
                    # Re-insert so the dict stays ordered by last sight (oldest first).
                    prev = self._ranks.pop(key, None)
                    if prev is not None and prev.pid == s.pid:
                        first = prev.started
                    else:
                        first = started.get(s.pid, None)
                        if prev is not None:
                            self._retired[(s.job_id, s.rank, prev.pid)] = prev
                    self._retired.pop((s.job_id, s.rank, s.pid), None)
                    self._ranks[key] = _RankSeen(s.pid, now, wall, first)
            while len(self._ranks) > self._capacity:
                self._ranks.pop(next(iter(self._ranks)))
            while len(self._retired) > self._capacity:
                self._retired.pop(next(iter(self._retired)))

    def pids(self) -> dict[int, float]:
        """Every tracked rank pid -> unix time of its latest sample (the agent's pid rule)."""
        with self._lock:
            out: dict[int, float] = {}
            for seen in [*self._ranks.values(), *self._retired.values()]:
                out[seen.pid] = max(out.get(seen.pid, 0.0), seen.last_seen_wall)
            return out

    def _alive(self, seen: _RankSeen) -> bool:
        if not self._is_alive(seen.pid):
            return False
        if seen.started is None:
            return True
        now_started = self._start_time(seen.pid)
        return now_started is None or abs(now_started - seen.started) <= _START_TIME_TOLERANCE_S

    def processes(self) -> list[RankProcess]:
        """Every tracked rank with whether its process is alive now.

        A dead rank stays in the report for ``forget_dead_after_s`` after its last sample (so the
        controller sees the death), then is forgotten.
        """
        now = self._clock()
        with self._lock:
            items: list[tuple[tuple[str, int] | tuple[str, int, int], _RankSeen]] = [
                *self._retired.items(), *self._ranks.items()]
        out: list[RankProcess] = []
        forget: list[tuple[str, int] | tuple[str, int, int]] = []
        for key, seen in items:
            job_id, rank = key[0], key[1]
            alive = self._alive(seen)
            if not alive and now - seen.last_seen > self._forget_after:
                forget.append(key)
                continue
            if alive and len(key) == 3:
                continue  # a former process of the rank, still running: the rank is where its newest one is
            if not alive and seen.dead_since is None:
                # When the death was first seen: when a worker group dies, the rank that died first
                # is the culprit and the others were taken down after it.
                exited = self._exits.exited_at(seen.pid) if self._exits is not None else None
                seen.dead_since = exited if exited is not None else self._wall_clock()
            out.append(RankProcess(job_id=job_id, rank=rank, pid=seen.pid, alive=alive,
                                   dead_since=None if alive else seen.dead_since))
        if forget:
            with self._lock:
                for key in forget:
                    table: dict[Any, _RankSeen] = self._retired if len(key) == 3 else self._ranks
                    latest = table.get(key)  # a new sample may have come in meanwhile
                    if latest is not None and now - latest.last_seen > self._forget_after:
                        del table[key]
                        if self._exits is not None:
                            self._exits.forget(latest.pid)
        return out


@dataclass
class ReceiverStats:
    datagrams: int = 0
    invalid_datagrams: int = 0
    samples: int = 0
    invalid_samples: int = 0
    forged_samples: int = 0
    """Samples refused because they named a process other than their sender, or a job other than the one
    their sender first claimed (:meth:`Receiver.handle_datagram`)."""


class Receiver(BackgroundLoop):
    """Reads rank datagrams from the agent socket into a :class:`SampleBuffer`.

    ``step(timeout)`` handles at most one datagram (tests drive it directly); ``start()`` runs
    it in a daemon thread until ``stop()``.
    """

    def __init__(
        self,
        socket_path: Path,
        buffer: SampleBuffer,
        ranks: RankTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_every_s: float = 10.0,
        socket_group: int | None = None,
        roots: WorkerRoots | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.jobs = SenderJobs(roots)
        self.socket_group = socket_group
        self.buffer = buffer
        self.ranks = ranks if ranks is not None else RankTracker()
        self.stats = ReceiverStats()
        self._clock = clock
        self._log_every_s = log_every_s
        self._last_log = float("-inf")
        self._suppressed = 0
        self._sock: socket.socket | None = None
        self._buf = bytearray(MAX_DATAGRAM_BYTES)
        super().__init__()

    # -- life cycle -------------------------------------------------------------------------------
    def bind(self) -> None:
        if self._sock is None:
            self._sock = bind_datagram_socket(self.socket_path, group=self.socket_group)
            log.info("agent listening for rank telemetry on %s", self.socket_path)

    thread_name = "vigil-agent-receiver"

    def start(self) -> None:
        self.bind()
        super().start()

    def pause_s(self) -> float:
        return 0.1  # only after a failed pass: a pass itself waits up to 0.2 s for a datagram

    def tick(self) -> bool:
        self.step(timeout=0.2)
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, close the socket and remove the socket file."""
        super().stop(timeout)
        if self._sock is not None:
            # Take in what ranks sent before we stopped listening, so the final flush ships it
            # (bounded: ranks that keep sending must not hold up the shutdown).
            for _ in range(10_000):
                if not self.step(timeout=0):
                    break
            self._sock.close()
            self._sock = None
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass

    # -- one iteration ----------------------------------------------------------------------------
    def step(self, timeout: float | None = 0.2) -> bool:
        """Receive and handle at most one datagram; False when none arrived within ``timeout``."""
        if self._sock is None:
            raise RuntimeError("receiver is not bound")
        self._sock.settimeout(timeout)
        try:
            n, sender = recv_with_sender(self._sock, self._buf)
        except (TimeoutError, BlockingIOError):
            return False
        self.handle_datagram(bytes(self._buf[:n]), sender)
        return True

    def handle_datagram(self, data: bytes, sender: Sender | None = None) -> int:
        """Validate one datagram, buffer its valid samples; return how many were buffered.

        A datagram that is not a JSON array is invalid as a whole. In an array with some invalid
        items the valid ones are kept (one bad sample should not cost its neighbours) and the
        datagram is still counted as invalid. With the kernel's ``sender``, a step sample naming
        another process (``pid``) is refused, and so is any sample of a job other than the one its
        sender's first sample named: a rank cannot point the agent's signals at a process that is not
        its own, nor speak for two jobs; with ``roots`` (the raylet known) the job is the one Ray started
        the sender's worker for, so a process a rank spawns speaks for that rank's job or not at all,
        and a process under no Ray worker of this node is refused (all counted in ``forged_samples``).
        """
        self.stats.datagrams += 1
        try:
            samples = _LIST_ADAPTER.validate_json(data)
        except ValidationError as exc:
            samples = self._salvage(data, exc)
        if samples and sender is not None:
            samples = self._own(samples, sender)
        if samples:
            self.ranks.observe(samples)
            kept = self.buffer.put_many(samples)
            self.stats.samples += kept
            return kept
        return 0

    def _own(self, samples: list[Sample], sender: Sender) -> list[Sample]:
        mine, why = self.jobs.own(samples, sender)
        if len(mine) < len(samples):
            self.stats.forged_samples += len(samples) - len(mine)
            self._warn(f"refused {len(samples) - len(mine)} samples from pid {sender.pid} (uid {sender.uid}): {why}")
        return mine

    def _salvage(self, data: bytes, exc: ValidationError) -> list[Sample]:
        self.stats.invalid_datagrams += 1
        import json  # only on the error path

        try:
            items = json.loads(data)
        except (UnicodeDecodeError, ValueError):
            items = None
        if not isinstance(items, list):
            self._warn(f"invalid datagram ({len(data)} bytes): not a JSON array of samples")
            return []
        good: list[Sample] = []
        for item in items:
            try:
                good.append(_ITEM_ADAPTER.validate_python(item))
            except ValidationError:
                self.stats.invalid_samples += 1
        errors = exc.errors(include_url=False)
        where, what = (errors[0]["loc"], errors[0]["msg"]) if errors else ((), "")
        self._warn(
            f"invalid datagram: {len(items) - len(good)} of {len(items)} samples rejected, "
            f"first error at {where}: {what}"
        )
        return good

    def _warn(self, message: str) -> None:
        # Rate-limited: a misbehaving rank may send thousands per second.
        now = self._clock()
        if now - self._last_log >= self._log_every_s:
            extra = f" ({self._suppressed} similar suppressed)" if self._suppressed else ""
            log.warning("%s; %d invalid datagrams so far%s", message, self.stats.invalid_datagrams, extra)
            self._last_log = now
            self._suppressed = 0
        else:
            self._suppressed += 1
