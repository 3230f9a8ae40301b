"""Rank-side telemetry: step, collective and checkpoint samples sent to the node agent, never blocking training.

Transport: a non-blocking unix datagram socket (``AF_UNIX``/``SOCK_DGRAM``) addressed to the agent's
socket path (:func:`controller.settings.agent_socket_path`). Datagrams keep message boundaries (no
framing) and a send either goes into the kernel queue at once or fails at once; nothing is queued in
the rank, so a dead or slow agent costs the training step one failed syscall and never memory.

Wire format: every datagram is a UTF-8 JSON array of sample objects (``StepSample`` /
``CollectiveSample`` / ``CheckpointSample`` as dicts, each carrying its ``kind``), at most
:data:`MAX_DATAGRAM_BYTES`.
Larger lists are split across datagrams.

Loss accounting: when the agent is absent (``ENOENT``, ``ECONNREFUSED``) or its queue is full
(``EAGAIN``, ``ENOBUFS``; Linux queues only ``net.unix.max_dgram_qlen`` datagrams per socket,
10 by default), the samples are dropped and counted. The count rides in the ``dropped`` field of
the next ``StepSample`` that gets through, and restarts from zero once delivered.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, Self

from pydantic import ValidationError

from controller.schemas import CheckpointSample, CollectiveSample, StepSample
from trainer.comm import CollectiveRecord

log = logging.getLogger(__name__)

TELEMETRY_ENV = "VIGIL_TELEMETRY"
"""``VIGIL_TELEMETRY=off`` turns every :class:`RankTelemetry` into a no-op (nothing built, sent or
counted): how a job runs without telemetry, e.g. to measure what it costs (``vigil bench overhead``)."""


def telemetry_enabled() -> bool:
    """False when ``VIGIL_TELEMETRY`` says off (``off``, ``0``, ``false``, ``no``)."""
    return os.environ.get(TELEMETRY_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


MAX_DATAGRAM_BYTES = 60_000
"""Largest datagram sent; well under Linux's default unix socket send buffer (~208 KiB)."""
SEND_BUFFER_BYTES = 1 << 20
"""Send buffer asked for (capped by ``net.core.wmem_max``). A unix datagram stays charged to the
sender until the agent reads it, so the default ~208 KiB holds only three full datagrams; 1 MiB
lets a step with many collectives go out in one burst. Still a fixed kernel bound, not a queue."""

# Errors that mean "no agent right now" or "agent busy": expected, counted, not logged each time.
_EXPECTED_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})


class TelemetrySink(Protocol):
    """What the train loop needs from telemetry (fakes in tests implement this)."""

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None: ...

    def send_checkpoint(self, sample: CheckpointSample) -> None: ...

    def close(self) -> None: ...


class NullTelemetry:
    """A sink that discards everything (telemetry disabled)."""

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        return None

    def send_checkpoint(self, sample: CheckpointSample) -> None:
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
    """``x`` when it is a finite number, else None (NaN/inf loss is data for the detectors, not JSON)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def collective_samples(
    records: Sequence[CollectiveRecord], *, job_id: str, rank: int
) -> list[CollectiveSample]:
    """The communication layer's records as wire samples."""
    return [
        CollectiveSample(
            job_id=job_id,
            rank=rank,
            step=r.step,
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


class RankTelemetry:
    """Sends a rank's samples to its node agent. Never blocks, never raises into the caller."""

    def __init__(self, socket_path: str | Path, *, max_datagram_bytes: int = MAX_DATAGRAM_BYTES) -> None:
        self.socket_path = str(socket_path)
        self.max_datagram_bytes = max_datagram_bytes
        self.dropped = 0
        """Samples dropped and not yet reported in a delivered StepSample."""
        self.dropped_total = 0
        """Samples dropped since this object was created."""
        self.sent_total = 0
        """Samples delivered to the agent's socket since this object was created."""
        self.enabled = telemetry_enabled()
        """False under ``VIGIL_TELEMETRY=off``: every call returns at once."""
        self._warned: set[int] = set()
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

    def send(self, samples: Sequence[StepSample | CollectiveSample | CheckpointSample | dict[str, Any]]) -> int:
        """Send ``samples`` in as few datagrams as fit; returns how many were delivered.

        The first ``StepSample`` of the list carries the pending drop count; the count is cleared
        only if the datagram holding it is delivered.
        """
        if not self.enabled:
            return 0
        items: list[dict[str, Any]] = []
        carrier = -1
        for s in samples:
            d = dict(s) if isinstance(s, dict) else s.model_dump(mode="json")
            if d.get("kind") in ("step", "checkpoint"):
                d["loss"] = finite_or_none(d.get("loss"))
            if d.get("kind") == "step":
                d["val_loss"] = finite_or_none(d.get("val_loss"))
                if carrier < 0:
                    carrier = len(items)
                    d["dropped"] = self.dropped
            items.append(d)
        carried = self.dropped if carrier >= 0 else 0
        encoded: list[bytes] = []
        origin: list[int] = []  # index in `items` of each encoded sample
        for i, d in enumerate(items):
            try:
                encoded.append(encode(d))
                origin.append(i)
            except (TypeError, ValueError) as e:  # unserialisable sample: a bug, but not the step's problem
                log.warning("telemetry: cannot encode a %s sample: %s", d.get("kind"), e)
                self._drop(1)
        datagrams, oversize = pack(encoded, self.max_datagram_bytes)
        if oversize:
            log.warning("telemetry: %d sample(s) over %d bytes dropped", len(oversize), self.max_datagram_bytes)
            self._drop(len(oversize))
        delivered = 0
        for dg, idx in datagrams:
            if self._sendto(dg):
                delivered += len(idx)
                self.sent_total += len(idx)
                if carrier >= 0 and any(origin[j] == carrier for j in idx):
                    self.dropped -= carried
            else:
                self._drop(len(idx))
        return delivered

    def _drop(self, n: int) -> None:
        self.dropped += n
        self.dropped_total += n

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        """One step: its ``StepSample`` first, then one ``CollectiveSample`` per communication record."""
        if not self.enabled:  # before building the collective samples: off costs nothing
            return
        self.send([sample, *collective_samples(records, job_id=sample.job_id, rank=sample.rank)])

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        """A checkpoint sample (rank 0, once a checkpoint is complete or found invalid)."""
        self.send([sample])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
