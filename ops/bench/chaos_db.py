"""What ``vigil bench chaos`` reads straight from the controller's database (an operator tool may):
samples lost and duplicated, the final loss, rank 0's steps, the incidents since a time."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from controller.models import Incident, StepMetric
from ops.bench.chaos_plan import IncidentView


def sample_counts(engine: Engine, job_id: str, final_step: int, world_size: int) -> dict[str, Any]:
    """``samples_lost``: (rank, step) pairs, ranks 0..world_size-1 and steps 1..final_step, without any
    ``step_metrics`` row (step rows only); ``samples_duplicated``: rows beyond one per (job, rank, step,
    attempt), the sample's key (``duplicate_key``); ``samples_dropped_reported``: what the ranks said
    they dropped (the rows' ``dropped``)."""
    S = StepMetric
    with engine.connect() as c:
        pairs = select(S.rank, S.step).where(S.job_id == job_id, S.step >= 1, S.step <= final_step, S.rank >= 0,
                                             S.rank < world_size).distinct().subquery()
        have = c.execute(select(func.count()).select_from(pairs)).scalar_one()
        groups = select(func.count().label("n")).where(S.job_id == job_id).group_by(S.rank, S.step, S.attempt).subquery()
        dup = c.execute(select(func.coalesce(func.sum(groups.c.n - 1), 0))).scalar_one()
        dropped = c.execute(select(func.coalesce(func.sum(S.dropped), 0)).where(S.job_id == job_id)).scalar_one()
    return {"samples_lost": max(0, world_size * max(0, final_step) - int(have)), "samples_duplicated": int(dup),
            "samples_dropped_reported": int(dropped), "duplicate_key": "attempt"}


def missing_samples(engine: Engine, job_id: str, final_step: int, world_size: int, limit: int = 20) -> dict[int, list[int]]:
    """Per rank, the first ``limit`` steps in 1..final_step without a row (what ``samples_lost`` counts)."""
    with engine.connect() as c:
        rows = c.execute(select(StepMetric.rank, StepMetric.step).where(
            StepMetric.job_id == job_id, StepMetric.step >= 1, StepMetric.step <= final_step).distinct()).all()
    have: dict[int, set[int]] = {}
    for r, s in rows:
        have.setdefault(int(r), set()).add(int(s))
    out = {}
    for r in range(world_size):
        gone = [s for s in range(1, final_step + 1) if s not in have.get(r, set())]
        if gone:
            out[r] = gone[:limit]
    return out


def final_loss(engine: Engine, job_id: str, step: int) -> float | None:
    """Mean over ranks of each rank's newest finite loss at ``step``."""
    with engine.connect() as c:
        rows = c.execute(select(StepMetric.rank, StepMetric.loss).where(
            StepMetric.job_id == job_id, StepMetric.step == step).order_by(StepMetric.attempt, StepMetric.id)).all()
    newest = {int(r): loss for r, loss in rows}
    finite = [v for v in newest.values() if v is not None and math.isfinite(v)]
    return round(sum(finite) / len(finite), 5) if finite else None


def rank_rows(engine: Engine, job_id: str, rank: int = 0) -> list[tuple[float, int]]:
    """(end time, step) of every row of ``rank``, in time order (every attempt)."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT ts, step FROM step_metrics WHERE job_id = :j AND rank = :r ORDER BY ts"),
                         {"j": job_id, "r": rank}).all()
    return [(float(t), int(s)) for t, s in rows]


def incidents_since(engine: Engine, since: float) -> list[IncidentView]:
    """Every incident detected at or after ``since`` (any job, or none)."""
    with Session(engine) as session:
        rows = session.scalars(select(Incident).order_by(Incident.id)).all()
        return [IncidentView(r.id, r.kind, r.job_id, r.node_id, r.rank, r.status, r.detected_at.timestamp(),
                             r.acted_at.timestamp() if r.acted_at else None,
                             r.recovered_at.timestamp() if r.recovered_at else None, r.step_at_detect,
                             dict(r.evidence or {}))
                for r in rows if r.detected_at.timestamp() >= since]
