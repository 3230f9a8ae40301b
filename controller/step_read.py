"""The one reader of a job's per-step aggregates, *final* or *forming*, for every read of them: the overview,
heatmap and markers (:mod:`controller.views`, :mod:`controller.view_markers`), the step and collective series
(:mod:`controller.series`), goodput (:mod:`controller.goodput`) and Prometheus (:mod:`controller.prometheus`).

**Final or forming.** A step's aggregates are written by the aggregation pass once it has settled
(:mod:`controller.aggregation`); until then it is marked dirty. Of the dirty steps a read sees
(:func:`read_steps`), the newest :data:`MAX_FORMING_STEPS` are *forming*: computed per request from their raw
samples with the aggregator's own definitions (:func:`controller.step_stats.step_figures`,
:func:`~controller.step_stats.attempt_spans`, :func:`controller.step_aggregates.load_step`), the latest sample of
each rank winning. An older dirty step shows its earlier aggregate, if it has one (``final`` False). The dirty
steps are read *before* the aggregates: a step is always either dirty or aggregated (the aggregator writes its
rows and clears the flag in one transaction), so none falls between the two reads.

**Names.** A :class:`StepRecord` carries the names of the REST API (:class:`~vigil.contract.schemas.
JobOverviewPublic`); the one renaming on the way, ``job_step_stats.loss_mean`` (the mean over ranks, as the table
calls it) to ``loss`` and ``val_loss_mean`` to ``val_loss``, is done here, in :func:`_record`, for final and
forming steps alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, cast, distinct, func, select
from sqlalchemy.orm import Session

from controller.models import CollectiveMetric, JobStepStat, RankStepStat, StepMetric, TelemetryDirtyStep
from controller.step_aggregates import StepAggregates, load_step
from controller.step_stats import attempt_spans, step_figures

MAX_FORMING_STEPS = 64
"""The newest dirty steps one read computes from their raw samples (*forming*); the one cap of every reader.

It costs only while the aggregator is behind (when it keeps up, a few steps are dirty). Then, with 64 dirty steps of
32 ranks and 10 calls each (SQLite, a busy 2-core host, 2026-11-28): /steps about 0.5 s and /collectives
0.45 s (each forming step aggregated by :func:`load_step`), against 0.1 s and 0.05 s with a cap of 8; the
overview 0.05-0.09 s against 0.02 s. 64 is kept so that the overview does not stop short while the
aggregator catches up (:func:`cut_before_unshown`)."""

FORMING_FIELDS = ("rank", "node_id", "ts", "loss", "val_loss", "tokens_per_s", "step_time_s", "comm_wait_s")
"""The raw step columns a forming step is read with (rows carry these names)."""


@dataclass
class Forming:
    """One forming step as its raw samples show it now."""

    rows: dict[int, Any]
    """Rank -> its latest raw step row (:data:`FORMING_FIELDS`)."""
    start: float
    """When the kept attempt started (:func:`attempt_spans`)."""
    end: float
    """The newest end among the ranks' latest samples."""
    reruns: list[list[float]] | None
    """Time ranges of its earlier attempts (None: it ran once)."""


@dataclass
class JobSteps:
    """A job's steps as one request sees them: which are dirty, and which of those are forming."""

    job_id: str
    dirty: set[int]
    forming: list[int]
    """The newest :data:`MAX_FORMING_STEPS` dirty steps, ascending."""
    _raw: dict[int, Forming] | None = field(default=None, repr=False)


def read_steps(session: Session, job_id: str, since_step: int | None = None,
               until_step: int | None = None) -> JobSteps:
    """The job's dirty steps in ``since_step..until_step`` and the forming ones among them. Read this before
    any aggregate (module docstring)."""
    D = TelemetryDirtyStep
    q = select(D.step).where(D.job_id == job_id)
    if since_step is not None:
        q = q.where(D.step >= since_step)
    if until_step is not None:
        q = q.where(D.step <= until_step)
    dirty = sorted(session.scalars(q))
    return JobSteps(job_id, set(dirty), dirty[-MAX_FORMING_STEPS:])


def forming_rows(session: Session, st: JobSteps) -> dict[int, Forming]:
    """The forming steps from their raw samples (read once per :class:`JobSteps`): the latest row of each rank,
    and the step's attempts by the aggregator's rule (:func:`attempt_spans`, over every sample in arrival order)."""
    if st._raw is not None:
        return st._raw
    per: dict[int, list[Any]] = defaultdict(list)
    if st.forming:
        S = StepMetric
        # Core, not ORM, execution (no per-row ORM processing); (step, id) is the order of the (job_id, step) index.
        for r in session.connection().execute(
                select(S.step, *(getattr(S, f) for f in FORMING_FIELDS))
                .where(S.job_id == st.job_id, S.step.in_(st.forming)).order_by(S.step, S.attempt, S.id)).all():
            per[r.step].append(r)
    st._raw = {}
    for step, samples in per.items():
        latest = {r.rank: r for r in samples}
        start, reruns = attempt_spans((r.rank, r.ts, r.step_time_s) for r in samples)
        st._raw[step] = Forming(latest, start if start is not None else min(r.ts for r in samples),
                                max(r.ts for r in latest.values()), reruns)
    return st._raw


class StepRecord(NamedTuple):
    """One step's job-wide figures, named as the REST API names them (:class:`JobOverviewPublic`)."""

    step: int
    ts: float
    """When the step ended (its ranks' latest samples)."""
    start_ts: float | None
    """When its kept attempt started (None: an aggregate from before migration 0006)."""
    reruns: list[list[float]] | None
    loss: float | None
    """Mean over the ranks' finite losses (``job_step_stats.loss_mean``)."""
    val_loss: float | None
    tokens_per_s: float
    step_time_p50_s: float
    step_time_p90_s: float
    step_time_max_s: float
    slowest_rank: int
    reporting: int
    wire_bytes: int
    final: bool


def _record(step: int, m: Mapping[str, Any], final: bool) -> StepRecord:
    """A record from figures named as ``job_step_stats`` names them (a row of it, or :func:`step_figures`
    plus ``ts``, ``start_ts``, ``reruns``, ``wire_bytes``): the one place the table's names become the API's."""
    return StepRecord(step=step, ts=m["ts"], start_ts=m["start_ts"], reruns=m["reruns"], loss=m["loss_mean"],
                      val_loss=m["val_loss_mean"], tokens_per_s=m["tokens_per_s"] or 0.0,
                      step_time_p50_s=m["step_time_p50_s"], step_time_p90_s=m["step_time_p90_s"],
                      step_time_max_s=m["step_time_max_s"], slowest_rank=m["slowest_rank"], reporting=m["reporting"],
                      wire_bytes=int(m["wire_bytes"] or 0), final=final)


_J = JobStepStat
_FINAL = select(_J.step, _J.ts, _J.start_ts, _J.reruns, _J.loss_mean, _J.val_loss_mean, _J.tokens_per_s,
                _J.step_time_p50_s, _J.step_time_p90_s, _J.step_time_max_s, _J.slowest_rank, _J.reporting,
                _J.wire_bytes)


def step_records(session: Session, st: JobSteps, since_step: int | None = None) -> dict[int, StepRecord]:
    """Step -> record of every training step of the job from ``since_step``: the aggregated ones (``final``
    unless dirty again), replaced by the forming ones computed now. Steps of collectives alone (no step
    sample: the start-up broadcasts) are left out."""
    q = _FINAL.where(_J.job_id == st.job_id, _J.step_time_max_s.is_not(None))
    if since_step is not None:
        q = q.where(_J.step >= since_step)
    out: dict[int, StepRecord] = {}
    legacy: dict[int, Any] = {}
    for r in session.connection().execute(q).all():
        if r.reporting is None:
            legacy[r.step] = r
        else:
            out[r.step] = _record(r.step, r._mapping, r.step not in st.dirty)
    for step, fig in _legacy_figures(session, st.job_id, sorted(legacy)).items():
        out[step] = _record(step, {**legacy[step]._mapping, **fig}, step not in st.dirty)
    wanted = {s: f for s, f in forming_rows(session, st).items() if since_step is None or s >= since_step}
    wire = _forming_wire_bytes(session, st.job_id, sorted(wanted))
    for step, f in wanted.items():
        rows = f.rows.values()
        fig = step_figures({r.rank: r.step_time_s for r in rows}, (r.loss for r in rows),
                           (r.val_loss for r in rows), (r.tokens_per_s for r in rows))
        out[step] = _record(step, {**fig, "ts": f.end, "start_ts": f.start, "reruns": f.reruns,
                                   "wire_bytes": wire.get(step, 0)}, False)
    return out


def cut_before_unshown(session: Session, st: JobSteps, records: dict[int, StepRecord],
                       since_step: int | None = None) -> dict[int, StepRecord]:
    """``records`` up to just before the first dirty step that is neither forming nor aggregated yet (from
    ``since_step``): a client polling from ``last_step + 1`` must never skip a step it could not see."""
    older = [s for s in st.dirty
             if s not in records and s not in st.forming and (since_step is None or s >= since_step)]
    if not older:
        return records
    have = set(session.scalars(select(_J.step).where(_J.job_id == st.job_id, _J.step.in_(older))))
    missing = [s for s in older if s not in have]
    if not missing:
        return records
    return {s: r for s, r in records.items() if s < min(missing)}


def forming_aggregates(session: Session, st: JobSteps) -> dict[int, StepAggregates]:
    """All three kinds of aggregates of each forming step, computed now (:func:`load_step`): what the
    per-rank and per-collective series show of steps not aggregated yet."""
    out = {}
    for step in st.forming:
        agg = load_step(session, st.job_id, step)
        if agg is not None:
            out[step] = agg
    return out


def newest_final(session: Session, job_id: str) -> JobStepStat | None:
    """The job's newest aggregated step (None: none yet): what Prometheus exports, final figures only."""
    return session.scalars(select(_J).where(_J.job_id == job_id).order_by(_J.step.desc()).limit(1)).first()


def forming_spans(session: Session, st: JobSteps) -> dict[int, tuple[float, float]]:
    """Step -> (start, end) of its kept attempt, for the forming steps."""
    return {step: (f.start, f.end) for step, f in forming_rows(session, st).items()}


def _legacy_figures(session: Session, job_id: str, steps: list[int]) -> dict[int, dict[str, Any]]:
    """Figures of aggregates written before migration 0006 (``reporting`` NULL), from their rank rows."""
    R = RankStepStat
    per: dict[int, dict[int, Any]] = defaultdict(dict)
    for i in range(0, len(steps), 500):
        for r in session.execute(select(R.step, R.rank, R.loss, R.tokens_per_s, R.step_time_s).where(
                R.job_id == job_id, R.step.in_(steps[i:i + 500]), R.step_time_s.is_not(None))).all():
            per[r.step][r.rank] = r
    return {step: step_figures({k: r.step_time_s for k, r in rows.items()}, (r.loss for r in rows.values()), (),
                               (r.tokens_per_s for r in rows.values()))
            for step, rows in per.items()}


def _forming_wire_bytes(session: Session, job_id: str, steps: Sequence[int]) -> dict[int, int]:
    """Wire bytes of forming steps, the latest sample of each (rank, seq) counted once."""
    if not steps:
        return {}
    C = CollectiveMetric
    key = cast(C.rank, BigInteger) * 2_147_483_648 + C.seq  # (rank, seq) as one number: portable COUNT(DISTINCT)
    out: dict[int, int] = {}
    dup_steps = []
    for step, total, n, n_distinct in session.execute(
        select(C.step, func.sum(C.wire_bytes), func.count(), func.count(distinct(key)))
        .where(C.job_id == job_id, C.step.in_(list(steps))).group_by(C.step)
    ).all():
        if n == n_distinct:
            out[step] = int(total or 0)
        else:
            dup_steps.append(step)
    if dup_steps:
        latest: dict[tuple[int, int, int], int] = {}
        for step, rank, seq, wire in session.execute(
            select(C.step, C.rank, C.seq, C.wire_bytes).where(C.job_id == job_id, C.step.in_(dup_steps))
            .order_by(C.attempt, C.id)
        ).all():
            latest[(step, rank, seq)] = wire
        for (step, _, _), wire in latest.items():
            out[step] = out.get(step, 0) + int(wire)
    return out


__all__ = [
    "FORMING_FIELDS", "MAX_FORMING_STEPS", "Forming", "JobSteps", "StepRecord", "cut_before_unshown",
    "forming_aggregates", "forming_rows", "forming_spans", "newest_final", "read_steps", "step_records",
]
