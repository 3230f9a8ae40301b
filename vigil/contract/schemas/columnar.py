"""The columnar telemetry wire format (``POST /api/v1/telemetry/columnar``): the contract the agent
encodes and the controller decodes.

Why a second format: the JSON batch costs the controller 4-8 us per sample to parse and validate
object by object, more than the database needs to store it. Here one batch carries the step and
collective samples as *columns* - one little-endian array per field, strings as indices into a
small per-batch dictionary - inside a MessagePack envelope, so the controller decodes an array
with one ``numpy.frombuffer`` and checks a rule once per column.

The rules are not restated: :func:`column_specs` reads them off the pydantic models
(:class:`~vigil.contract.schemas.telemetry.StepSample`, :class:`CollectiveSample`), their ``Field``
bounds, finiteness and string rules, so the JSON schema stays the one source of truth.

The envelope (:class:`ColumnarBatch`):

- ``header``: a JSON :class:`TelemetryBatch` (agent_id, node_id, seq, sent_at, heartbeat) whose
  ``samples`` hold only the rare kinds (checkpoint, fault); it is validated exactly as the JSON
  endpoint validates a batch.
- ``strings``: the dictionary the string columns index into.
- ``step`` / ``collective``: :class:`ColumnBlock` - ``n`` rows, ``columns`` (field name -> bytes of
  ``n`` values of the field's dtype, see :attr:`ColumnSpec.dtype`) and ``nulls`` (field name ->
  ``n`` bytes, 1 where the value is None; only for fields that accept None). A column left out
  takes the field's default; a required one must be there. A float field that accepts any value
  (``loss``, ``lr``, ``val_loss``: "None when not finite") may carry NaN for None.

Only the standard library, pydantic and msgspec: the agent imports this.
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from vigil.contract.schemas.telemetry import CollectiveSample, StepSample

#: Media type of a columnar body. The generic MessagePack types are accepted too, and
#: ``application/octet-stream`` (what generic HTTP tools, OpenAPI fuzzers included, can send).
CONTENT_TYPE = "application/vnd.vigil.columnar+msgpack"
CONTENT_TYPES = frozenset({CONTENT_TYPE, "application/x-msgpack", "application/msgpack", "application/octet-stream"})
#: Route of the columnar endpoint, under ``/api/v1``.
COLUMNAR_PATH = "/telemetry/columnar"

#: Sample kinds that travel as columns, and their models (the rest ride in the header).
COLUMNAR_KINDS: dict[str, type[BaseModel]] = {"step": StepSample, "collective": CollectiveSample}


class ColumnBlock(msgspec.Struct, forbid_unknown_fields=True):
    """``n`` samples of one kind, one array per field."""

    n: int
    columns: dict[str, bytes] = msgspec.field(default_factory=dict)
    nulls: dict[str, bytes] = msgspec.field(default_factory=dict)


class ColumnarBatch(msgspec.Struct, forbid_unknown_fields=True):
    """One agent batch in columns (see the module docstring)."""

    header: bytes
    strings: list[str] = msgspec.field(default_factory=list)
    step: ColumnBlock | None = None
    collective: ColumnBlock | None = None


@dataclass(frozen=True)
class ColumnSpec:
    """One field of a sample model as a column, with the rules its ``Field`` declares."""

    name: str
    #: ``int``, ``float`` or ``str`` (a string column holds uint32 indices into ``strings``).
    type: str
    required: bool
    default: Any
    #: The field accepts None (a ``nulls`` mask may mark rows).
    nullable: bool
    #: Non-finite floats are refused (``allow_inf_nan=False``); otherwise they mean None.
    finite: bool
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    #: The field's own pydantic rules for one string (lengths, single line): checked per distinct value.
    metadata: tuple[Any, ...] = ()

    @property
    def dtype(self) -> str:
        """numpy dtype string of the column's bytes on the wire."""
        return {"int": "<i8", "float": "<f8", "str": "<u4"}[self.type]


def _base_type(annotation: Any) -> tuple[Any, bool, list[Any]]:
    """(the non-None type, whether None is allowed, metadata found inside ``Annotated`` members)."""
    inner: list[Any] = []
    nullable = False
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    members = [a for a in args if a is not type(None)] if args else [annotation]
    nullable = bool(args) and len(members) < len(args)
    if len(members) != 1:
        raise TypeError(f"cannot make a column of {annotation!r}")
    t = members[0]
    while typing.get_origin(t) is typing.Annotated:
        t, *extra = typing.get_args(t)
        for e in extra:
            inner.extend(getattr(e, "metadata", None) or [e])
    return t, nullable, inner


@functools.cache
def column_specs(kind: str) -> dict[str, ColumnSpec]:
    """The columns of sample ``kind`` (``step``/``collective``), read off its pydantic model."""
    model = COLUMNAR_KINDS[kind]
    out: dict[str, ColumnSpec] = {}
    for name, field in model.model_fields.items():
        if name == "kind":
            continue
        t, nullable, inner = _base_type(field.annotation)
        meta = [*field.metadata, *inner]
        bounds = {k: getattr(m, k) for m in meta for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
        allow_inf_nan = next((m.allow_inf_nan for m in meta if hasattr(m, "allow_inf_nan")), True)
        ctype = {int: "int", float: "float", str: "str"}.get(t)
        if ctype is None:
            raise TypeError(f"{model.__name__}.{name}: no column type for {t!r}")
        out[name] = ColumnSpec(
            name=name, type=ctype, required=field.is_required(),
            default=None if field.is_required() else field.default, nullable=nullable,
            finite=not allow_inf_nan, metadata=tuple(meta) if ctype == "str" else (), **bounds,
        )
    return out


__all__ = [
    "COLUMNAR_KINDS", "COLUMNAR_PATH", "CONTENT_TYPE", "CONTENT_TYPES", "ColumnBlock", "ColumnSpec", "ColumnarBatch",
    "column_specs",
]
