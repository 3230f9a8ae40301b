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

How the wait inside collectives, the transfer and a step's attempts (``start_ts``, ``reruns``) are
defined: :mod:`controller.step_stats`; how one step is computed and written:
:mod:`controller.step_aggregates`. This module holds the passes that keep the aggregates up to date.

**When.** Ingest marks every (job, step) it writes raw rows for as dirty (``telemetry_dirty_steps``,
in the same transaction). :func:`aggregate_ready` recomputes a dirty step from all its raw rows
once it has settled (no new rows for ``settle_s``), writes the three kinds of aggregates (replacing
any earlier ones) and clears the flag, only if no ingest bumped it meanwhile. Late samples (an
agent replaying its spool after an outage) simply make the step dirty again: recomputation from
the raw rows is idempotent, so the result never depends on arrival order and nothing is counted
twice. A rank that re-runs a step after a restart from a checkpoint replaces its earlier samples
of that step (the latest sample per (rank, seq) wins).

**Retention.** :func:`prune_raw` deletes raw rows of steps that are aggregated, not dirty, and
whose newest sample is older than the window, a bounded number of rows per pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from controller.db import session_scope, sqlite_writer
from controller.models import CollectiveMetric, Job, JobStepStat, StepMetric, TelemetryDirtyStep
from controller.step_aggregates import load_step, write_step
from vigil.contract.background import BackgroundLoop

log = logging.getLogger(__name__)


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


class MaintainerProcess(Protocol):
    """Where the maintainer's passes run when not in its own thread: a child process it keeps alive
    (:class:`controller.aggregation_process.AggregationProcess`, which imports this module, not the
    other way round)."""

    def ensure_running(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...


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
        process: MaintainerProcess | None = None,
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
    "MaintainerProcess", "MaintenanceReport", "TelemetryMaintainer", "aggregate_ready", "prune_raw",
]
