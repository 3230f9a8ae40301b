"""The job page's incremental refresh: what it has drawn (:class:`Cursor`), what to ask the controller
for next, whether to patch or rebuild, and the ETA from the recent pace.

Pure functions of wire-schema objects and plain dicts (what a ``dcc.Store`` holds), so the page's
callbacks stay thin and all of this is unit-tested without a server.

The page keeps a :class:`Cursor` in a ``dcc.Store``: the newest step it has drawn, how many points the
line figures hold, the steps at their end that were still forming (not ``final``: the controller had
not all of their samples), and the restarts and markers seen. Each refresh asks the controller's
overview only for the steps from the first one still forming, else after the newest drawn
(``since_step``), and patches the drawn figures with a ``dash.Patch``
(:func:`dashboard.pages.job.figures.overview.overview_patches`): the forming tail is deleted and drawn
again, the new steps appended. It rebuilds everything from a full fetch instead when it has nothing
drawn, when the job restarted (a restart re-runs steps already drawn: the overview keeps the latest
attempt of each), when the forming tail is long (:data:`MAX_TAIL`), or when the figures would grow
past :data:`MAX_DRAWN_POINTS` (the full fetch comes back decimated).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dashboard.pages.job.figures.overview import SPARSE_FIELDS
from dashboard.pages.job.figures.ranks import STRAGGLER_RATIO
from vigil.contract.schemas import JobMarker, JobOverviewPublic, RankSummary

MAX_DRAWN_POINTS = 4000
"""Past this many steps in the line figures, the next refresh rebuilds them from a (decimated) full fetch."""
MAX_TAIL = 50
"""Past this many steps still forming at the end of the figures, a refresh rebuilds them instead."""
RECENT = 32
"""Steps kept in the cursor to estimate the time per step (ETA)."""


# --------------------------------------------------------------------------------------------------
# Cursor and incremental refresh
# --------------------------------------------------------------------------------------------------


@dataclass
class Cursor:
    """What the page has drawn of one job (kept in the browser as a ``dcc.Store``; small)."""

    job_id: str
    last_step: int | None = None
    """Newest step drawn (the next fetch asks for the steps after it)."""
    points: int = 0
    """Steps in the line figures."""
    resume: int | None = None
    """The first drawn step that was still forming (the next fetch starts there), or None."""
    tail: int = 0
    """Drawn steps from ``resume`` on (deleted and drawn again by the next patch)."""
    tail_sparse: dict[str, int] = field(default_factory=dict)
    """Points among them of each line drawn only where it has a value, by overview field (validation
    loss: :data:`dashboard.pages.job.figures.overview.SPARSE_FIELDS`)."""
    restarts: int = 0
    """Restart markers seen: one more means steps were re-run, so the figures are rebuilt."""
    markers: int = 0
    """Markers drawn on the loss figure."""
    ranks: int = 0
    """Ranks that reported in the overview's rank window."""
    slowest: list[int] = field(default_factory=list)
    """The slowest ranks (top-k), slowest first."""
    stragglers: list[int] = field(default_factory=list)
    """Those of them at least :data:`~dashboard.pages.job.figures.ranks.STRAGGLER_RATIO` x the median rank
    (highlighted)."""
    recent: list[list[float]] = field(default_factory=list)
    """``[step, ts]`` of the newest :data:`RECENT` steps."""
    tick: int = 0
    """Refreshes so far (the tab views refresh when it changes)."""

    def to_store(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_store(cls, data: Mapping[str, Any] | None, job_id: str) -> Cursor | None:
        """The cursor of ``job_id`` kept in the store, or ``None`` (nothing drawn, or another job's)."""
        if not data or data.get("job_id") != job_id:
            return None
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except TypeError:
            return None


def restart_count(markers: Iterable[JobMarker]) -> int:
    return sum(1 for m in markers if m.kind == "restart")


def stragglers(slowest: Sequence[RankSummary], ratio: float = STRAGGLER_RATIO) -> list[int]:
    """Ranks of ``slowest`` at least ``ratio`` times slower than the median rank."""
    return [r.rank for r in slowest if r.vs_median >= ratio]


def since_step(cursor: Cursor | None) -> int | None:
    """What to pass as ``since_step`` to the overview: the first drawn step still forming, else the step
    after the newest drawn (None: everything)."""
    if cursor is None or cursor.last_step is None:
        return None
    return cursor.resume if cursor.resume is not None else cursor.last_step + 1


def needs_rebuild(cursor: Cursor | None, ov: JobOverviewPublic) -> bool:
    """Whether the incremental answer ``ov`` (fetched with :func:`since_step`) cannot simply patch
    what is drawn: nothing drawn yet, the job restarted since, a long forming tail, or too many points."""
    if cursor is None or cursor.last_step is None:
        return True
    if restart_count(ov.markers) != cursor.restarts or cursor.tail > MAX_TAIL:
        return True
    if ov.step and cursor.resume is not None and ov.step[0] != cursor.resume:
        return True  # not the answer to the question asked (a step vanished): start over
    return cursor.points - cursor.tail + len(ov.step) > MAX_DRAWN_POINTS


def _finals(ov: JobOverviewPublic) -> list[bool]:
    # Older controllers send no ``final``: every step counts as final.
    return list(ov.final) if len(ov.final) == len(ov.step) else [True] * len(ov.step)


def forming_tail(ov: JobOverviewPublic) -> tuple[int | None, int, dict[str, int]]:
    """The first step of ``ov`` still forming (None: all final), how many steps of ``ov`` are from it
    on, and how many of those have a value in each of :data:`SPARSE_FIELDS`."""
    finals = _finals(ov)
    first = next((i for i, f in enumerate(finals) if not f), None)
    if first is None:
        return None, 0, {}
    counts = {f: sum(1 for v in getattr(ov, f)[first:] if v is not None) for f in SPARSE_FIELDS}
    return ov.step[first], len(ov.step) - first, counts


def advance(cursor: Cursor | None, ov: JobOverviewPublic, *, full: bool) -> Cursor:
    """The cursor after drawing ``ov``: from scratch (``full``) or patched onto ``cursor``."""
    base = Cursor(job_id=ov.job_id) if full or cursor is None else cursor
    recent = {} if full else {int(s): t for s, t in base.recent if not ov.step or s < ov.step[0]}
    recent.update({s: t for s, t in zip(ov.step, ov.ts, strict=False)})
    resume, tail, tail_sparse = forming_tail(ov)
    if not ov.step and not full:
        resume, tail, tail_sparse = base.resume, base.tail, base.tail_sparse
    return Cursor(
        job_id=ov.job_id,
        last_step=ov.last_step if ov.last_step is not None else base.last_step,
        points=(0 if full else base.points - base.tail) + len(ov.step) if ov.step or full else base.points,
        resume=resume,
        tail=tail,
        tail_sparse=tail_sparse,
        restarts=restart_count(ov.markers),
        markers=len(ov.markers),
        ranks=ov.ranks if ov.step or full else base.ranks,
        slowest=[r.rank for r in ov.slowest_ranks],
        stragglers=stragglers(ov.slowest_ranks),
        recent=[[s, recent[s]] for s in sorted(recent)][-RECENT:],
        tick=(cursor.tick + 1) if cursor is not None else 1,
    )


# --------------------------------------------------------------------------------------------------
# Header
# --------------------------------------------------------------------------------------------------


def seconds_per_step(recent: Sequence[Sequence[float]]) -> float | None:
    """Wall time per step over the recent ``[step, ts]`` pairs (None: fewer than two steps)."""
    pts = sorted((int(s), float(t)) for s, t in recent)
    if len(pts) < 2:
        return None
    (s0, t0), (s1, t1) = pts[0], pts[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    return (t1 - t0) / (s1 - s0)


def eta_seconds(recent: Sequence[Sequence[float]], last_step: int | None, total_steps: int) -> float | None:
    """Seconds until ``total_steps`` at the recent pace (None: pace unknown); 0 once there."""
    if last_step is not None and last_step >= total_steps:
        return 0.0
    pace = seconds_per_step(recent)
    if pace is None:
        return None
    return pace * (total_steps - (last_step if last_step is not None else -1) - 1)




