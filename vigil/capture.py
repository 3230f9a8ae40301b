"""Collectives of any code, read from torch.distributed's own Flight Recorder.

Vigil's communication layer (:mod:`vigil.comm`) times and counts the collectives of Vigil's optimizers.
Everything else (DDP's gradient buckets, FSDP2's all-gathers and reduce-scatters, DTensor, a user's own
``dist.all_reduce`` on any group) is issued by torch itself, so Vigil reads what torch records: the
Flight Recorder (``TORCH_FR_BUFFER_SIZE`` entries per process, :data:`FR_BUFFER_ENV`), which torch 2.13
fills for gloo as well as for NCCL, in two recorders: NCCL's own (its entries hold CUDA events; read by
``_dump_nccl_trace``) and the one of gloo and the other backends (``_dump_fr_trace``). :func:`dump_fr`
reads the one of the world group's backend (a job on NCCL: NCCL's; Vigil's own groups are gloo, and left
out anyway). Nothing of ``torch.distributed`` is wrapped or patched.

What an entry gives (both backends): the process group, the op, dtypes and sizes, the group's collective
sequence number, the time it was enqueued (wall clock, ns) and whether it completed. NCCL adds its own
timing (CUDA events, with ``TORCH_NCCL_ENABLE_TIMING=1``): its ``duration_ms`` is the record's duration.
gloo records no start or end, and no point-to-point ops or reduce-scatters (seen on torch 2.13): a gloo
collective's duration here runs from its enqueue to the first point of the step where the rank had to
have it done (the optimizer's step, which DDP and FSDP wait for before it runs, else the step's end).
That bounds the time in flight from above; the *wait* the controller derives from it (a rank's duration
minus the fastest rank's, :mod:`controller.step_stats`) is the arrival skew, exact up to the clocks,
because every rank leaves a collective at about the same moment.

Bytes: the op and sizes give the payload; wire bytes follow the ring algorithm (as :mod:`vigil.comm`);
these records carry :data:`vigil.contract.schemas.CAPTURED_TAG`, so the API and the dashboard mark their
bytes as estimated.

Cost: a dump of the recorder costs about 10 us per entry it *holds*, new or not (measured on this
project's machine: 2.7 ms for 200 entries as JSON, 1.4 ms as pickle plus 0.6 ms to load it). So the
recorder is read when most of its buffer is new since the last read (:data:`READ_FILL`, by the rate of
the last read; half after a read found the ring had overwritten entries), at most
:data:`READ_INTERVAL_S` apart: each collective costs little more than its own entry's dump, and a job
with few collectives pays one read of a small buffer every few seconds.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vigil.comm import CollectiveRecord
from vigil.contract.schemas import CAPTURED_TAG, StepSample
from vigil.contract.settings import ENV_FR_BUFFER, FR_BUFFER_DEFAULT

log = logging.getLogger(__name__)

FR_BUFFER_ENV = ENV_FR_BUFFER
"""torch's Flight Recorder size (entries per process): :data:`vigil.contract.settings.ENV_FR_BUFFER`."""
READ_FILL = 0.8
"""Read once this share of the buffer is new (by the last read's rate of entries per step)."""
READ_SOON_S = 2.0
READ_SOON_FILL = 0.1
"""After :data:`READ_SOON_S`, read once this share of the buffer is new: steps reach the controller within
about two seconds unless their collectives are too few to pay for a read of the whole ring. (At 1 s, a job of
330 collectives a second read at half fill and paid 1.3% of its 3 ms steps: docs/BENCHMARKS.md.)"""
READ_INTERVAL_S = 5.0
"""At most this long between two reads (a step's samples wait for the read that finds its collectives)."""
SEQ_BASE = 1 << 30
"""Captured records' ``seq`` (unique within a step, the same call on every rank): ``SEQ_BASE + (pg id << 20
| the group's collective sequence number mod 2**20)``, apart from Vigil's own layer's small numbers."""

_OPS = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier", "send": "send", "recv": "recv",
}
_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
}


def buffer_size() -> int:
    """The recorder's size from the environment (0: not set, or not a number)."""
    try:
        return max(0, int(os.environ.get(FR_BUFFER_ENV, "0") or 0))
    except ValueError:
        return 0


def fr_available() -> bool:
    """Whether this process's Flight Recorder records (its size set, and torch has the dump)."""
    if buffer_size() <= 0:
        return False
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return False
    return hasattr(c10d, "_dump_fr_trace")


_nccl_world = False
"""Whether the world group was NCCL when last seen initialised (a read after the code destroyed its
group stays on the recorder it read before)."""


def _reads_nccl() -> bool:
    global _nccl_world
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _nccl_world = "nccl" in str(dist.get_backend())
    return _nccl_world


def dump_fr() -> dict[str, Any]:
    """The recorder's content (entries without stack traces, and each group's last enqueued / completed):
    NCCL's recorder when the world group is NCCL (its record ids are its own), else gloo's."""
    import torch._C._distributed_c10d as c10d

    dump = c10d._dump_nccl_trace if _reads_nccl() and hasattr(c10d, "_dump_nccl_trace") else c10d._dump_fr_trace
    return pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=False))


def op_name(profiling_name: str) -> str:
    """``gloo:all_reduce`` / ``nccl:_allgather_base`` -> Vigil's op name (``all_reduce``, ``all_gather``)."""
    name = profiling_name.split(":", 1)[-1]
    return _OPS.get(name, name[:64] or "unknown")


def group_label(process_group: Sequence[str]) -> str:
    """The group's description as torch names it (``default_pg`` is ``world``), else ``pg<name>``."""
    name, desc = (list(process_group) + ["", ""])[:2]
    if desc == "default_pg":
        return "world"
    if desc and desc != "undefined":
        return desc[:64]
    return f"pg{name}"[:64]


def _numel(sizes: Iterable[Sequence[int]]) -> int:
    total = 0
    for shape in sizes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def estimate_bytes(op: str, dtypes: Sequence[str], in_sizes: Sequence[Sequence[int]], n: int) -> tuple[int, int, int]:
    """``(payload, wire, elements)`` of one call, as :mod:`vigil.comm` counts them, from the op and sizes:
    the ring algorithm's wire bytes for a group of ``n`` (estimated: the backend may choose another)."""
    elements = _numel(in_sizes)
    payload = elements * _DTYPE_BYTES.get(dtypes[0] if dtypes else "Float", 4)
    if n <= 1 or op == "barrier":
        return payload, 0, elements
    if op == "all_reduce":
        wire = 2 * (n - 1) / n * payload
    elif op == "all_gather":
        wire = (n - 1) * payload
    elif op in ("reduce_scatter", "all_to_all"):
        wire = (n - 1) / n * payload
    else:  # broadcast, reduce, gather, scatter, send, recv: the payload once
        wire = payload
    return payload, int(wire), elements


@dataclass(slots=True)
class Entry:
    """One collective of the recorder, as Vigil uses it."""

    record_id: int
    pg_name: str
    group: str
    seq: int
    op: str
    payload_bytes: int
    wire_bytes: int
    elements: int
    created_ns: int
    done: bool
    duration_s: float | None
    """Measured by the backend (NCCL's CUDA events); None for gloo."""

    @property
    def key(self) -> int:
        """The record's ``seq``: :data:`SEQ_BASE` + (pg id << 20 | sequence number mod 2**20)."""
        pg = int(self.pg_name) if self.pg_name.isdigit() else 0
        return SEQ_BASE + ((pg & 0x3FF) << 20 | (self.seq & 0xFFFFF))


_SHAPES: dict[tuple[Any, ...], tuple[str, str, str, int, int, int]] = {}
"""(profiling name, group, dtypes, sizes, group size) -> (pg name, group label, op, payload, wire, elements):
a training loop repeats the same few calls (DDP's buckets, FSDP's gathers), so each is worked out once."""
_SHAPES_MAX = 4096


def _shape(e: dict[str, Any], group_sizes: dict[str, int], default_size: int) -> tuple[str, str, str, int, int, int]:
    pg = e.get("process_group") or ("", "")
    sizes = e.get("input_sizes") or ()
    key = (e.get("profiling_name"), tuple(pg), tuple(e.get("input_dtypes") or ()),
           tuple(tuple(s) for s in sizes), group_sizes.get(str(pg[0]), default_size))
    found = _SHAPES.get(key)
    if found is None:
        op = op_name(str(key[0] or ""))
        payload, wire, elements = estimate_bytes(op, key[2], sizes, key[4])
        found = (str(pg[0]), group_label(pg), op, payload, wire, elements)
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        _SHAPES[key] = found
    return found


def entries(dump: dict[str, Any], group_sizes: dict[str, int], default_size: int) -> list[Entry]:
    """The dump's collectives as :class:`Entry`, oldest first."""
    out = []
    for e in dump.get("entries", ()):
        pg_name, group, op, payload, wire, elements = _shape(e, group_sizes, default_size)
        ms = e.get("duration_ms")
        out.append(Entry(
            int(e.get("record_id", 0)), pg_name, group,
            int(e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id", 0)), op,
            payload, wire, elements, int(e.get("time_created_ns", 0)),
            bool(e.get("retired")) or e.get("state") == "completed",
            float(ms) / 1e3 if ms is not None else None,
        ))
    out.sort(key=lambda x: x.record_id)
    return out


@dataclass
class Window:
    """A step's span on this rank, wall clock (ns): start, the optimizer's step (None: not seen), end."""

    step: int
    start_ns: int
    optimizer_ns: int | None
    end_ns: int


def assign(found: Sequence[Entry], windows: Sequence[Window], *, before_first: int = 0) -> tuple[list[CollectiveRecord], list[Entry]]:
    """Records for the entries that fall in ``windows`` (contiguous: a step spans its start to the next
    one's; finished steps), and the entries left for later (after the last window's end).

    An entry enqueued before the first window is step ``before_first`` (a job's start-up: DDP's initial
    broadcasts), ending at that window's start.
    """
    records: list[CollectiveRecord] = []
    later: list[Entry] = []
    starts = [w.start_ns for w in windows]  # in order: a binary search per entry, not a scan of the held steps
    for e in found:
        # In a finished step's window: done by that step's boundary (the optimizer step or the end), even
        # if the recorder has not marked it retired yet (gloo retires after the waiter wakes).
        if not windows or e.created_ns >= windows[-1].end_ns:
            later.append(e)
            continue
        if e.created_ns < windows[0].start_ns:
            step, end_ns = before_first, windows[0].start_ns
        else:
            i = bisect.bisect_right(starts, e.created_ns) - 1
            w = windows[i]
            step = w.step
            if w.optimizer_ns is not None and e.created_ns < w.optimizer_ns:
                end_ns = w.optimizer_ns
            elif e.created_ns < w.end_ns:
                end_ns = w.end_ns
            else:  # between this step's end and the next one's start
                end_ns = windows[i + 1].start_ns if i + 1 < len(windows) else w.end_ns
        duration = e.duration_s if e.duration_s is not None else max(0.0, (end_ns - e.created_ns) / 1e9)
        records.append(CollectiveRecord(step, e.key, e.op, e.group, CAPTURED_TAG, e.payload_bytes, e.wire_bytes,
                                        e.elements, duration, e.created_ns / 1e9 + duration))
    return records, later


def busy_seconds(records: Iterable[CollectiveRecord]) -> float:
    """Seconds of the union of the records' spans (overlapping calls counted once)."""
    spans = sorted((r.ts - r.duration_s, r.ts) for r in records)
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def captured_times(sample: StepSample, own: list[CollectiveRecord], w: Window, marked: bool) -> dict[str, Any]:
    """A step's communication time from its captured collectives: the time the rank stood waiting before
    its optimizer step (from the last collective it enqueued before it, e.g. DDP's last bucket, to the
    optimizer step, which needs them done), plus the span of those it ran after. Taken out of an
    unmarked forward+backward, which holds DDP's wait otherwise."""
    opt_s = w.optimizer_ns / 1e9 if w.optimizer_ns is not None else None
    before = [r for r in own if opt_s is not None and r.ts - r.duration_s < opt_s]
    exposed = max(0.0, opt_s - max(r.ts - r.duration_s for r in before)) if before and opt_s is not None else 0.0
    after = busy_seconds(r for r in own if r not in before)
    update: dict[str, Any] = {"comm_s": (sample.comm_s or 0.0) + exposed + after}
    if not marked and sample.fwd_bwd_s is not None:
        update["fwd_bwd_s"] = max(0.0, sample.fwd_bwd_s - exposed)
    return update


def _group_sizes() -> dict[str, int]:
    """Size of every process group by its name (torch names groups "0", "1", ... as it makes them)."""
    import torch.distributed as dist

    try:
        return {str(name): int(pg.size()) for pg, name in dist.distributed_c10d._world.pg_names.items()}
    except Exception:  # noqa: BLE001 - sizes only refine the wire estimate; the world size stands in
        return {}


@dataclass
class CollectiveCapture:
    """Reads this rank's Flight Recorder about once a second and turns new entries into records.

    ``exclude``: names of process groups whose collectives are Vigil's own (checkpoint agreement).
    """

    world_size: int
    exclude: set[str] = field(default_factory=set)
    interval_s: float = READ_INTERVAL_S
    buffer: int = field(default_factory=lambda: buffer_size() or FR_BUFFER_DEFAULT)
    """The recorder's size: read once about half of it is new."""
    dump: Callable[[], dict[str, Any]] = dump_fr
    clock: Callable[[], float] = time.monotonic
    _last_id: int = -1
    _held: list[Entry] = field(default_factory=list)
    _last_read: float = field(default=-1e18)
    _status: dict[str, Any] = field(default_factory=dict)
    _fresh: int = 0
    reads: int = 0
    captured: int = 0
    """Entries read (new ones, not Vigil's own groups')."""
    read_s: float = 0.0
    """Reads made and the seconds they took (the capture's own cost)."""

    _per_step: float = 0.0
    lost: int = 0
    """Entries the ring overwrote before a read (their steps miss them)."""

    def due(self, steps: int = 0) -> bool:
        """Whether to read now, ``steps`` finished since the last read: :data:`READ_FILL` of the buffer new
        by the rate of the last read, :data:`READ_SOON_FILL` of it after :data:`READ_SOON_S`, or
        :attr:`interval_s` passed."""
        fill = READ_FILL if not self.lost else 0.5  # the ring overwrote entries once: read sooner
        new, waited = steps * self._per_step, self.clock() - self._last_read
        return (new >= self.buffer * fill or (waited >= READ_SOON_S and new >= self.buffer * READ_SOON_FILL)
                or waited >= self.interval_s)

    def observed(self, steps: int) -> None:
        """The last read covered ``steps`` steps: the per-step rate that times the next."""
        if steps > 0:
            self._per_step = self._fresh / steps

    def read(self) -> list[Entry]:
        """New entries since the last read (and those held back then), oldest first."""
        t = time.perf_counter()
        self._last_read = self.clock()
        try:
            raw = self.dump()
        except Exception as e:  # noqa: BLE001 - capture degrades, training goes on
            log.warning("flight recorder unreadable (%s): collectives not captured this time", e)
            return []
        self._status = dict(raw.get("pg_status") or {})
        held_ids = {h.record_id for h in self._held}
        # Only new entries and the held ones are converted: the rest of the ring was read before.
        keep = [e for e in raw.get("entries", ()) if e.get("record_id", -1) > self._last_id or e.get("record_id") in held_ids]
        if keep and self._last_id >= 0:
            first_new = min((int(e["record_id"]) for e in keep if e["record_id"] > self._last_id), default=None)
            if first_new is not None and first_new > self._last_id + 1:
                self.lost += first_new - self._last_id - 1
        now = {e.record_id: e for e in entries({"entries": keep}, _group_sizes(), self.world_size)
               if e.pg_name not in self.exclude}
        # A held entry seen again: its newer state; one gone from the ring since (a full second and a
        # buffer of newer ones later): done.
        out = {h.record_id: now.get(h.record_id) or dataclasses.replace(h, done=True) for h in self._held}
        fresh = {i: e for i, e in now.items() if i > self._last_id}
        self.captured += len(fresh)
        self._fresh = len(fresh)
        out.update(fresh)
        newest = max((int(e["record_id"]) for e in keep), default=-1)
        self._last_id = max(self._last_id, newest)
        self._held = []
        found = sorted(out.values(), key=lambda e: e.record_id)
        self.reads += 1
        self.read_s += time.perf_counter() - t
        return found

    def hold(self, later: Iterable[Entry]) -> None:
        """Keep entries for the next read (not done yet, or after the last finished step)."""
        self._held = list(later)

    def pending_ids(self) -> set[int]:
        return {e.record_id for e in self._held if not e.done}

    def status(self) -> dict[str, Any]:
        """Per process group (by name) the last enqueued and last completed sequence numbers, as of the last read."""
        return dict(self._status)
