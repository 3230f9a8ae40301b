"""The agent's disk spool: batches waiting for the controller, and the batch numbering.

One file per batch, named by its sequence number, sample count and wire format
(``00000000000000000042-1500.json.gz`` for a JSON batch, ``...-1500.cols.gz`` for a columnar one,
:mod:`agent.columnar`), written atomically (temporary file, then rename), so a
crash leaves either the whole batch or nothing. The spool is bounded in bytes: making room drops
the *oldest* batches first and counts the samples lost.

The next sequence number lives in the same folder (``next_seq``) and is written *before* a number
is handed out, so an agent killed at any point never reuses a number after a restart (the
controller would take a reused number for a replay and ignore the batch). Gaps are harmless.

Files are not fsync'ed by default: the spool exists to ride out controller outages and agent
restarts (the page cache survives both), not power loss; ``fsync=True`` buys that at a cost.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{20})-(\d+)\.(json|cols)\.gz$")
#: Wire format of a spooled body -> its file suffix.
FORMATS = {"json": "json", "columnar": "cols"}
_SUFFIX_FORMAT = {v: k for k, v in FORMATS.items()}
STATE_FILE = "next_seq"
LOCK_FILE = ".lock"
TMP_PREFIX = ".tmp-"


class SpoolLockedError(RuntimeError):
    """Another agent process already uses this spool folder."""


@dataclass(frozen=True)
class SpooledBatch:
    """One batch on disk."""

    seq: int
    samples: int
    size: int
    path: Path
    #: How the body is encoded: ``json`` (a TelemetryBatch) or ``columnar``; both gzip-compressed.
    format: str = "json"

    def read(self) -> bytes:
        return self.path.read_bytes()


def batch_file_name(seq: int, samples: int, fmt: str = "json") -> str:
    return f"{seq:020d}-{samples}.{FORMATS[fmt]}.gz"


class Spool:
    """Bounded, ordered, crash-safe store of encoded batches, plus the agent's batch numbering."""

    def __init__(self, directory: str | Path, max_bytes: int = 256 << 20, fsync: bool = False) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._fsync = fsync
        #: Batches and samples removed to respect ``max_bytes`` since this spool was opened.
        self.dropped_batches = 0
        self.dropped_samples = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock()
        try:
            self._batches: list[SpooledBatch] = []
            self._seqs: list[int] = []
            self._bytes = 0
            self._scan()
            self._next_seq = self._load_next_seq()
        except BaseException:
            self.close()
            raise

    # -- opening ----------------------------------------------------------------------------------
    def _lock(self) -> int:
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLockedError(f"spool {self.directory} is in use by another agent") from None
        return fd

    def _scan(self) -> None:
        for p in self.directory.iterdir():
            if p.name.startswith(TMP_PREFIX):  # a write interrupted by a crash
                p.unlink(missing_ok=True)
                continue
            m = _NAME.match(p.name)
            if m is None:
                continue
            b = SpooledBatch(seq=int(m.group(1)), samples=int(m.group(2)), size=p.stat().st_size, path=p,
                             format=_SUFFIX_FORMAT[m.group(3)])
            self._insert(b)
        if self._batches:
            log.info(
                "spool %s holds %d batches (%d bytes) from a previous run",
                self.directory,
                len(self._batches),
                self._bytes,
            )

    def _load_next_seq(self) -> int:
        floor = self._seqs[-1] + 1 if self._seqs else 0
        path = self.directory / STATE_FILE
        try:
            stored = int(path.read_text().strip())
        except FileNotFoundError:
            return floor
        except (OSError, ValueError) as exc:
            # Unknown how far the lost counter had gone; milliseconds since the epoch exceed any
            # count of batches this agent could have sent, so numbering stays increasing.
            fallback = max(floor, time.time_ns() // 1_000_000)
            log.error("cannot read %s (%s); continuing numbering at %d", path, exc, fallback)
            return fallback
        return max(stored, floor)

    def close(self) -> None:
        """Release the folder lock (the files stay for the next run)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- numbering --------------------------------------------------------------------------------
    def allocate_seq(self) -> int:
        """The next batch number, persisted before it is returned."""
        seq = self._next_seq
        self._write_atomic(STATE_FILE, f"{seq + 1}\n".encode())
        self._next_seq = seq + 1
        return seq

    @property
    def next_seq(self) -> int:
        return self._next_seq

    # -- batches ----------------------------------------------------------------------------------
    def put(self, seq: int, body: bytes, samples: int, fmt: str = "json") -> int:
        """Store a batch encoded in ``fmt`` (``json`` or ``columnar``); return the samples lost to make room (oldest batches dropped first).

        A batch bigger than the whole spool is itself dropped (and counted).
        """
        size = len(body)
        if size > self.max_bytes:
            log.error(
                "batch %d (%d bytes) exceeds the spool bound (%d bytes): dropped", seq, size, self.max_bytes
            )
            self.dropped_batches += 1
            self.dropped_samples += samples
            return samples
        lost = 0
        while self._batches and self._bytes + size > self.max_bytes:
            old = self._batches[0]
            self.remove(old.seq)
            self.dropped_batches += 1
            self.dropped_samples += old.samples
            lost += old.samples
            log.warning("spool full: dropped batch %d (%d samples)", old.seq, old.samples)
        name = batch_file_name(seq, samples, fmt)
        self._write_atomic(name, body)
        self._insert(SpooledBatch(seq=seq, samples=samples, size=size, path=self.directory / name, format=fmt))
        return lost

    def oldest(self) -> SpooledBatch | None:
        return self._batches[0] if self._batches else None

    def remove(self, seq: int) -> None:
        i = bisect.bisect_left(self._seqs, seq)
        if i == len(self._seqs) or self._seqs[i] != seq:
            return
        b = self._batches.pop(i)
        self._seqs.pop(i)
        self._bytes -= b.size
        b.path.unlink(missing_ok=True)

    def batches(self) -> list[SpooledBatch]:
        return list(self._batches)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def samples(self) -> int:
        return sum(b.samples for b in self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    # -- helpers ----------------------------------------------------------------------------------
    def _insert(self, b: SpooledBatch) -> None:
        i = bisect.bisect_left(self._seqs, b.seq)
        if i < len(self._seqs) and self._seqs[i] == b.seq:  # same number twice: keep the new one
            old = self._batches[i]
            self._bytes -= old.size
            if old.path != b.path:
                old.path.unlink(missing_ok=True)
            self._batches[i] = b
        else:
            self._seqs.insert(i, b.seq)
            self._batches.insert(i, b)
        self._bytes += b.size

    def _write_atomic(self, name: str, data: bytes) -> None:
        tmp = self.directory / f"{TMP_PREFIX}{name}"
        with open(tmp, "wb") as f:
            f.write(data)
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)
