"""The job's steps as one request of the derived views sees them (:mod:`controller.views`,
:mod:`controller.view_markers`, :mod:`controller.goodput`): which are still forming (marked dirty),
the newest :data:`MAX_FORMING_STEPS` of which are read from their raw samples, the latest sample of
each rank winning; which of those a rank re-ran (several samples), and when their attempts ran. The
other steps are read from their aggregates (:mod:`controller.aggregation`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from controller.models import StepMetric, TelemetryDirtyStep
from controller.step_stats import attempt_spans

MAX_FORMING_STEPS = 64
"""Forming (dirty) steps computed from their raw samples per request, the newest ones."""


@dataclass
class _Steps:
    """The job's steps as one request sees them: which are forming and how each forming one is read."""

    dirty: set[int]
    forming: list[int]
    """The newest :data:`MAX_FORMING_STEPS` dirty steps (ascending): read from raw rows."""
    dups: set[int]
    """Forming steps with several samples of a rank (a re-run): read row by row (latest wins)."""

    @property
    def clean(self) -> list[int]:
        return [s for s in self.forming if s not in self.dups]


def _steps(session: Session, job_id: str, since_step: int | None = None, *, dups: bool = True) -> _Steps:
    """Read *before* the aggregates (see :func:`controller.series._dirty_steps`: a step is always
    either dirty or aggregated, so none falls between the two reads). ``dups``: find the forming steps
    with re-run samples (else ``dups`` is left empty: the caller reads the forming rows itself)."""
    q = select(TelemetryDirtyStep.step).where(TelemetryDirtyStep.job_id == job_id)
    if since_step is not None:
        q = q.where(TelemetryDirtyStep.step >= since_step)
    dirty = sorted(session.scalars(q))
    forming = dirty[-MAX_FORMING_STEPS:]
    found: set[int] = set()
    if forming and dups:
        S = StepMetric
        found = set(session.scalars(
            select(S.step).where(S.job_id == job_id, S.step.in_(forming)).group_by(S.step)
            .having(func.count() > func.count(distinct(S.rank)))))
    return _Steps(set(dirty), forming, found)


def _latest_rows(session: Session, job_id: str, steps: Sequence[int],
                 *cols: Any) -> tuple[dict[int, dict[int, Any]], set[int]]:
    """Raw step rows of ``steps`` (columns ``step, rank, *cols``), the latest per (step, rank); and the
    steps in which a rank had several (a re-run)."""
    out: dict[int, dict[int, Any]] = defaultdict(dict)
    dups: set[int] = set()
    if not steps:
        return out, dups
    S = StepMetric
    # Core, not ORM, execution (no per-row ORM processing); (step, id) is the order of the (job_id, step) index.
    for r in session.connection().execute(select(S.step, S.rank, *cols).where(
            S.job_id == job_id, S.step.in_(list(steps))).order_by(S.step, S.attempt, S.id)).all():
        per = out[r[0]]
        if r[1] in per:
            dups.add(r[0])
        per[r[1]] = r
    return out, dups


def _dup_attempts(session: Session, job_id: str,
                  st: _Steps) -> dict[int, tuple[float, float, list[list[float]] | None]]:
    """(kept attempt's start, its end, earlier attempts) of the forming steps with re-run samples."""
    if not st.dups:
        return {}
    S = StepMetric
    per: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for step, rank, ts, t in session.execute(select(S.step, S.rank, S.ts, S.step_time_s).where(
            S.job_id == job_id, S.step.in_(sorted(st.dups))).order_by(S.attempt, S.id)).all():
        per[step].append((rank, ts, t))
    out = {}
    for step, samples in per.items():
        start, reruns = attempt_spans(samples)
        end = max({rank: ts for rank, ts, _ in samples}.values())  # the latest sample of each rank
        if start is not None:
            out[step] = (start, end, reruns)
    return out


def _ts(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


__all__ = ["MAX_FORMING_STEPS"]
