"""Method-specific parameters (``optimizer.params``) validated once, into a frozen dataclass.

Every strategy declares its parameters as a dataclass whose fields carry the defaults and whose
``__post_init__`` checks ranges; :func:`parse_params` rejects unknown names and wrong types with a
``ValueError`` that names the field, so a bad job spec fails before any rank communicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def _coerce(kind: str, name: str, want: type, value: Any) -> Any:
    if want is bool:
        if isinstance(value, bool):
            return value
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif want is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif want is str and isinstance(value, str):
        return value
    raise ValueError(f"optimizer.params.{name} ({kind}): expected {want.__name__}, got {value!r}")


def parse_params(cls: type[T], params: Mapping[str, Any], *, kind: str) -> T:
    """``cls(**params)`` with names and types checked; ``ValueError`` naming the offending field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"optimizer.params ({kind}): unknown {unknown}; accepted: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, value in params.items():
        annotation = fields[name].type
        want = _TYPES[annotation if isinstance(annotation, str) else annotation.__name__]
        values[name] = _coerce(kind, name, want, value)
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"optimizer.params ({kind}): {exc}") from exc


def check(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``; for ``__post_init__`` range checks."""
    if not condition:
        raise ValueError(message)
