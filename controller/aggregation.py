"""Per-step telemetry aggregates, and the rolling window of raw samples.

Raw rows (``step_metrics``: one per rank and step; ``collective_metrics``: one per rank, step and
collective call) are what ingest appends. They are kept for ``VIGIL_RAW_RETENTION_S`` and then
pruned; what stays for good are the aggregates computed here from them:

* ``job_step_stats``: one row per (job, step) over all ranks (mean loss over the finite ones, mean
  validation loss, total throughput, p50 / p90 / max step time, slowest rank, most-waiting rank,
  bytes, and when the step ran: the kept attempt's start and the earlier attempts, see below);
* ``rank_step_stats``: one row per (job, step, rank), the rank's step breakdown (data, fwd+bwd,
  optimizer, communication, wait inside collectives, bytes);
* ``collective_step_stats``: one row per (job, step, op, group, tag): p50 / max / min over ranks of
  the time each rank spent in that kind of collective in the step, the slowest rank, the wait, the
  bytes.

So a 10,000-rank job with k collectives per step keeps ``10,000 x (k + 1)`` raw rows per step only
for the window, and ``10,000 + kinds + 1`` rows per step for good: the per-collective dimension
is folded into one row per kind of collective, the per-call detail lives only in the window.

**Wait inside collectives.** A collective call is identified by (job, step, seq): every rank's
``seq``-th call of the step. A collective cannot finish on any rank before the last rank has
joined, so the fastest rank's duration is the best available estimate of the transfer itself
(it arrived last and waited for nobody); every other rank's excess over that minimum is time it
spent waiting for the others: ``wait(rank, call) = duration(rank, call) - min over ranks of
duration(call)``. A rank's step wait is the sum over its calls, and a kind's ``transfer_s`` the
sum over its calls of the minimum. The estimate is conservative: the fastest rank may also have
waited a little (skewed clocks inside the collective library), which is then counted as transfer.

**When.** Ingest marks every (job, step) it writes raw rows for as dirty (``telemetry_dirty_steps``,
in the same transaction). :func:`aggregate_ready` recomputes a dirty step from all its raw rows
once it has settled (no new rows for ``settle_s``), writes the three kinds of aggregates (replacing
any earlier ones) and clears the flag, only if no ingest bumped it meanwhile. Late samples (an
agent replaying its spool after an outage) simply make the step dirty again: recomputation from
the raw rows is idempotent, so the result never depends on arrival order and nothing is counted
twice. A rank that re-runs a step after a restart from a checkpoint replaces its earlier samples
of that step (the latest sample per (rank, seq) wins).

**Attempts.** A step's raw step samples also say when it ran (``[ts - step_time_s, ts]`` per rank):
the ranks' latest samples that overlap the newest one in time are the kept attempt (its earliest
start is ``start_ts``); every other sample (one a rank replaced, or a rank's latest one from an
earlier run, e.g. of a rank evicted since) ran in an earlier attempt, whose time ranges are kept,
merged, in ``reruns`` (``[[start, end], ...]``, None when the step ran once). The goodput view
(:mod:`controller.views`) counts that time as lost.

**Retention.** :func:`prune_raw` deletes raw rows of steps that are aggregated, not dirty, and
whose newest sample is older than the window, a bounded number of rows per pass.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from controller.aggregation_process import AggregationProcess
from controller.background import BackgroundLoop
from controller.db import session_scope, sqlite_writer
from controller.models import (
    CollectiveMetric,
    CollectiveStepStat,
    Job,
    JobStepStat,
    RankStepStat,
    StepMetric,
    TelemetryDirtyStep,
)
from controller.telemetry import bulk_insert

log = logging.getLogger(__name__)

RANK_STAT_COLUMNS = (
    "job_id", "step", "rank", "node_id", "ts", "loss", "tokens_per_s", "step_time_s", "data_s", "fwd_bwd_s",
    "optim_s", "comm_s", "comm_wait_s", "collectives", "payload_bytes", "wire_bytes",
)


_rank_stat_values = itemgetter(*RANK_STAT_COLUMNS)


def nearest_rank(ordered: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile of sorted values by the nearest-rank definition: the ``ceil(pct/100 n)``-th
    smallest (integer arithmetic, so that 0.9 x 100 does not round up to the 91st); an observed value."""
    return ordered[-(-pct * len(ordered) // 100) - 1]


def p50(values: Sequence[float]) -> float:
    """Nearest-rank median (the lower middle value for an even count): always an observed value."""
    return nearest_rank(sorted(values), 50)


def p90(values: Sequence[float]) -> float:
    """Nearest-rank 90th percentile."""
    return nearest_rank(sorted(values), 90)


def finite_mean(values: Iterable[float | None]) -> float | None:
    """Mean of the finite values (None: there are none)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def step_figures(times: Mapping[int, float], losses: Iterable[float | None], val_losses: Iterable[float | None],
                 tokens_per_s: Iterable[float | None]) -> dict[str, Any]:
    """The job-wide figures of one step from its ranks' latest samples (``times``: rank -> step time):
    :func:`p50`, :func:`p90`, max and its rank (the lowest on ties), means over finite losses.

    The one definition the aggregator and the views (forming steps) share."""
    out: dict[str, Any] = {
        "loss_mean": finite_mean(losses),
        "val_loss_mean": finite_mean(val_losses),
        "tokens_per_s": sum(t for t in tokens_per_s if t is not None) if times else None,
        "step_time_p50_s": None, "step_time_p90_s": None, "step_time_max_s": None, "slowest_rank": None,
        "reporting": len(times),
    }
    if times:
        ordered = sorted(times.values())
        top = ordered[-1]
        out.update(step_time_p50_s=nearest_rank(ordered, 50), step_time_p90_s=nearest_rank(ordered, 90),
                   step_time_max_s=top, slowest_rank=min(r for r, t in times.items() if t == top))
    return out


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[list[float]]:
    """Overlapping ``(start, end)`` ranges merged, in time order."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def attempt_spans(samples: Iterable[tuple[int, float, float]]) -> tuple[float | None, list[list[float]] | None]:
    """When one step ran, from its ``(rank, ts, step_time_s)`` step samples in arrival order.

    Returns the kept attempt's start (the earliest start among the ranks' latest samples that overlap,
    transitively, the newest one) and the merged time ranges of the earlier attempts (None: none).
    The ranks of one attempt run the step together (its collectives join them), so their ranges
    overlap; a restart separates attempts by at least the time it takes.
    """
    latest: dict[int, tuple[float, float]] = {}
    earlier: list[tuple[float, float]] = []
    for rank, ts, st in samples:
        if rank in latest:
            earlier.append(latest[rank])
        latest[rank] = (ts - (st or 0.0), ts)
    if not latest:
        return None, None
    # The kept attempt: walking back from the newest end, every range that reaches the attempt so far.
    spans = sorted(latest.values(), key=lambda s: s[1], reverse=True)
    start = spans[0][0]
    for s, e in spans[1:]:
        if e >= start:
            start = min(start, s)
        else:
            earlier.append((s, e))
    return start, (merge_spans(earlier) or None)


def _argmax(values: dict[int, float]) -> int:
    """The rank with the largest value (the lowest such rank on ties)."""
    return min(values, key=lambda r: (-values[r], r))


@dataclass
class StepAggregates:
    """What one step of one job aggregates to (plain dicts, column name -> value)."""

    job: dict[str, Any]
    ranks: list[dict[str, Any]]
    collectives: list[dict[str, Any]]


# Raw row layouts fetched for one step (positions used below).
_STEP_FIELDS = (
    StepMetric.rank, StepMetric.node_id, StepMetric.ts, StepMetric.loss, StepMetric.tokens_per_s,
    StepMetric.step_time_s, StepMetric.data_s, StepMetric.fwd_bwd_s, StepMetric.optim_s, StepMetric.comm_s,
    StepMetric.val_loss,
)
_COLL_FIELDS = (
    CollectiveMetric.rank, CollectiveMetric.seq, CollectiveMetric.op, CollectiveMetric.group,
    CollectiveMetric.tag, CollectiveMetric.duration_s, CollectiveMetric.payload_bytes,
    CollectiveMetric.wire_bytes, CollectiveMetric.elements, CollectiveMetric.ts, CollectiveMetric.node_id,
)


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


def fastest_of_calls(durations: Iterable[tuple[Hashable, float]]) -> dict[Hashable, float]:
    """The fastest duration of each call, from ``(call, duration)`` pairs of every rank.

    How Vigil splits the time inside a collective, here and in the straggler detector: the fastest
    rank's duration is the transfer (it waited for nobody); every other rank's duration minus it is
    that rank's *wait* for the last one to arrive (:func:`waits_in_call`).
    """
    fastest: dict[Hashable, float] = {}
    for call, d in durations:
        if call not in fastest or d < fastest[call]:
            fastest[call] = d
    return fastest


def waits_in_call(per_rank: Mapping[int, float]) -> dict[int, float]:
    """Each rank's wait inside one call: its duration minus the call's fastest (:func:`fastest_of_calls`)."""
    fastest = min(per_rank.values())
    return {rank: d - fastest for rank, d in per_rank.items()}


def compute_step(job_id: str, step: int, step_rows: Iterable[Sequence[Any]],
                 coll_rows: Iterable[Sequence[Any]]) -> StepAggregates | None:
    """Aggregate one step from its raw rows (each iterable in arrival order, fields as ``_STEP_FIELDS``
    and ``_COLL_FIELDS``; ``val_loss``, the last step field, may be left out). Later rows of the same
    (rank) or (rank, seq) replace earlier ones. None when there is nothing to aggregate."""
    step_rows = list(step_rows)
    steps: dict[int, Sequence[Any]] = {}
    for r in step_rows:
        steps[r[0]] = r
    calls: dict[tuple[int, int], Sequence[Any]] = {}
    for c in coll_rows:
        calls[(c[0], c[1])] = c
    fastest = fastest_of_calls((seq, c[5]) for (_, seq), c in calls.items())
    kinds: dict[Kind, dict[int, _KindRank]] = {}
    transfer: dict[Kind, dict[int, float]] = {}
    for (rank, seq), c in calls.items():
        _, _, op, group, tag, d, payload, wire, elements, ts, node = c
        kr = kinds.setdefault((op, group, tag), {}).setdefault(rank, _KindRank(node=node))
        kr.dur += d
        kr.wait += d - fastest[seq]
        kr.calls += 1
        kr.payload += payload
        kr.wire += wire
        kr.elements += elements
        kr.ts = max(kr.ts, ts)
        transfer.setdefault((op, group, tag), {})[seq] = fastest[seq]
    return _assemble(job_id, step, steps, kinds, {k: sum(v.values()) for k, v in transfer.items()}, len(calls),
                     attempt_spans((r[0], r[2], r[5]) for r in step_rows))


def _assemble(job_id: str, step: int, steps: dict[int, Sequence[Any]], kinds: dict[Kind, dict[int, _KindRank]],
              transfer: dict[Kind, float], n_calls: int,
              spans: tuple[float | None, list[list[float]] | None] = (None, None)) -> StepAggregates | None:
    """The three kinds of aggregate rows from per-rank step rows and per (kind, rank) collective totals
    (``spans``: :func:`attempt_spans` of the step rows)."""
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
        comm_s = s[9] if s is not None and s[9] is not None else r_comm.get(rank)
        ranks.append({
            "job_id": job_id, "step": step, "rank": rank,
            "node_id": s[1] if s is not None else r_node[rank],
            "ts": s[2] if s is not None else r_ts[rank],
            "loss": s[3] if s is not None else None,
            "tokens_per_s": s[4] if s is not None else None,
            "step_time_s": s[5] if s is not None else None,
            "data_s": s[6] if s is not None else None,
            "fwd_bwd_s": s[7] if s is not None else None,
            "optim_s": s[8] if s is not None else None,
            "comm_s": comm_s,
            "comm_wait_s": r_wait.get(rank, 0.0) if rank in r_calls else None,
            "collectives": r_calls.get(rank, 0),
            "payload_bytes": r_payload.get(rank, 0),
            "wire_bytes": r_wire.get(rank, 0),
        })

    times: dict[int, float] = {r["rank"]: r["step_time_s"] for r in ranks if r["step_time_s"] is not None}
    waits: dict[int, float] = {r["rank"]: r["comm_wait_s"] for r in ranks if r["comm_wait_s"] is not None}
    comms: list[float] = [r["comm_s"] for r in ranks if r["comm_s"] is not None]
    figures = step_figures(times, (r["loss"] for r in ranks), (s[10] if len(s) > 10 else None for s in steps.values()),
                           (r["tokens_per_s"] for r in ranks))
    job = {
        "job_id": job_id, "step": step, "ts": max(r["ts"] for r in ranks), "ranks": len(ranks),
        **figures,
        "start_ts": spans[0], "reruns": spans[1],
        "comm_s_max": max(comms) if comms else None,
        "comm_wait_max_s": max(waits.values()) if waits else None,
        "most_waiting_rank": _argmax(waits) if waits else None,
        "collectives": n_calls,
        "payload_bytes": sum(r_payload.values()),
        "wire_bytes": sum(r_wire.values()),
    }
    return StepAggregates(job=job, ranks=ranks, collectives=collectives)


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
    steps: dict[int, Sequence[Any]] = {}
    for r in step_rows:
        steps[r[0]] = r
    C = CollectiveMetric
    where = (C.job_id == job_id, C.step == step)
    # Duplicates (a (rank, seq) stored under two run attempts: the rank re-ran the step after a restart)
    # take the exact, row-by-row path. The unique key (job, step, rank, attempt, seq) allows them only
    # across attempts, so a group with one attempt has none: min = max attempt, found in the same scan
    # (a count of distinct seqs per group cost a sort per group: a third of this query on SQLite).
    per_kind_rank = conn.execute(
        select(C.op, C.group, C.tag, C.rank, func.count(), func.min(C.attempt), func.max(C.attempt),
               func.sum(C.duration_s), func.sum(C.payload_bytes), func.sum(C.wire_bytes), func.sum(C.elements),
               func.max(C.ts), func.min(C.node_id))
        .where(*where).group_by(C.op, C.group, C.tag, C.rank)
    ).all()
    if any(r[5] != r[6] for r in per_kind_rank):
        coll_rows = conn.execute(select(*_COLL_FIELDS).where(*where).order_by(C.attempt, C.id)).all()
        return compute_step(job_id, step, step_rows, coll_rows)
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
    if len(fastest) == len(per_call) and all(r[4] == calls_of[(r[0], r[1], r[2])] for r in per_kind_rank):
        waits = {(r[0], r[1], r[2], r[3]): float(r[7]) - transfer[(r[0], r[1], r[2])] for r in per_kind_rank}
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
    spans = attempt_spans((r[0], r[2], r[5]) for r in step_rows)
    kinds: dict[Kind, dict[int, _KindRank]] = {}
    n_calls = 0
    for op, group, tag, rank, count, _, _, dur, payload, wire, elements, ts, node in per_kind_rank:
        kinds.setdefault((op, group, tag), {})[rank] = _KindRank(
            dur=float(dur), wait=max(0.0, waits[(op, group, tag, rank)]), calls=int(count), payload=int(payload),
            wire=int(wire), elements=int(elements), ts=float(ts), node=node)
        n_calls += int(count)
    return _assemble(job_id, step, steps, kinds, transfer, n_calls, spans)


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


def aggregate_ready(sessions: sessionmaker[Session], now: float, settle_s: float, max_steps: int = 64) -> int:
    """(Re)compute the dirty steps that have settled, oldest first, each in its own transaction.

    Returns how many steps were aggregated. A step whose flag was bumped while it was being
    computed stays dirty and is done again on a later pass.
    """
    with session_scope(sessions) as session:
        ready = session.execute(
            select(TelemetryDirtyStep.job_id, TelemetryDirtyStep.step, TelemetryDirtyStep.version)
            .where(TelemetryDirtyStep.touched_at <= now - settle_s)
            .order_by(TelemetryDirtyStep.touched_at, TelemetryDirtyStep.job_id, TelemetryDirtyStep.step)
            .limit(max_steps)
        ).all()
    done = 0
    for job_id, step, version in ready:
        try:
            # Read, then write in a transaction of its own, in this process's queue of SQLite writers
            # (controller.db.sqlite_writer): telemetry requests wait only for the write, not the read.
            # Rows that arrive in between bump the step's version: it stays dirty and is done again.
            with session_scope(sessions) as session:
                agg = load_step(session, job_id, step)
            with sqlite_writer(sessions), session_scope(sessions) as session:
                write_step(session, job_id, step, agg)
                session.execute(
                    delete(TelemetryDirtyStep).where(
                        TelemetryDirtyStep.job_id == job_id, TelemetryDirtyStep.step == step,
                        TelemetryDirtyStep.version == version,
                    )
                )
            done += 1
        except (IntegrityError, OperationalError) as exc:
            # Another aggregator (a second controller on the same database) wrote the same step,
            # or the database was busy: the step stays dirty and is recomputed on a later pass.
            log.info("aggregating %s step %d deferred: %s", job_id, step, type(exc).__name__)
    return done


def prune_raw(sessions: sessionmaker[Session], now: float, retention_s: float, max_rows: int = 500_000) -> int:
    """Delete raw rows of aggregated, settled steps whose newest sample is older than the window.

    At most about ``max_rows`` rows per call (whole steps at a time); returns the rows deleted.
    """
    cutoff = now - retention_s
    deleted = 0
    with session_scope(sessions) as session:
        job_ids = list(session.scalars(select(Job.id)))
    for job_id in job_ids:
        if deleted >= max_rows:
            break
        with session_scope(sessions) as session:
            lows = [session.scalar(select(func.min(m.step)).where(m.job_id == job_id))
                    for m in (StepMetric, CollectiveMetric)]
            present = [x for x in lows if x is not None]
            if not present:
                continue
            lo: int = min(present)
            hi = session.scalar(
                select(func.max(JobStepStat.step)).where(
                    JobStepStat.job_id == job_id, JobStepStat.step >= lo, JobStepStat.ts < cutoff
                )
            )
            if hi is None:
                continue
            dirty = session.scalar(select(func.min(TelemetryDirtyStep.step)).where(TelemetryDirtyStep.job_id == job_id))
            if dirty is not None:
                hi = min(hi, dirty - 1)
            if hi < lo:
                continue
            # Whole steps, about max_rows rows at most (estimated from the oldest step).
            per_step = 1 + (session.scalar(
                select(func.count()).select_from(CollectiveMetric)
                .where(CollectiveMetric.job_id == job_id, CollectiveMetric.step == lo)
            ) or 0) + (session.scalar(
                select(func.count()).select_from(StepMetric).where(StepMetric.job_id == job_id, StepMetric.step == lo)
            ) or 0)
            hi = min(hi, lo + max(0, (max_rows - deleted) // per_step - 1))
            for model in (CollectiveMetric, StepMetric):
                result = session.execute(
                    delete(model).where(model.job_id == job_id, model.step >= lo, model.step <= hi)
                )
                deleted += result.rowcount or 0  # type: ignore[attr-defined]
    if deleted:
        log.info("pruned %d raw telemetry rows older than %.0fs", deleted, retention_s)
    return deleted


@dataclass
class MaintenanceReport:
    aggregated_steps: int = 0
    pruned_rows: int = 0


class TelemetryMaintainer(BackgroundLoop):
    """Runs :func:`aggregate_ready` every ``interval_s`` and :func:`prune_raw` every ``prune_interval_s``.

    ``step()`` does one pass (tests drive it with their own clock); ``start()`` runs passes in a
    daemon thread until ``stop()``, or, given ``process``, in a child process the thread keeps alive.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        retention_s: float,
        settle_s: float = 2.0,
        interval_s: float = 1.0,
        prune_interval_s: float = 30.0,
        max_steps_per_pass: int = 64,
        clock: Callable[[], float] = time.time,
        process: AggregationProcess | None = None,
    ) -> None:
        self.sessions = sessions
        self.retention_s = retention_s
        self.settle_s = settle_s
        self.interval_s = interval_s
        self.prune_interval_s = prune_interval_s
        self.max_steps_per_pass = max_steps_per_pass
        self.clock = clock
        self._next_prune = float("-inf")
        self.process = process  # set: the background passes run there, this thread keeps it running
        super().__init__()

    def step(self, now: float | None = None, *, prune: bool | None = None) -> MaintenanceReport:
        """One pass: aggregate what has settled; prune when due (or when ``prune`` says so)."""
        now = self.clock() if now is None else now
        report = MaintenanceReport()
        report.aggregated_steps = aggregate_ready(self.sessions, now, self.settle_s, self.max_steps_per_pass)
        if prune or (prune is None and now >= self._next_prune):
            self._next_prune = now + self.prune_interval_s
            report.pruned_rows = prune_raw(self.sessions, now, self.retention_s)
        return report

    def flush(self, now: float | None = None) -> int:
        """Aggregate every dirty step now, settled or not (tests, shutdown); returns the steps done."""
        now = self.clock() if now is None else now
        total = 0
        while True:
            n = aggregate_ready(self.sessions, now + self.settle_s, self.settle_s, self.max_steps_per_pass)
            total += n
            if n < self.max_steps_per_pass:
                return total

    # -- background thread (BackgroundLoop: start, stop, wake) ------------------------------------
    thread_name = "vigil-telemetry"

    def pause_s(self) -> float:
        """The interval, or less: until the earliest dirty step settles (not up to an interval later)."""
        if self.process is not None:
            return self.interval_s  # this thread only keeps the child running
        with session_scope(self.sessions) as session:
            touched = session.scalar(select(func.min(TelemetryDirtyStep.touched_at)))
        if touched is None:
            return self.interval_s
        wait = touched + self.settle_s - self.clock()
        if wait <= 0:  # settled before this pass and still dirty (deferred): no faster than twice a second
            return min(self.interval_s, 0.5)
        return min(self.interval_s, max(0.05, wait + 0.01))

    def tick(self) -> bool:
        if self.process is not None:
            self.process.ensure_running()
            return False
        # A full pass means a backlog: go again at once.
        return self.step().aggregated_steps >= self.max_steps_per_pass

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self.process is not None:
            self.process.stop(timeout)


__all__ = [
    "MaintenanceReport", "StepAggregates", "TelemetryMaintainer", "aggregate_ready", "attempt_spans", "compute_step",
    "finite_mean", "load_step", "merge_spans", "nearest_rank", "p50", "p90", "prune_raw", "step_figures",
    "write_step",
]
