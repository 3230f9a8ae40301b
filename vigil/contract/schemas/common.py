"""What every schema module shares: limits, text rules, ``slugify`` and the strict base model."""

from __future__ import annotations

import functools
import hashlib
import math
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
)

NAME_MAX = 128
TEXT_MAX = 4096
MAX_TELEMETRY_ITEMS = 10_000
INT32_MAX = 2**31 - 1
"""Largest value of an ``Integer`` column (PostgreSQL's int4): counters stored there are bounded by it."""
INT64_MAX = 2**63 - 1
"""Largest value of a ``BigInteger`` column."""
TS_MAX = 253_402_300_799.0
"""Last second of year 9999: the largest unix time a ``datetime`` can hold."""
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Ids in URLs (jobs, tokens): what the controller generates, so anything else is refused with 422."""
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""Node ids in URLs: what an agent may call its node (``agent.main`` enforces the same characters)."""
HOST_MAX_ITEMS = 20_000
HOST_MAX_DEPTH = 12

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# Cached: ingest checks the same few job ids and op names millions of times a minute, and a
# cache hit skips the Python call (measured: validating a batch costs ~40% less). Only
# strings that pass are cached (a raise is not), so what is accepted does not change.
@functools.lru_cache(maxsize=4096)
def _no_control(v: str) -> str:
    """Single-line text: no control characters (NUL, newlines, escapes) in names and identifiers."""
    if _CONTROL.search(v):
        raise ValueError("must not contain control characters")
    return v


def _no_nul(v: str) -> str:
    """Free text may span lines, but never holds NUL (PostgreSQL text cannot store it)."""
    if "\x00" in v:
        raise ValueError("must not contain NUL characters")
    return v


Line = Annotated[str, AfterValidator(_no_control)]
"""A name or identifier: one line of printable text (length limits are set per field)."""
Text = Annotated[str, AfterValidator(_no_nul)]
"""Free text: any characters but NUL (length limits are set per field)."""

_SLUG_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def slugify(value: str, max_length: int = 64) -> str:
    """``value`` made safe as one path component: ``[A-Za-z0-9_.-]``, no leading dot, never empty.

    Names are stored verbatim but never used in a path as they are: ``../../etc`` becomes
    ``etc-<hash>``. A value that is already safe comes back unchanged (so ``job_0123abcd`` keeps
    naming the same folder); one that had to change gets a short hash of the original, so that
    two different names cannot end up sharing a folder.
    """
    slug = _SLUG_BAD.sub("-", value)
    slug = re.sub(r"\.{2,}", ".", slug).strip("-._")
    if slug == value and 0 < len(slug) <= max_length:
        return slug
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{slug[: max(0, max_length - 11)]}-{digest}" if slug else digest


class _Strict(BaseModel):
    """Base for input models: unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


def _storable_json(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` bounded in size and depth, NaN/inf as None, and no NUL in any string.

    Every database can store the result in a JSON column (PostgreSQL refuses NaN and NUL).
    """
    count = 0

    def walk(v: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if count > HOST_MAX_ITEMS:
            raise ValueError(f"holds more than {HOST_MAX_ITEMS} values")
        if depth > HOST_MAX_DEPTH:
            raise ValueError(f"is nested deeper than {HOST_MAX_DEPTH} levels")
        if isinstance(v, dict):
            return {_no_nul(str(k)): walk(x, depth + 1) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, str):
            return _no_nul(v)
        if isinstance(v, float) and not math.isfinite(v):
            return None  # a probe reading that is not a number: "unavailable", not bad input
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX:
            raise ValueError(f"holds an integer beyond 64 bits ({v})")
        return v

    return walk(value, 0)
