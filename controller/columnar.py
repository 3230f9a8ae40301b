"""Columnar telemetry ingest: decode a :class:`~vigil.contract.schemas.columnar.ColumnarBatch`, validate
it a column at a time, and store it with the same bulk writers and the same exactly-once rules as
:func:`controller.telemetry.ingest`.

Why: the JSON path builds and validates one pydantic object per sample (4-8 us each), which bounds
ingest on one core well below what the database takes. Here each column is one
``numpy.frombuffer`` of the request's bytes and each rule of the schema (range, finiteness,
strings) one vectorised check over the column, so the work per sample is a few tens of
nanoseconds before the rows go to :func:`controller.telemetry.bulk_insert`.

The rules are the schema's (:func:`vigil.contract.schemas.columnar.column_specs` reads them off
``StepSample`` / ``CollectiveSample``); a violation raises :class:`ColumnarError` naming the field
as the JSON endpoint would (``samples.collective.duration_s``) and the first offending row, and
nothing is stored. Checkpoint and fault samples and the heartbeat ride in the JSON header and take
the object path's own code.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from itertools import repeat
from typing import Annotated, Any

import msgspec
import numpy as np
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.orm import Session

from controller.host_history import HostHistoryLimits
from controller.telemetry import (
    COLLECTIVE_COLUMNS,
    LIVE_OPS,
    STEP_COLUMNS,
    Prepared,
    newest_step_lowest_rank,
    store,
)
from controller.telemetry_guard import TelemetryGuard
from vigil.contract.schemas import (
    MAX_TELEMETRY_ITEMS,
    StepSample,
    TelemetryAck,
    TelemetryBatch,
)
from vigil.contract.schemas.columnar import (
    COLUMNAR_KINDS,
    ColumnarBatch,
    ColumnBlock,
    ColumnSpec,
    column_specs,
)

log = logging.getLogger(__name__)

_DECODER = msgspec.msgpack.Decoder(ColumnarBatch)


class ColumnarError(ValueError):
    """A columnar batch that breaks a rule: ``loc`` names the field as the JSON endpoint's 422 does
    (``samples``, the kind, the field; the row is in the message)."""

    def __init__(self, loc: tuple[str | int, ...], msg: str, type_: str = "value_error") -> None:
        super().__init__(f"{'.'.join(map(str, loc))}: {msg}")
        self.loc = loc
        self.msg = msg
        self.type = type_

    def errors(self) -> list[dict[str, Any]]:
        """In the shape of pydantic's ``errors()`` (what ``RequestValidationError`` takes)."""
        return [{"type": self.type, "loc": self.loc, "msg": self.msg}]


@dataclass
class Columns:
    """The validated rows of one kind: each column as a numpy array, plus the None masks."""

    n: int
    values: dict[str, np.ndarray] = field(default_factory=dict)
    nulls: dict[str, np.ndarray] = field(default_factory=dict)

    def take(self, mask: np.ndarray) -> Columns:
        return Columns(int(mask.sum()), {k: v[mask] for k, v in self.values.items()},
                       {k: v[mask] for k, v in self.nulls.items()})


@dataclass
class DecodedBatch:
    """A columnar batch, decoded and valid: the header (rare samples, heartbeat) and the columns."""

    header: TelemetryBatch
    strings: np.ndarray  # object array: the dictionary the string columns index into
    step: Columns
    collective: Columns

    @property
    def samples(self) -> int:
        return self.step.n + self.collective.n + len(self.header.samples)


_HEADER_KINDS = ("checkpoint", "fault", "progress")


def decode(body: bytes) -> DecodedBatch:
    """Decode and validate a columnar body; raise :class:`ColumnarError` (422) or pydantic's
    ``ValidationError`` (the header's own fields, named as the JSON endpoint names them)."""
    try:
        raw = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise ColumnarError(("body",), f"not a columnar batch: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ColumnarError(("body",), f"not valid MessagePack: {exc}") from exc
    header = TelemetryBatch.model_validate_json(raw.header)
    for i, s in enumerate(header.samples):
        if s.kind not in _HEADER_KINDS:
            raise ColumnarError(("samples", i, s.kind), "step and collective samples travel as columns, not in the header")
    strings = np.empty(len(raw.strings), dtype=object)
    strings[:] = raw.strings
    step = _columns("step", raw.step, strings)
    coll = _columns("collective", raw.collective, strings)
    total = step.n + coll.n + len(header.samples)
    if total > MAX_TELEMETRY_ITEMS:
        raise ColumnarError(("samples",), f"List should have at most {MAX_TELEMETRY_ITEMS} items after validation, "
                                          f"not {total}", "too_long")
    return DecodedBatch(header, strings, step, coll)


def _columns(kind: str, block: ColumnBlock | None, strings: np.ndarray) -> Columns:
    """The columns of ``block`` as arrays, every rule of ``kind``'s schema checked once per column."""
    if block is None:
        return Columns(0)
    specs = column_specs(kind)
    where = ("samples", kind)
    n = block.n
    if not 0 <= n <= MAX_TELEMETRY_ITEMS:
        raise ColumnarError((*where,), f"n must be in [0, {MAX_TELEMETRY_ITEMS}], got {n}")
    for name in (*block.columns, *block.nulls):
        if name not in specs:
            raise ColumnarError((*where, name), "Extra inputs are not permitted", "extra_forbidden")
    out = Columns(n)
    for name, spec in specs.items():
        loc = (*where, name)
        buf = block.columns.get(name)
        if buf is None:
            if spec.required:
                raise ColumnarError(loc, "Field required", "missing")
            continue  # the field's default, filled in when rows are built
        arr = _array(loc, buf, spec.dtype, n)
        null = None
        if name in block.nulls:
            if not spec.nullable:
                raise ColumnarError(loc, "Input should not be None (a nulls mask was sent)")
            null = _array(loc, block.nulls[name], "u1", n).astype(bool)
            if not null.any():
                null = None
        if spec.type == "float" and not spec.finite and spec.nullable:
            # "None when not finite" (loss, lr, val_loss): NaN and inf are None, as JSON sends them.
            bad = ~np.isfinite(arr)
            if bad.any():
                null = bad if null is None else (null | bad)
        _check(loc, spec, arr, null, strings)
        out.values[name] = arr
        if null is not None:
            out.nulls[name] = null
    return out


def _array(loc: tuple[str | int, ...], buf: bytes, dtype: str, n: int) -> np.ndarray:
    arr = np.frombuffer(buf, dtype=dtype) if len(buf) % np.dtype(dtype).itemsize == 0 else None
    if arr is None or len(arr) != n:
        raise ColumnarError(loc, f"column holds {len(buf)} bytes, not {n} values of {dtype}")
    return arr


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check(loc: tuple[str | int, ...], spec: ColumnSpec, arr: np.ndarray, null: np.ndarray | None,
           strings: np.ndarray) -> None:
    """Every rule of ``spec`` over the whole column (rows marked None are exempt)."""
    valid = None if null is None else ~null
    if spec.type == "str":
        if len(arr) and int(arr.max()) >= len(strings):
            raise ColumnarError(loc, f"string index out of range (row {_first(arr >= len(strings))}: {int(arr.max())} "
                                     f">= {len(strings)} strings)")
        for idx in np.unique(arr).tolist():
            try:
                _string_adapter(spec).validate_python(strings[idx])
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                raise ColumnarError(loc, f"{err['msg']} (row {_first(arr == idx)})", err["type"]) from None
        return
    if spec.type == "float" and spec.finite:
        bad = ~np.isfinite(arr)
        if valid is not None:
            bad &= valid
        if bad.any():
            raise ColumnarError(loc, f"Input should be a finite number (row {_first(bad)})", "finite_number")
    for op, bound, test, word in (("ge", spec.ge, np.less, "greater than or equal to"),
                                  ("gt", spec.gt, np.less_equal, "greater than"),
                                  ("le", spec.le, np.greater, "less than or equal to"),
                                  ("lt", spec.lt, np.greater_equal, "less than")):
        if bound is None:
            continue
        bad = test(arr, bound)
        if valid is not None:
            bad &= valid
        if bad.any():
            raise ColumnarError(loc, f"Input should be {word} {bound} (row {_first(bad)})", op)


@functools.cache
def _string_adapter(spec: ColumnSpec) -> TypeAdapter[Any]:
    """A validator of one string with exactly the field's own pydantic rules (lengths, one line)."""
    return TypeAdapter(Annotated[str, *spec.metadata])  # type: ignore[valid-type]


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


def _column_list(kind: str, cols: Columns, name: str, strings: np.ndarray) -> list[Any]:
    """One column as Python values in row order (what the database driver binds), None where null."""
    spec = column_specs(kind)[name]
    arr = cols.values.get(name)
    if arr is None:
        return [spec.default] * cols.n
    values: list[Any] = strings[arr].tolist() if spec.type == "str" else arr.tolist()
    null = cols.nulls.get(name)
    if null is not None:
        for i in np.flatnonzero(null).tolist():
            values[i] = None
    return values


def rows(kind: str, cols: Columns, columns: tuple[str, ...], strings: np.ndarray, node_id: str) -> list[tuple[Any, ...]]:
    """Tuples in ``columns`` order (``node_id`` last, the batch's) for :func:`~controller.telemetry.bulk_insert`."""
    if cols.n == 0:
        return []
    lists = [_column_list(kind, cols, c, strings) for c in columns]
    return list(zip(*lists, repeat(node_id, cols.n), strict=False))


def _touched(batch: DecodedBatch) -> set[tuple[str, int]]:
    """Distinct (job, step) of the step and collective rows: what :func:`mark_dirty` flags."""
    keys = [np.unique((c.values["job_id"].astype(np.int64) << 32) | c.values["step"])
            for c in (batch.step, batch.collective) if c.n]
    if not keys:
        return set()
    u = np.unique(np.concatenate(keys))
    return set(zip(batch.strings[u >> 32].tolist(), (u & 0xFFFFFFFF).tolist(), strict=True))


def _live(cols: Columns, strings: np.ndarray, collectives: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The rows of live recovery's collectives (``LIVE_OPS``): looked up in the batch's string dictionary
    first, so a batch without any (nearly all) costs no pass over its rows."""
    if cols.n == 0:
        return []
    ids = np.flatnonzero(np.isin(strings, list(LIVE_OPS)))
    if ids.size == 0:
        return []
    return [collectives[i] for i in np.flatnonzero(np.isin(cols.values["op"], ids)).tolist()]


def _progress(batch: DecodedBatch) -> list[StepSample]:
    """Per job, the step sample its progress is read from (:func:`newest_step_lowest_rank`), from the columns."""
    c = batch.step
    if c.n == 0:
        return []
    job, step, rank = c.values["job_id"], c.values["step"], c.values["rank"]
    firsts = newest_step_lowest_rank(job, step, rank)
    loss = _column_list("step", c, "loss", batch.strings)
    return [StepSample.model_construct(job_id=batch.strings[job[i]], step=int(step[i]), rank=int(rank[i]),
                                       loss=loss[i]) for i in firsts]


# --------------------------------------------------------------------------------------------------
# Ingest
# --------------------------------------------------------------------------------------------------


def ingest_columnar(session: Session, batch: DecodedBatch, now: float | None = None,
                    host_history: HostHistoryLimits | None = None, guard: TelemetryGuard | None = None) -> TelemetryAck:
    """Store ``batch`` once, with exactly the rules of :func:`controller.telemetry.store` (which the
    JSON endpoint's :func:`~controller.telemetry.ingest` shares): the rows come from the columns."""
    hdr = batch.header
    strings = batch.strings
    used: set[int] = set()
    for c in (batch.step, batch.collective):
        if c.n:
            used |= set(np.unique(c.values["job_id"]).tolist())
    job_ids = {strings[i] for i in used} | {s.job_id for s in hdr.samples}

    def prepare(known: set[str]) -> Prepared:
        kept, others, orphans = batch, hdr.samples, 0
        if len(known) < len(job_ids):
            known_idx = np.array([i for i in used if strings[i] in known], dtype=np.uint32)
            cols = []
            for c in (batch.step, batch.collective):
                mask = np.isin(c.values["job_id"], known_idx) if c.n else np.zeros(0, bool)
                orphans += c.n - int(mask.sum())
                cols.append(c.take(mask) if c.n else c)
            kept = DecodedBatch(hdr, strings, cols[0], cols[1])
            others = [s for s in hdr.samples if s.job_id in known]
            orphans += len(hdr.samples) - len(others)
        node = hdr.node_id
        collectives = rows("collective", kept.collective, COLLECTIVE_COLUMNS, strings, node)
        return Prepared(
            steps=rows("step", kept.step, STEP_COLUMNS, strings, node),
            collectives=collectives,
            live=_live(kept.collective, strings, collectives),
            touched=_touched(kept),
            progress=_progress(kept),
            checkpoints=[s for s in others if s.kind == "checkpoint"],  # type: ignore[misc]
            faults=[s for s in others if s.kind == "fault"],  # type: ignore[misc]
            states=[s for s in others if s.kind == "progress"],  # type: ignore[misc]
            orphans=orphans,
        )

    return store(session, hdr, job_ids, prepare, now, host_history, guard)


__all__ = ["COLUMNAR_KINDS", "ColumnarError", "Columns", "DecodedBatch", "decode", "ingest_columnar", "rows"]
