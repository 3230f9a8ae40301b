"""Rank-side telemetry: step, collective and checkpoint samples sent to the node agent, never blocking training.

Transport: a non-blocking unix datagram socket (``AF_UNIX``/``SOCK_DGRAM``) addressed to the agent's
socket path (:func:`vigil.contract.settings.agent_socket_path`). Datagrams keep message boundaries (no
framing) and a send either goes into the kernel queue at once or fails at once: a dead or slow agent
costs the training step a failed syscall, never a wait.

Nothing lost to an agent that restarts: the rank keeps its datagrams in a bounded backlog
(:data:`BACKLOG_BYTES`). One the agent could not take (absent: ``ENOENT``, ``ECONNREFUSED``; busy:
``EAGAIN``, ``ENOBUFS``; Linux queues only ``net.unix.max_dgram_qlen`` datagrams per socket, 10 by
default) waits there and goes out, in order, at the next send that finds the agent. One the agent
took stays :data:`REPLAY_WINDOW_S` seconds: an agent killed (``kill -9``) before its batch reached
the controller or its disk spool loses what it held in memory, so when the agent's socket is a new
one (another inode or creation time: the agent restarted) the rank sends the window again. Re-sent samples the
controller already has cost nothing: it stores each sample once, by its key (job, rank, step, run
attempt[, call seq]).

Wire format: every datagram is a UTF-8 JSON array of sample objects (``StepSample`` /
``CollectiveSample`` / ``CheckpointSample`` as dicts, each carrying its ``kind``), at most
:data:`MAX_DATAGRAM_BYTES`.
Larger lists are split across datagrams.

Loss accounting: samples are dropped only when the backlog is full of undelivered ones (the oldest
go first), or when one cannot be encoded or alone exceeds a datagram; they are counted, and the count
rides in the ``dropped`` field of the next ``StepSample`` sent (lost again if that one is dropped).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

from pydantic import ValidationError

from vigil.contract.schemas import CheckpointSample, CollectiveSample, FaultSample, ProgressSample, StepSample

if TYPE_CHECKING:  # a type only: the job's driver checks job ids here and loads no torch (vigil/ray_backend.py)
    from vigil.comm import CollectiveRecord

log = logging.getLogger(__name__)

TELEMETRY_ENV = "VIGIL_TELEMETRY"
"""``VIGIL_TELEMETRY=off`` turns every :class:`RankTelemetry` into a no-op (nothing built, sent or
counted): how a job runs without telemetry, e.g. to measure what it costs (``vigil bench overhead``)."""


def telemetry_enabled() -> bool:
    """False when ``VIGIL_TELEMETRY`` says off (``off``, ``0``, ``false``, ``no``)."""
    return os.environ.get(TELEMETRY_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


MAX_DATAGRAM_BYTES = 60_000
"""Largest datagram sent; well under Linux's default unix socket send buffer (~208 KiB)."""
BACKLOG_BYTES = 8 << 20
"""Most bytes of datagrams a rank keeps (undelivered ones, and delivered ones in the replay window)."""
REPLAY_WINDOW_S = 30.0
"""How long a delivered datagram is kept to be sent again should the agent turn out to have restarted:
longer than the agent holds samples before they are safe (its batch interval plus a post)."""
SEND_BUFFER_BYTES = 1 << 20
"""Send buffer asked for (capped by ``net.core.wmem_max``). A unix datagram stays charged to the
sender until the agent reads it, so the default ~208 KiB holds only three full datagrams; 1 MiB
lets a step with many collectives go out in one burst. Still a fixed kernel bound, not a queue."""

DRAIN_S = 5.0
"""How long closing waits for a busy agent to take the datagrams not yet delivered (the last steps of a
rank that ends while its agent's queue is full would otherwise go nowhere). No agent: no wait."""
AGENT_RETURN_S = 15.0
"""How long closing waits for an agent to listen again when the one this rank spoke to is gone (``vigil
up``'s keeper and the Ray-deployed agents start a dead agent again within seconds)."""

# Errors that mean "no agent right now" or "agent busy": expected, counted, not logged each time.
_EXPECTED_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})


def _locked(fn: Any) -> Any:
    """One caller at a time (the training thread, and the watcher thread while steps stall)."""
    def wrapper(self: RankTelemetry, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)
    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


class TelemetrySink(Protocol):
    """What the train loop needs from telemetry (fakes in tests implement this)."""

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None: ...

    def send_checkpoint(self, sample: CheckpointSample) -> None: ...

    def close(self) -> None: ...

    # Optional: ``send_fault(sample: FaultSample)``, the step an injected fault hit (RankTelemetry has
    # it; a sink without it only leaves the fault's ``hit_step`` unknown).


class NullTelemetry:
    """A sink that discards everything (telemetry disabled)."""

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        return None

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        return None

    def send_fault(self, sample: FaultSample) -> None:
        return None

    def send_progress(self, sample: ProgressSample) -> None:
        return None

    def close(self) -> None:
        return None


def check_job_id(job_id: str) -> str:
    """``job_id`` if the wire schema accepts it in a sample, else ``ValueError`` naming the rule.

    Checked once at the edge (driver, rank context), so the loop never builds a sample that fails
    validation in the middle of training.
    """
    try:
        StepSample(job_id=job_id, rank=0, step=0, ts=0.0, loss=None, step_time_s=0.0)
    except ValidationError as e:
        raise ValueError(f"job id {job_id!r} is not usable in telemetry: {e.errors()[0]['msg']}") from None
    return job_id


def finite_or_none(x: float | None) -> float | None:
    """``x`` when it is a finite number, else None (NaN/inf loss is data for the detectors, not JSON): done
    once on the rank, by the session (:mod:`vigil.rank.session`), for the values it keeps and sends."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def collective_samples(
    records: Sequence[CollectiveRecord], *, job_id: str, rank: int, attempt: int = 0
) -> list[CollectiveSample]:
    """The communication layer's records as wire samples (of run attempt ``attempt``)."""
    return [
        CollectiveSample(
            job_id=job_id,
            rank=rank,
            step=r.step,
            attempt=attempt,
            seq=r.seq,
            op=r.op,
            group=r.group,
            tag=r.tag,
            payload_bytes=r.payload_bytes,
            wire_bytes=r.wire_bytes,
            elements=r.elements,
            duration_s=max(0.0, r.duration_s),
            ts=r.ts,
        )
        for r in records
    ]


def encode(item: dict[str, Any]) -> bytes:
    """One sample as compact JSON (NaN/inf refused: they are not JSON)."""
    return json.dumps(item, separators=(",", ":"), allow_nan=False).encode("utf-8")


def pack(encoded: Sequence[bytes], limit: int = MAX_DATAGRAM_BYTES) -> tuple[list[tuple[bytes, list[int]]], list[int]]:
    """Group encoded samples into JSON-array datagrams of at most ``limit`` bytes, keeping their order.

    Returns ``(datagrams, oversize)``: each datagram with the indices of the samples it holds, and
    the indices of samples that alone exceed ``limit`` (left out).
    """
    datagrams: list[tuple[bytes, list[int]]] = []
    oversize: list[int] = []
    current: list[int] = []
    size = 2  # the brackets

    def flush() -> None:
        datagrams.append((b"[" + b",".join(encoded[i] for i in current) + b"]", list(current)))

    for i, enc in enumerate(encoded):
        if len(enc) + 2 > limit:
            oversize.append(i)
            continue
        if current and size + 1 + len(enc) > limit:
            flush()
            current, size = [], 2
        size += len(enc) + (1 if current else 0)  # the comma between items
        current.append(i)
    if current:
        flush()
    return datagrams, oversize


OFFER_S = 0.5
"""How long :meth:`RankTelemetry.offer` keeps trying, per call."""


class RankTelemetry:
    """Sends a rank's samples to its node agent. Never blocks, never raises into the caller."""

    def __init__(self, socket_path: str | Path, *, max_datagram_bytes: int = MAX_DATAGRAM_BYTES,
                 backlog_bytes: int = BACKLOG_BYTES, replay_window_s: float = REPLAY_WINDOW_S) -> None:
        self.socket_path = str(socket_path)
        self.max_datagram_bytes = max_datagram_bytes
        self.dropped = 0
        """Samples dropped and not yet reported in a delivered StepSample."""
        self.dropped_total = 0
        """Samples dropped since this object was created."""
        self.sent_total = 0
        """Samples delivered to the agent's socket since this object was created (a replayed one again)."""
        self.replays = 0
        """Times the replay window was sent again to a restarted agent."""
        self.backlog_bytes = backlog_bytes
        self.replay_window_s = replay_window_s
        # [datagram, samples in it, drops it carries, monotonic time delivered]; the last `_unsent`
        # entries are not delivered yet, the ones before them are (kept for a replay).
        self._backlog: deque[list[Any]] = deque()
        self._backlog_bytes = 0
        self._unsent = 0
        self._agent_inode: tuple[int, int] | None = None
        self.enabled = telemetry_enabled()
        """False under ``VIGIL_TELEMETRY=off``: every call returns at once."""
        self._warned: set[int] = set()
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:  # a smaller buffer only means more drops under bursts
                pass
        except OSError as e:  # no AF_UNIX (exotic platform): telemetry degrades to counting drops
            log.warning("telemetry disabled, cannot create unix datagram socket: %s", e)

    # ----------------------------------------------------------------------------------------------

    def _sendto(self, datagram: bytes) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto(datagram, self.socket_path)
            return True
        except OSError as e:
            code = e.errno or -1
            if code not in _EXPECTED_ERRNOS and code not in self._warned:
                # Unexpected (path too long, EMSGSIZE, ...): say so once per errno, then only count.
                self._warned.add(code)
                log.warning("telemetry to %s failing (%s); dropping samples", self.socket_path, e)
            return False

    @_locked
    def send(self, samples: Sequence[StepSample | CollectiveSample | CheckpointSample | dict[str, Any]]) -> int:
        """Queue ``samples`` in as few datagrams as fit and send what the agent will take now (these and
        any backlog, oldest first); returns how many samples were delivered by this call.

        The first ``StepSample`` of the list carries the pending drop count. A sample goes as it was built:
        a model's non-finite loss is None already; a plain dict holding a non-finite number cannot be
        encoded (JSON without NaN) and is dropped and counted.
        """
        if not self.enabled:
            return 0
        items: list[dict[str, Any]] = []
        carried = 0
        for s in samples:
            # A sample's non-finite loss, lr, val_loss became None when it was built (``Observed`` in the schema;
            # the session did it once already for the values it keeps): nothing to redo here.
            d = dict(s) if isinstance(s, dict) else s.model_dump(mode="json")
            if d.get("kind") == "step" and not carried and self.dropped:
                carried, self.dropped = self.dropped, 0
                d["dropped"] = carried
            items.append(d)
        encoded: list[bytes] = []
        for d in items:
            try:
                encoded.append(encode(d))
            except (TypeError, ValueError) as e:  # unserialisable sample: a bug, but not the step's problem
                log.warning("telemetry: cannot encode a %s sample: %s", d.get("kind"), e)
                self._drop(1)
        datagrams, oversize = pack(encoded, self.max_datagram_bytes)
        if oversize:
            log.warning("telemetry: %d sample(s) over %d bytes dropped", len(oversize), self.max_datagram_bytes)
            self._drop(len(oversize))
        for dg, idx in datagrams:
            self._queue(dg, len(idx), carried)
            carried = 0  # the first datagram holds the carrier
        return self.flush()

    def _queue(self, datagram: bytes, count: int, carried: int) -> None:
        """Add a datagram at the backlog's end; make room by forgetting the oldest (counted if undelivered)."""
        backlog = self._backlog
        backlog.append([datagram, count, carried, 0.0])
        self._backlog_bytes += len(datagram)
        self._unsent += 1
        while self._backlog_bytes > self.backlog_bytes and len(backlog) > 1:
            old = backlog.popleft()
            self._backlog_bytes -= len(old[0])
            if len(backlog) < self._unsent:  # it was never delivered
                self._unsent -= 1
                self._drop(old[1] + old[2])  # its samples, and the drops it was carrying

    @_locked
    def flush(self) -> int:
        """Send the backlog's undelivered datagrams, oldest first, until the agent takes no more; the
        whole replay window again when the agent's socket is a new one. Returns samples delivered."""
        backlog = self._backlog
        now = time.monotonic()
        while len(backlog) > self._unsent and now - backlog[0][3] > self.replay_window_s:
            self._backlog_bytes -= len(backlog.popleft()[0])  # delivered long enough ago: safe
        if not self._unsent and not backlog:
            return 0
        try:
            st = os.stat(self.socket_path)
            inode: tuple[int, int] | None = (st.st_ino, st.st_ctime_ns)  # an inode number is soon reused
        except OSError:
            inode = None  # no agent: the sends below fail and keep the backlog
        if inode is not None and self._agent_inode is not None and inode != self._agent_inode:
            self._unsent = len(backlog)  # a new agent: what the old one held may be gone
            self.replays += 1
        delivered = 0
        first = len(backlog) - self._unsent
        for i in range(first, len(backlog)):
            entry = backlog[i]
            if not self._sendto(entry[0]):
                break
            entry[3] = now
            self._unsent -= 1
            delivered += entry[1]
            if inode is not None:
                self._agent_inode = inode
        self.sent_total += delivered
        return delivered

    def offer(self, for_s: float = OFFER_S) -> int:
        """Offer the agent what it could not take at once, for up to ``for_s``, the lock held only while
        sending: the rank's watcher thread, once a second (:mod:`vigil.rank.watch`). A burst (the steps held
        for their captured collectives) fills a unix datagram queue (``net.unix.max_dgram_qlen``, 10 by
        default); the rest waits for the next send, which a stall delays: a hang's report queued behind the
        held steps never reached the controller in CI. Returns the datagrams still unsent."""
        deadline = time.monotonic() + for_s
        while self._unsent and self._sock is not None:
            self.flush()
            if not self._unsent or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return self._unsent

    @property
    def unsent(self) -> int:
        """Datagrams the agent has not taken yet (its socket's queue was full, or it is away): they go with
        the next send, or :meth:`flush`."""
        return self._unsent

    def _drop(self, n: int) -> None:
        self.dropped += n
        self.dropped_total += n

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        """One step: its ``StepSample`` first, then one ``CollectiveSample`` per communication record."""
        if not self.enabled:  # before building the collective samples: off costs nothing
            return
        self.send([sample, *collective_samples(records, job_id=sample.job_id, rank=sample.rank, attempt=sample.attempt)])

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        """A checkpoint sample (rank 0, once a checkpoint is complete or found invalid)."""
        self.send([sample])

    @_locked
    def send_fault(self, sample: FaultSample) -> None:
        """An injected fault this rank is about to carry out (the step it hit), sent at once after any
        backlog. Sent even with telemetry off: it is the fault's record, not a measurement."""
        self._queue(b"[" + encode(sample.model_dump()) + b"]", 1, 0)  # a datagram is a JSON array
        self.flush()

    @_locked
    def send_progress(self, sample: ProgressSample) -> None:
        """Where this rank stands in its collectives while its steps stall (the watcher thread's; see
        :mod:`vigil.rank.watch`). Sent even with telemetry off: a hang's diagnosis needs it."""
        self._queue(b"[" + encode(sample.model_dump(mode="json")) + b"]", 1, 0)
        self.flush()

    @_locked
    def drain(self, timeout_s: float = DRAIN_S, return_s: float = AGENT_RETURN_S) -> int:
        """Send what is not delivered yet, waiting up to ``timeout_s`` while the agent is there but busy
        (its queue full); at once if there never was an agent; up to ``return_s`` for the successor of
        an agent this rank spoke to that is gone (it comes back within seconds), which then gets the replay
        window, delivered or not. Returns the samples still undelivered."""
        start = found = time.monotonic()
        self.flush()
        while self._sock is not None and (self._unsent or self._agent_gone()):
            now = time.monotonic()
            if self._unsent and self._agent_takes():
                if now - found >= timeout_s:
                    break  # there, but it takes nothing
                time.sleep(0.01)
            elif self._agent_inode is not None and now - start < return_s:
                time.sleep(0.1)  # the agent died: wait for the one started in its place
                found = time.monotonic()
            else:
                break  # no agent ever, or none came back
            self.flush()
        return sum(entry[1] for entry in list(self._backlog)[len(self._backlog) - self._unsent:])

    def _agent_gone(self) -> bool:
        """Whether the agent this rank's replay window went to is gone (its socket refuses, or is another's,
        or none): what it took last may have died with it (CI: a rank that had sent its every step ended
        while its agent, killed with ``kill -9``, was being started again; its last steps never arrived)."""
        if self._agent_inode is None or not self._backlog:
            return False
        try:
            st = os.stat(self.socket_path)
        except OSError:
            return True
        return (st.st_ino, st.st_ctime_ns) != self._agent_inode or not self._agent_takes()

    def _agent_takes(self) -> bool:
        """Whether the agent's socket accepts connections at all (False: refused, a stale file)."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(self.socket_path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    @_locked
    def close(self) -> None:
        """Deliver what is left (:meth:`drain`), then close the socket."""
        if self._sock is not None:
            left = self.drain() if self.enabled else 0
            if left:
                log.warning("telemetry: %d sample(s) not delivered to the agent at close", left)
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
