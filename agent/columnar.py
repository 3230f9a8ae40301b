"""Encodes a batch of samples in the columnar wire format (:mod:`vigil.contract.schemas.columnar`).

Step and collective samples become one array per field (strings as indices into the batch's
dictionary); checkpoints, faults and the heartbeat ride in the JSON header. The controller decodes
the arrays without building an object per sample, so a batch costs it a fraction of the JSON one.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

from vigil.contract.schemas import Heartbeat, TelemetryBatch
from vigil.contract.schemas.columnar import COLUMNAR_KINDS, ColumnarBatch, ColumnBlock, column_specs

_ENCODER = msgspec.msgpack.Encoder()


class StringTable:
    """The batch's dictionary of strings: each distinct string once, columns hold its index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def ids(self, values: Sequence[str]) -> np.ndarray:
        index = self.index
        return np.fromiter((index.setdefault(v, len(index)) for v in values), dtype="<u4", count=len(values))

    @property
    def strings(self) -> list[str]:
        return list(self.index)


def block(kind: str, samples: Sequence[Any], table: StringTable) -> ColumnBlock:
    """The samples of one ``kind`` (all of that kind) as a :class:`ColumnBlock`.

    Columns that equal the field's default in every row are left out (the controller fills the
    default in); None becomes a ``nulls`` mask.
    """
    specs = column_specs(kind)
    names = list(specs)
    n = len(samples)
    out = ColumnBlock(n=n)
    if n == 0:
        return out
    values = list(zip(*map(attrgetter(*names), samples), strict=True))
    for name, col in zip(names, values, strict=True):
        spec = specs[name]
        if not spec.required and all(v == spec.default for v in col) and (spec.default is not None or
                                                                          all(v is None for v in col)):
            continue
        if spec.type == "str":
            out.columns[name] = table.ids(col).tobytes()
            continue
        if spec.nullable and None in col:
            mask = np.fromiter((v is None for v in col), dtype=bool, count=n)
            out.nulls[name] = mask.astype("u1").tobytes()
            col = tuple(0 if v is None else v for v in col)
        out.columns[name] = np.asarray(col, dtype=spec.dtype).tobytes()
    return out


def encode(agent_id: str, node_id: str, seq: int, sent_at: float, samples: Sequence[Any],
           heartbeat: Heartbeat | None = None) -> bytes:
    """The MessagePack body of one columnar batch (uncompressed)."""
    by_kind: dict[str, list[Any]] = {k: [] for k in COLUMNAR_KINDS}
    rare: list[Any] = []
    for s in samples:
        (by_kind.get(s.kind, rare)).append(s)
    header = TelemetryBatch(agent_id=agent_id, node_id=node_id, seq=seq, sent_at=sent_at, samples=rare,
                            heartbeat=heartbeat)
    table = StringTable()
    step = block("step", by_kind["step"], table) if by_kind["step"] else None
    coll = block("collective", by_kind["collective"], table) if by_kind["collective"] else None
    return encode_blocks(header.model_dump_json().encode(), table.strings, step, coll)


def to_batch(body: bytes) -> TelemetryBatch:
    """A columnar body (uncompressed) back as the TelemetryBatch it encodes: for a controller that
    only takes JSON (older than the columnar endpoint), and for tests. Validates every sample."""
    raw = msgspec.msgpack.decode(body, type=ColumnarBatch)
    header = TelemetryBatch.model_validate_json(raw.header)
    samples: list[Any] = []
    for kind, blk in (("step", raw.step), ("collective", raw.collective)):
        if blk is None or blk.n == 0:
            continue
        cols: dict[str, list[Any]] = {}
        for name, spec in column_specs(kind).items():
            if name not in blk.columns:
                continue
            values = np.frombuffer(blk.columns[name], dtype=spec.dtype).tolist()
            if spec.type == "str":
                values = [raw.strings[i] for i in values]
            # A NaN in a "None when not finite" column (loss, lr, val_loss) is left as it is: validating the
            # sample below makes it None (``Observed`` in the schema), the one rule both decoders follow.
            if name in blk.nulls:
                values = [None if z else v for v, z in zip(values, blk.nulls[name], strict=True)]
            cols[name] = values
        model = COLUMNAR_KINDS[kind]
        samples += [model.model_validate(dict(zip(cols, row, strict=True))) for row in zip(*cols.values(), strict=True)]
    # Order within a batch carries no meaning for the controller (each sample has its own key).
    return header.model_copy(update={"samples": samples + list(header.samples)})


def encode_blocks(header: bytes, strings: list[str], step: ColumnBlock | None, collective: ColumnBlock | None
                  ) -> bytes:
    """The body from ready columns (the bench builds them with numpy directly)."""
    return _ENCODER.encode(ColumnarBatch(header=header, strings=strings, step=step, collective=collective))


__all__ = ["StringTable", "block", "encode", "encode_blocks", "to_batch"]
