"""Reads of step and collective telemetry (the REST API, Prometheus and the dashboard read through
these): per-rank step series, aggregates, plus what is still forming.

A step's aggregates exist once it has settled (see :mod:`controller.aggregation`). The forming steps
(:mod:`controller.step_read`: the newest dirty ones, one cap for every reader) are computed on the fly
from their raw rows with the aggregator's own function, and come back with ``final = False``; so a live
job's newest steps show without waiting for the aggregator and an old job's steps show after their raw
rows are gone.

Downsampling keeps the first and the last point and, from each run of consecutive points in
between, the one with the largest value of the series' main measure (step time, or the max
duration of a collective): a straggler spike survives decimation, which striding would drop.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from controller.models import (
    CollectiveMetric,
    CollectiveStepStat,
    RankStepStat,
    StepMetric,
)
from controller.step_read import JobSteps, forming_aggregates, read_steps
from vigil.contract.schemas import (
    CollectiveCallPublic,
    CollectiveSeriesPublic,
    JobCollectivesPublic,
    JobMetrics,
    JobStepsPublic,
    RankSeries,
    RankStepsPublic,
    bytes_estimated,
)

T = TypeVar("T")

def decimate(points: Sequence[T], max_points: int, key: Callable[[T], float | None]) -> list[T]:
    """At most about ``max_points`` of ``points``: first, last, and per bucket the one with the largest ``key``."""
    n = len(points)
    if n <= max_points or max_points < 3:
        return list(points)
    inner = points[1:-1]
    buckets = max_points - 2
    size = -(-len(inner) // buckets)
    out = [points[0]]
    for i in range(0, len(inner), size):
        chunk = inner[i:i + size]
        out.append(max(chunk, key=lambda p: (k if (k := key(p)) is not None else float("-inf"))))
    out.append(points[-1])
    return out


class StepRange:
    """The filters both endpoints share: steps, unix times, ranks."""

    def __init__(self, since_step: int | None = None, until_step: int | None = None, since_ts: float | None = None,
                 until_ts: float | None = None, ranks: Sequence[int] | None = None) -> None:
        self.since_step = since_step
        self.until_step = until_step
        self.since_ts = since_ts
        self.until_ts = until_ts
        self.ranks = set(ranks) if ranks else None

    def where(self, q: Any, model: Any, *, ranks: bool = True) -> Any:
        if self.since_step is not None:
            q = q.where(model.step >= self.since_step)
        if self.until_step is not None:
            q = q.where(model.step <= self.until_step)
        if self.since_ts is not None:
            q = q.where(model.ts >= self.since_ts)
        if self.until_ts is not None:
            q = q.where(model.ts <= self.until_ts)
        if ranks and self.ranks is not None and hasattr(model, "rank"):
            q = q.where(model.rank.in_(sorted(self.ranks)))
        return q

    def keeps(self, step: int, ts: float, rank: int | None = None) -> bool:
        return not (
            (self.since_step is not None and step < self.since_step)
            or (self.until_step is not None and step > self.until_step)
            or (self.since_ts is not None and ts < self.since_ts)
            or (self.until_ts is not None and ts > self.until_ts)
            or (rank is not None and self.ranks is not None and rank not in self.ranks)
        )


def _read_steps(session: Session, job_id: str, rng: StepRange) -> JobSteps:
    """The job's dirty and forming steps in the range (:func:`controller.step_read.read_steps`: read before
    the aggregates). Dirty steps older than the forming ones show their raw step rows in /steps (wait
    unknown yet) and are left out of /collectives until aggregated."""
    return read_steps(session, job_id, rng.since_step, rng.until_step)


_RANK_FIELDS = ("ts", "loss", "step_time_s", "data_s", "fwd_bwd_s", "optim_s", "comm_s", "comm_wait_s",
                "collectives", "wire_bytes")


ROW_BUDGET = 1_000_000
"""Most rows one ``/steps`` read loads (all ranks together); more, and it reads every n-th step."""


def job_steps(session: Session, job_id: str, rng: StepRange, max_points: int = 2000,
              max_ranks: int = 1024) -> JobStepsPublic:
    """Per-rank step breakdown of ``job_id``; at most ``max_ranks`` ranks (lowest first)."""
    st = _read_steps(session, job_id, rng)
    R = RankStepStat
    cols = [R.rank, R.step, R.node_id] + [getattr(R, f) for f in _RANK_FIELDS]
    # Bounded in the database, not after loading every row: the first ``max_ranks`` ranks only, and a read of
    # more than ROW_BUDGET rows takes every ``stride``-th step (then decimated keeping each bucket's slowest
    # step: a spike between two read steps is the price of a bounded read of a huge job).
    all_ranks = rng.where(select(R.rank).where(R.job_id == job_id), R).distinct()
    n_ranks = session.scalar(select(func.count()).select_from(all_ranks.subquery())) or 0
    wanted = list(session.scalars(all_ranks.order_by(R.rank).limit(max_ranks)).all())
    span = session.execute(rng.where(select(func.min(R.step), func.max(R.step)).where(R.job_id == job_id), R)).one()
    stride = 1
    if span[0] is not None:
        stride = max(1, -(-(span[1] - span[0] + 1) * len(wanted) // ROW_BUDGET))
    q = rng.where(select(*cols).where(R.job_id == job_id, R.rank.in_(wanted)), R)
    if stride > 1:
        q = q.where(or_((R.step - span[0]) % stride == 0, R.step == span[1]))
    rows = session.execute(q.order_by(R.rank, R.step)).all() if wanted else []
    by_rank: dict[int, dict[int, tuple[dict[str, Any], bool]]] = defaultdict(dict)
    for r in rows:
        by_rank[r.rank][r.step] = ({"node_id": r.node_id, **{f: getattr(r, f) for f in _RANK_FIELDS}}, True)
    forming = forming_aggregates(session, st)
    for step, agg in forming.items():
        for rr in agg.ranks:
            if rng.keeps(step, rr["ts"], rr["rank"]):
                by_rank[rr["rank"]][step] = (rr, False)
    # Older dirty steps (beyond the forming ones, e.g. a spool replay): their raw step rows as they are,
    # the wait inside collectives still unknown.
    older = sorted(s for s in st.dirty if s not in forming)
    S = StepMetric
    for r in session.execute(
        rng.where(select(S.rank, S.step, S.node_id, S.ts, S.loss, S.step_time_s, S.data_s, S.fwd_bwd_s, S.optim_s,
                         S.comm_s).where(S.job_id == job_id, S.step.in_(older)), S).order_by(S.attempt, S.id)
    ).all() if older else []:
        by_rank[r.rank][r.step] = ({"node_id": r.node_id, "ts": r.ts, "loss": r.loss, "step_time_s": r.step_time_s,
                                    "data_s": r.data_s, "fwd_bwd_s": r.fwd_bwd_s, "optim_s": r.optim_s,
                                    "comm_s": r.comm_s, "comm_wait_s": None, "collectives": 0, "wire_bytes": 0},
                                   False)
    ranks = sorted(by_rank)
    series = []
    for rank in ranks[:max_ranks]:
        pts = sorted(by_rank[rank].items())
        pts = decimate(pts, max_points, key=lambda p: p[1][0]["step_time_s"])
        vals = [p[1][0] for p in pts]
        series.append(RankStepsPublic(
            rank=rank, node_id=vals[-1]["node_id"], step=[p[0] for p in pts], final=[p[1][1] for p in pts],
            **{f: [v[f] for v in vals] for f in _RANK_FIELDS},
        ))
    return JobStepsPublic(job_id=job_id, data=series, count=max(n_ranks, len(ranks)))


_COLL_FIELDS = ("ts", "calls", "ranks", "p50_s", "max_s", "min_s", "slowest_rank", "transfer_s", "wait_p50_s",
                "wait_max_s", "most_waiting_rank", "payload_bytes", "wire_bytes", "elements")


def job_collectives(
    session: Session, job_id: str, rng: StepRange, *, ops: Sequence[str] | None = None, max_points: int = 2000,
    raw: bool = False, raw_limit: int = 10_000,
) -> JobCollectivesPublic:
    """Per-kind collective aggregates per step of ``job_id``, and the raw per-rank calls when ``raw``.

    The aggregates are over all ranks (``ranks`` filters only the raw calls).
    """
    st = _read_steps(session, job_id, rng)
    cols = [CollectiveStepStat.op, CollectiveStepStat.group, CollectiveStepStat.tag, CollectiveStepStat.step] + [
        getattr(CollectiveStepStat, f) for f in _COLL_FIELDS]
    q = rng.where(select(*cols).where(CollectiveStepStat.job_id == job_id), CollectiveStepStat)
    if ops:
        q = q.where(CollectiveStepStat.op.in_(list(ops)))
    kinds: dict[tuple[str, str, str], dict[int, tuple[dict[str, Any], bool]]] = defaultdict(dict)
    for r in session.execute(q.order_by(CollectiveStepStat.step)).all():
        kinds[(r.op, r.group, r.tag)][r.step] = ({f: getattr(r, f) for f in _COLL_FIELDS}, True)
    for step, agg in forming_aggregates(session, st).items():
        for c in agg.collectives:
            if rng.keeps(step, c["ts"]) and (not ops or c["op"] in ops):
                kinds[(c["op"], c["group"], c["tag"])][step] = (c, False)
    series = []
    for (op, group, tag), by_step in sorted(kinds.items()):
        pts = decimate(sorted(by_step.items()), max_points, key=lambda p: p[1][0]["max_s"])
        vals = [p[1][0] for p in pts]
        series.append(CollectiveSeriesPublic(
            op=op, group=group, tag=tag, estimated=bytes_estimated(tag), step=[p[0] for p in pts], final=[p[1][1] for p in pts],
            **{f: [v[f] for v in vals] for f in _COLL_FIELDS},
        ))
    out = JobCollectivesPublic(job_id=job_id, data=series, count=len(series), raw=None, raw_truncated=False)
    if raw:
        out.raw, out.raw_truncated = raw_calls(session, job_id, rng, ops=ops, limit=raw_limit)
    return out


def raw_calls(session: Session, job_id: str, rng: StepRange, *, ops: Sequence[str] | None = None,
              limit: int = 10_000) -> tuple[list[CollectiveCallPublic], bool]:
    """Raw per-rank calls (within the retention window), each with its wait; and whether ``limit`` cut them."""
    C = CollectiveMetric
    q = rng.where(select(C.rank, C.node_id, C.step, C.seq, C.op, C.group, C.tag, C.duration_s, C.payload_bytes,
                         C.wire_bytes, C.elements, C.ts, C.id).where(C.job_id == job_id), C)
    if ops:
        q = q.where(C.op.in_(list(ops)))
    rows = session.execute(q.order_by(C.step, C.seq, C.rank, C.attempt, C.id).limit(limit + 1)).all()
    truncated = len(rows) > limit
    rows = rows[:limit]
    latest: dict[tuple[int, int, int], Any] = {}
    for r in rows:  # a re-run step (restart from a checkpoint) replaces the earlier samples
        latest[(r.step, r.seq, r.rank)] = r
    if not latest:
        return [], truncated
    lo, hi = min(k[0] for k in latest), max(k[0] for k in latest)
    # The fastest rank of each call, over every rank (the rank filter must not change the wait).
    fastest = {
        (s, q_): m for s, q_, m in session.execute(
            select(C.step, C.seq, func.min(C.duration_s))
            .where(C.job_id == job_id, C.step >= lo, C.step <= hi).group_by(C.step, C.seq)
        ).all()
    }
    calls = [
        CollectiveCallPublic(
            rank=r.rank, node_id=r.node_id, step=r.step, seq=r.seq, op=r.op, group=r.group, tag=r.tag,
            estimated=bytes_estimated(r.tag),
            duration_s=r.duration_s, wait_s=max(0.0, r.duration_s - fastest.get((r.step, r.seq), r.duration_s)),
            payload_bytes=r.payload_bytes, wire_bytes=r.wire_bytes, elements=r.elements, ts=r.ts,
        )
        for r in latest.values()
    ]
    return calls, truncated




def job_metrics(session: Session, job_id: str, since_step: int | None = None, max_points: int = 2000) -> JobMetrics:
    """Step series per rank (loss, step time, throughput), at most about ``max_points`` points per rank.

    Raw samples (the retention window) and the per-rank aggregates kept for good, merged: a step
    whose raw rows were pruned is read from its aggregate. Downsampled as every series here is: the
    slowest step of each run survives (module docstring).
    """
    points: dict[tuple[int, int], tuple[float, float | None, float | None, float | None]] = {}
    for model in (RankStepStat, StepMetric):  # raw last: where both exist, the raw sample wins
        # Training steps only: an aggregate without a step sample holds collectives alone (step 0: the
        # start-up broadcasts of the weights), which the step breakdown (/steps) shows instead.
        q = select(model.rank, model.step, model.ts, model.loss, model.step_time_s, model.tokens_per_s).where(
            model.job_id == job_id, model.step_time_s.is_not(None))
        if since_step is not None:
            q = q.where(model.step >= since_step)
        for r in session.execute(q).all():
            points[(r.rank, r.step)] = (r.ts, r.loss, r.step_time_s, r.tokens_per_s)
    by_rank: dict[int, list[tuple[int, tuple[float, float | None, float | None, float | None]]]] = defaultdict(list)
    for (rank, step), v in sorted(points.items()):
        by_rank[rank].append((step, v))
    series = []
    for rank, pts in sorted(by_rank.items()):
        pts = decimate(pts, max_points, key=lambda p: p[1][2])
        series.append(RankSeries(
            rank=rank, step=[p[0] for p in pts], ts=[p[1][0] for p in pts], loss=[p[1][1] for p in pts],
            step_time_s=[p[1][2] or 0.0 for p in pts], tokens_per_s=[p[1][3] or 0.0 for p in pts],
        ))
    return JobMetrics(job_id=job_id, ranks=series)


__all__ = [
    "StepRange", "decimate", "job_collectives", "job_metrics", "job_steps", "raw_calls",
]
