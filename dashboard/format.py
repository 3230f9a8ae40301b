"""Text and number formatting shared by every page of the dashboard, written once.

Each ``fmt_*`` function turns one value (a time, a duration, a byte count or rate, a list of ranks, a
job's progress, an incident) into the short string a table cell, a header or a figure title shows,
with :data:`DASH` for a missing value and :data:`NA` for a metric a node does not have;
:func:`round_sig` rounds the numbers that go into figures and grids. Nothing here builds Dash
components or figures, so the tables, grids and figures all format alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime

from vigil.contract.schemas import IncidentPublic, JobPublic, RankProcess

DASH = "–"
"""Shown for a missing value."""
NA = "n/a"
"""Shown where a node does not have (or could not measure) a metric."""


def round_sig(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded to ``digits`` significant digits (smaller JSON; ``None`` and non-finite as ``None``)."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def fmt_time(ts: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` in UTC (naive datetimes are taken as UTC), or a dash."""
    if ts is None:
        return DASH
    if ts.tzinfo is not None:
        ts = ts.astimezone(UTC)
    return ts.strftime("%Y-%m-%d %H:%M:%S")


def fmt_float(value: float | None, digits: int = 4) -> str:
    """``digits`` significant digits; ``nan``/``inf`` spelled out; ``None`` as a dash."""
    if value is None:
        return DASH
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def fmt_age(seconds: float | None) -> str:
    """A heartbeat age: ``0.8 s``, ``42 s``, ``3 min``, ``2.5 h``; a dash for never."""
    if seconds is None:
        return DASH
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_duration(seconds: float | None) -> str:
    """``1.3 s``, ``45 s``, ``12 min``, ``3 h 05 min``; a dash for unknown."""
    if seconds is None or not math.isfinite(seconds):
        return DASH
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    h, m = divmod(int(seconds // 60), 60)
    return f"{h} h {m:02d} min"


def fmt_bytes(n: float | None) -> str:
    """``512 B``, ``1.5 kB``, ``2.25 MB``, ``3.1 GB`` (powers of 1000)."""
    if n is None:
        return DASH
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_s: float | None) -> str:
    """A byte rate in SI units: ``0 B/s``, ``512 B/s``, ``1.25 MB/s``; "n/a" for None."""
    if bytes_per_s is None:
        return NA
    v = float(bytes_per_s)
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}" if unit == "B/s" else f"{v:.3g} {unit}"
        v /= 1000
    return f"{v:.3g} TB/s"


def fmt_per_s(value: float | None) -> str:
    """An event rate (errors, drops): ``0``, ``0.5/s``, ``12/s``; "n/a" for None."""
    if value is None:
        return NA
    return "0" if value == 0 else f"{value:.2g}/s"


def fmt_workers(job: JobPublic) -> str:
    """``4`` for a fixed size, ``2–6`` for an elastic job."""
    s = job.spec.scaling
    return str(s.min_workers) if s.min_workers == s.max_workers else f"{s.min_workers}{DASH}{s.max_workers}"


def fmt_progress(job: JobPublic) -> str:
    """``last step / steps``."""
    last = DASH if job.last_step is None else str(job.last_step)
    return f"{last} / {job.spec.steps}"


def fmt_ranks(ranks: Sequence[RankProcess]) -> str:
    """Ranks grouped by job: ``job-a: 0, 1; job-b: 3``; dead ranks marked with ``†``."""
    if not ranks:
        return DASH
    by_job: dict[str, list[str]] = {}
    for r in sorted(ranks, key=lambda r: (r.job_id, r.rank)):
        by_job.setdefault(r.job_id, []).append(f"{r.rank}" if r.alive else f"{r.rank}†")
    return "; ".join(f"{job}: {', '.join(rs)}" for job, rs in by_job.items())


def fmt_rank_list(ranks: Sequence[int], limit: int = 12) -> str:
    """``0-3, 5, 7-9`` (runs collapsed; at most ``limit`` pieces, then ``... (N ranks)``)."""
    rs = sorted(set(ranks))
    if not rs:
        return DASH
    runs: list[tuple[int, int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > limit:
        return ", ".join(parts[:limit]) + f", ... ({len(rs)} ranks)"
    return ", ".join(parts)


def incident_line(inc: IncidentPublic) -> str:
    """``hang (ACTING): rank 1 on node-2``"""
    where = ", ".join(x for x in (f"rank {inc.rank}" if inc.rank is not None else "",
                                  f"node {inc.node_id}" if inc.node_id else "") if x)
    return f"{inc.kind.value} ({inc.status.value})" + (f": {where}" if where else "")
