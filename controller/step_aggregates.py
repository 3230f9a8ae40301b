"""One step's aggregates (the three kinds of rows of :mod:`controller.aggregation`): computed from the
step's raw rows (:func:`compute_step`, :func:`load_step`, which lets the database fold them) and
written in place of the earlier ones (:func:`write_step`). Wait, transfer and attempts are defined in
:mod:`controller.step_stats`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, tuple_
from sqlalchemy.orm import Session

from controller.models import CollectiveMetric, CollectiveStepStat, JobStepStat, RankStepStat, StepMetric
from controller.step_stats import (
    OFFSET_STEPS,
    attempt_spans,
    fastest_of_calls,
    p50,
    rel_to_median,
    seconds_lost,
    step_figures,
)
from controller.telemetry import bulk_insert

RANK_STAT_COLUMNS = tuple(c.name for c in RankStepStat.__table__.columns)
"""``rank_step_stats``'s columns in table order: the bulk insert's order, read off the model."""


_rank_stat_values = itemgetter(*RANK_STAT_COLUMNS)


def _argmax(values: dict[int, float]) -> int:
    """The rank with the largest value (the lowest such rank on ties)."""
    return min(values, key=lambda r: (-values[r], r))


@dataclass
class StepAggregates:
    """What one step of one job aggregates to (plain dicts, column name -> value)."""

    job: dict[str, Any]
    ranks: list[dict[str, Any]]
    collectives: list[dict[str, Any]]


#: The per-rank fields a rank's aggregate row copies from its latest step sample, as they are.
COPIED_STEP_FIELDS = ("loss", "tokens_per_s", "step_time_s", "data_s", "fwd_bwd_s", "optim_s")
#: The raw step columns one step's aggregation reads (rows are read by these names, never by position).
STEP_ROW_FIELDS = ("rank", "node_id", "ts", *COPIED_STEP_FIELDS, "comm_s", "val_loss")
#: The raw collective columns the row-by-row path reads.
COLL_ROW_FIELDS = ("rank", "seq", "op", "group", "tag", "duration_s", "payload_bytes", "wire_bytes", "elements",
                   "ts", "node_id")
_STEP_FIELDS = tuple(getattr(StepMetric, f) for f in STEP_ROW_FIELDS)
_COLL_FIELDS = tuple(getattr(CollectiveMetric, f) for f in COLL_ROW_FIELDS)


@dataclass
class _KindRank:
    """What one rank did in one kind of collective in one step."""

    dur: float = 0.0
    wait: float = 0.0
    calls: int = 0
    payload: int = 0
    wire: int = 0
    elements: int = 0
    ts: float = 0.0
    node: str = ""


Kind = tuple[str, str, str]
History = Callable[[Sequence[int]], Mapping[int, Sequence[float]]]
"""Given ranks, each one's :func:`~controller.step_stats.rel_to_median` in the steps before this one (up to
``OFFSET_STEPS - 1`` of them, oldest first): what a rank's offset (:func:`_offset`) is taken from, with this
step's."""
NEW_PACE_STEPS = 3
"""See :func:`_offset`. A healthy rank above the median three steps running is a 1-in-8 chance of jitter, and
then the least of three is a small excess: with 15 ms of jitter per rank a healthy 2-rank job is charged about
a fifth of its jitter, against all of it by each step alone; a slowdown is charged from its third step."""
MAX_CHARGED = 8
"""A step's slowest ranks (by own time, above the step's median) given an offset; the others count at their own
time. Bounds the history read per step whatever the job's size."""


def compute_step(job_id: str, step: int, step_rows: Iterable[Any], coll_rows: Iterable[Any],
                 history: History | None = None) -> StepAggregates | None:
    """Aggregate one step from its raw rows (each iterable in arrival order; rows with the attributes
    :data:`STEP_ROW_FIELDS` and :data:`COLL_ROW_FIELDS` name, e.g. SQLAlchemy rows). Later rows of the
    same (rank) or (rank, seq) replace earlier ones. None when there is nothing to aggregate.
    ``history``: the ranks' excess over the median in the steps before this one (:data:`History`; None: this
    step alone, so each rank's offset is its excess in this step)."""
    step_rows = list(step_rows)
    steps = {r.rank: r for r in step_rows}
    calls = {(c.rank, c.seq): c for c in coll_rows}
    fastest = fastest_of_calls((seq, c.duration_s) for (_, seq), c in calls.items())
    kinds: dict[Kind, dict[int, _KindRank]] = {}
    transfer: dict[Kind, dict[int, float]] = {}
    for (rank, seq), c in calls.items():
        kind = (c.op, c.group, c.tag)
        kr = kinds.setdefault(kind, {}).setdefault(rank, _KindRank(node=c.node_id))
        kr.dur += c.duration_s
        kr.wait += c.duration_s - fastest[seq]
        kr.calls += 1
        kr.payload += c.payload_bytes
        kr.wire += c.wire_bytes
        kr.elements += c.elements
        kr.ts = max(kr.ts, c.ts)
        transfer.setdefault(kind, {})[seq] = fastest[seq]
    return _assemble(job_id, step, steps, kinds, {k: sum(v.values()) for k, v in transfer.items()}, len(calls),
                     attempt_spans((r.rank, r.ts, r.step_time_s) for r in step_rows), history)


def _assemble(job_id: str, step: int, steps: dict[int, Any], kinds: dict[Kind, dict[int, _KindRank]],
              transfer: dict[Kind, float], n_calls: int,
              spans: tuple[float | None, list[list[float]] | None] = (None, None),
              history: History | None = None) -> StepAggregates | None:
    """The three kinds of aggregate rows from per-rank step rows (named :data:`STEP_ROW_FIELDS`) and per
    (kind, rank) collective totals (``spans``: :func:`attempt_spans` of the step rows; ``history``: as
    :func:`compute_step`'s)."""
    if not steps and not kinds:
        return None
    collectives: list[dict[str, Any]] = []
    r_comm: dict[int, float] = {}
    r_wait: dict[int, float] = {}
    r_calls: dict[int, int] = {}
    r_payload: dict[int, int] = {}
    r_wire: dict[int, int] = {}
    r_node: dict[int, str] = {}
    r_ts: dict[int, float] = {}
    for kind in sorted(kinds):
        per = kinds[kind]
        dur = {r: k.dur for r, k in per.items()}
        wait = {r: k.wait for r, k in per.items()}
        for r, k in per.items():
            r_comm[r] = r_comm.get(r, 0.0) + k.dur
            r_wait[r] = r_wait.get(r, 0.0) + k.wait
            r_calls[r] = r_calls.get(r, 0) + k.calls
            r_payload[r] = r_payload.get(r, 0) + k.payload
            r_wire[r] = r_wire.get(r, 0) + k.wire
            r_node.setdefault(r, k.node)
            r_ts[r] = max(r_ts.get(r, 0.0), k.ts)
        op, group, tag = kind
        collectives.append({
            "job_id": job_id, "step": step, "op": op, "group": group, "tag": tag,
            "ts": max(k.ts for k in per.values()), "calls": max(k.calls for k in per.values()), "ranks": len(per),
            "p50_s": p50(list(dur.values())), "max_s": max(dur.values()), "min_s": min(dur.values()),
            "slowest_rank": _argmax(dur), "transfer_s": transfer.get(kind, 0.0),
            "wait_p50_s": p50(list(wait.values())), "wait_max_s": max(wait.values()),
            "most_waiting_rank": _argmax(wait),
            "payload_bytes": sum(k.payload for k in per.values()), "wire_bytes": sum(k.wire for k in per.values()),
            "elements": sum(k.elements for k in per.values()),
        })

    ranks: list[dict[str, Any]] = []
    for rank in sorted(set(steps) | set(r_calls)):
        s = steps.get(rank)
        ranks.append({
            "job_id": job_id, "step": step, "rank": rank,
            "node_id": s.node_id if s is not None else r_node[rank],
            "ts": s.ts if s is not None else r_ts[rank],
            **{f: getattr(s, f) if s is not None else None for f in COPIED_STEP_FIELDS},
            "comm_s": s.comm_s if s is not None and s.comm_s is not None else r_comm.get(rank),
            "comm_wait_s": r_wait.get(rank, 0.0) if rank in r_calls else None,
            "collectives": r_calls.get(rank, 0),
            "payload_bytes": r_payload.get(rank, 0),
            "wire_bytes": r_wire.get(rank, 0),
        })

    times: dict[int, float] = {r["rank"]: r["step_time_s"] for r in ranks if r["step_time_s"] is not None}
    waits: dict[int, float] = {r["rank"]: r["comm_wait_s"] for r in ranks if r["comm_wait_s"] is not None}
    lost, rel = _lost(times, waits, history)
    for r in ranks:
        r["lost_s"] = lost[1].get(r["rank"]) if lost is not None else None
        r["rel_own_s"] = rel.get(r["rank"])
    comms: list[float] = [r["comm_s"] for r in ranks if r["comm_s"] is not None]
    figures = step_figures(times, (r["loss"] for r in ranks), (s.val_loss for s in steps.values()),
                           (r["tokens_per_s"] for r in ranks))
    job = {
        "job_id": job_id, "step": step, "ts": max(r["ts"] for r in ranks), "ranks": len(ranks),
        **figures,
        "start_ts": spans[0], "reruns": spans[1],
        "comm_s_max": max(comms) if comms else None,
        "comm_wait_max_s": max(waits.values()) if waits else None,
        "most_waiting_rank": _argmax(waits) if waits else None,
        "collectives": n_calls,
        "lost_s": lost[0] if lost is not None else None,
        "payload_bytes": sum(r_payload.values()),
        "wire_bytes": sum(r_wire.values()),
    }
    return StepAggregates(job=job, ranks=ranks, collectives=collectives)


def _lost(times: dict[int, float], waits: dict[int, float],
          history: History | None) -> tuple[tuple[float, dict[int, float]] | None, dict[int, float]]:
    """(:func:`seconds_lost` over the ranks with both a step time and a wait, each rank's own time minus the
    step's median own time). The loss is None when no rank's wait is known, so no rank's own time is: the
    step's collectives were not captured. A rank's offset: :func:`_offset` of its :func:`rel_to_median` in the
    steps ``history`` gives and this one (for the :data:`MAX_CHARGED` slowest ranks above the median; others: 0)."""
    own = {r: max(0.0, t - waits[r]) for r, t in times.items() if r in waits}
    if not own:
        return None, {}
    rel = rel_to_median(own)
    slow = sorted((r for r, x in rel.items() if x > 0), key=lambda r: (-own[r], r))[:MAX_CHARGED]
    past = history(slow) if history is not None and slow else {}
    offsets = {r: _offset([*past.get(r, ()), rel[r]]) for r in slow}
    return seconds_lost(own, offsets), rel


def _offset(values: Sequence[float]) -> float:
    """A rank's offset from its newest :func:`rel_to_median` values (oldest first, this step's last): their
    median, or, once the newest :data:`NEW_PACE_STEPS` are all above it, the least of those (a new pace is
    charged from its third step, not only once it fills half the window)."""
    return max(statistics.median(values), min(values[-NEW_PACE_STEPS:]))


def stored_history(conn: Connection, job_id: str, step: int) -> History:
    """The ranks' stored :func:`rel_to_median` in the ``OFFSET_STEPS - 1`` steps before ``step`` (point reads
    by primary key: a handful of ranks x 20 steps, whatever the job's size)."""
    R = RankStepStat

    def read(ranks: Sequence[int]) -> dict[int, list[float]]:
        keys = [(st, r) for st in range(max(0, step - OFFSET_STEPS + 1), step) for r in ranks]
        out: dict[int, list[float]] = {}
        if keys:
            for rank, value in conn.execute(select(R.rank, R.rel_own_s).where(
                    R.job_id == job_id, tuple_(R.step, R.rank).in_(keys), R.rel_own_s.is_not(None))
                    .order_by(R.step)).all():
                out.setdefault(rank, []).append(float(value))
        return out

    return read


def load_step(session: Session, job_id: str, step: int) -> StepAggregates | None:
    """Aggregates of (job, step) computed from the raw rows now in the database.

    The database does the per-row work (GROUP BY per call and per (kind, rank)); Python sees one
    row per rank and kind. Only a step with duplicate samples (a rank re-ran it after a restart)
    is read row by row, so that the latest sample of each (rank, seq) wins.
    """
    # Core results, not ORM ones: 10,000 rows for a 10,000-rank step, and the ORM's row handling was a
    # tenth of the pass's time. (The session's connection, so inside its transaction.)
    conn = session.connection()
    step_rows = conn.execute(
        select(*_STEP_FIELDS).where(StepMetric.job_id == job_id, StepMetric.step == step).order_by(StepMetric.attempt, StepMetric.id)
    ).all()
    steps = {r.rank: r for r in step_rows}  # arrival order: the latest sample of each rank wins
    C = CollectiveMetric
    where = (C.job_id == job_id, C.step == step)
    # Duplicates (a (rank, seq) stored under two run attempts: the rank re-ran the step after a restart)
    # take the exact, row-by-row path. The unique key (job, step, rank, attempt, seq) allows them only
    # across attempts, so a group with one attempt has none: min = max attempt, found in the same scan
    # (a count of distinct seqs per group cost a sort per group: a third of this query on SQLite).
    per_kind_rank = conn.execute(
        select(C.op, C.group, C.tag, C.rank, func.count().label("calls"), func.min(C.attempt).label("first_attempt"),
               func.max(C.attempt).label("last_attempt"), func.sum(C.duration_s).label("dur"),
               func.sum(C.payload_bytes).label("payload"), func.sum(C.wire_bytes).label("wire"),
               func.sum(C.elements).label("elements"), func.max(C.ts).label("ts"), func.min(C.node_id).label("node"))
        .where(*where).group_by(C.op, C.group, C.tag, C.rank)
    ).all()
    if any(r.first_attempt != r.last_attempt for r in per_kind_rank):
        coll_rows = conn.execute(select(*_COLL_FIELDS).where(*where).order_by(C.attempt, C.id)).all()
        return compute_step(job_id, step, step_rows, coll_rows, stored_history(conn, job_id, step))
    # The fastest duration of each call (a call: every rank's seq-th call of the step), with its kind.
    per_call = conn.execute(
        select(C.op, C.group, C.tag, C.seq, func.min(C.duration_s)).where(*where).group_by(C.op, C.group, C.tag, C.seq)
    ).all()
    fastest: dict[int, float] = {}
    transfer: dict[Kind, float] = {}
    calls_of: dict[Kind, int] = {}
    for op, group, tag, seq, d in per_call:
        fastest[seq] = min(float(d), fastest.get(seq, math.inf))
        transfer[(op, group, tag)] = transfer.get((op, group, tag), 0.0) + float(d)
        calls_of[(op, group, tag)] = calls_of.get((op, group, tag), 0) + 1
    # Each rank's wait in a kind is the sum over its calls of (duration - the call's fastest). Where
    # every rank made every call of its kind (the rule: the ranks of a collective call it together)
    # and each call is of one kind, that sum is the rank's total minus the kind's transfer: no per-row
    # pass. Otherwise one more GROUP BY, over each row next to its call's fastest duration.
    if len(fastest) == len(per_call) and all(r.calls == calls_of[(r.op, r.group, r.tag)] for r in per_kind_rank):
        waits = {(r.op, r.group, r.tag, r.rank): float(r.dur) - transfer[(r.op, r.group, r.tag)] for r in per_kind_rank}
    else:
        # By a window function: one scan, and no join for the planner to get wrong (on a fresh table
        # without statistics PostgreSQL picked a nested loop that re-aggregated per row).
        rows = select(C.op, C.group, C.tag, C.rank, C.duration_s,
                      func.min(C.duration_s).over(partition_by=C.seq).label("fastest")).where(*where).subquery()
        waits = {(op, group, tag, rank): float(w) for op, group, tag, rank, w in conn.execute(
            select(rows.c.op, rows.c.group, rows.c.tag, rows.c.rank, func.sum(rows.c.duration_s - rows.c.fastest))
            .group_by(rows.c.op, rows.c.group, rows.c.tag, rows.c.rank)).all()}
        transfer = {}
        for op, group, tag, seq, _ in per_call:  # a call counted once, in every kind it appears in
            transfer[(op, group, tag)] = transfer.get((op, group, tag), 0.0) + fastest[seq]
    spans = attempt_spans((r.rank, r.ts, r.step_time_s) for r in step_rows)
    kinds: dict[Kind, dict[int, _KindRank]] = {}
    n_calls = 0
    for r in per_kind_rank:
        kinds.setdefault((r.op, r.group, r.tag), {})[r.rank] = _KindRank(
            dur=float(r.dur), wait=max(0.0, waits[(r.op, r.group, r.tag, r.rank)]), calls=int(r.calls),
            payload=int(r.payload), wire=int(r.wire), elements=int(r.elements), ts=float(r.ts), node=r.node)
        n_calls += int(r.calls)
    return _assemble(job_id, step, steps, kinds, transfer, n_calls, spans, stored_history(conn, job_id, step))


def write_step(session: Session, job_id: str, step: int, agg: StepAggregates | None) -> None:
    """Replace the stored aggregates of (job, step) with ``agg`` (None: remove them)."""
    for model in (JobStepStat, RankStepStat, CollectiveStepStat):
        session.execute(delete(model).where(model.job_id == job_id, model.step == step))
    if agg is None:
        return
    session.execute(insert(JobStepStat), [agg.job])
    if agg.collectives:
        session.execute(insert(CollectiveStepStat), agg.collectives)
    bulk_insert(session, "rank_step_stats", RANK_STAT_COLUMNS, list(map(_rank_stat_values, agg.ranks)))


__all__ = [
    "COLL_ROW_FIELDS", "STEP_ROW_FIELDS", "StepAggregates", "compute_step", "load_step", "stored_history", "write_step",
]
