"""The job page's logic that is not drawing: incremental refresh, ETA, rank sampling, and the joins
between the controller's records (which fault caused an incident, which checkpoint a restart restored).

Pure functions of wire-schema objects and plain dicts (what a ``dcc.Store`` holds), so the page's
callbacks stay thin and all of this is unit-tested without a server.

**Incremental refresh.** The page keeps a :class:`Cursor` in a ``dcc.Store``: the newest step it has
drawn, how many points the line figures hold, the steps at their end that were still forming (not
``final``: the controller had not all of their samples), and the restarts and markers seen. Each
refresh asks the controller's overview only for the steps from the first one still forming, else
after the newest drawn (``since_step``), and patches the drawn figures with a ``dash.Patch``
(:func:`overview_patches`): the forming tail is deleted and drawn again, the new steps appended. It
rebuilds everything from a full fetch instead when it has nothing drawn, when the job restarted (a
restart re-runs steps already drawn: the overview keeps the latest attempt of each), when the forming
tail is long (:data:`MAX_TAIL`), or when the figures would grow past :data:`MAX_DRAWN_POINTS` (the full
fetch comes back decimated).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from dash import Patch

from controller.schemas import (
    MARKER_KINDS,
    CheckpointPublic,
    EventPublic,
    FaultPublic,
    FaultStatus,
    IncidentPublic,
    IncidentStatus,
    JobMarker,
    JobOverviewPublic,
    RankSummary,
)
from dashboard import plotting, rank_figures, training_figures

MAX_DRAWN_POINTS = 4000
"""Past this many steps in the line figures, the next refresh rebuilds them from a (decimated) full fetch."""
MAX_TAIL = 50
"""Past this many steps still forming at the end of the figures, a refresh rebuilds them instead."""
RECENT = 32
"""Steps kept in the cursor to estimate the time per step (ETA)."""
SAMPLE_RANKS = 32
"""Ranks whose step breakdown the page fetches for the job-wide and per-rank views (all of them when
the job has no more; else the slowest ranks and an even spread of the others)."""
LIVE_INCIDENT = (IncidentStatus.OPEN, IncidentStatus.ACTING)
FAULT_CAUSE_WINDOW = timedelta(minutes=30)
"""A fault fired at most this long before an incident's detection may be its cause."""


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
    tail_val: int = 0
    """Validation points among them."""
    restarts: int = 0
    """Restart markers seen: one more means steps were re-run, so the figures are rebuilt."""
    markers: int = 0
    """Markers drawn on the loss figure."""
    ranks: int = 0
    """Ranks that reported in the overview's rank window."""
    slowest: list[int] = field(default_factory=list)
    """The slowest ranks (top-k), slowest first."""
    stragglers: list[int] = field(default_factory=list)
    """Those of them at least :data:`rank_figures.STRAGGLER_RATIO` x the median rank (highlighted)."""
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


def stragglers(slowest: Sequence[RankSummary], ratio: float = rank_figures.STRAGGLER_RATIO) -> list[int]:
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


def forming_tail(ov: JobOverviewPublic) -> tuple[int | None, int, int]:
    """The first step of ``ov`` still forming (None: all final), how many steps of ``ov`` are from it
    on, and how many of those have a validation loss."""
    finals = _finals(ov)
    first = next((i for i, f in enumerate(finals) if not f), None)
    if first is None:
        return None, 0, 0
    return ov.step[first], len(ov.step) - first, sum(1 for v in ov.val_loss[first:] if v is not None)


def advance(cursor: Cursor | None, ov: JobOverviewPublic, *, full: bool) -> Cursor:
    """The cursor after drawing ``ov``: from scratch (``full``) or patched onto ``cursor``."""
    base = Cursor(job_id=ov.job_id) if full or cursor is None else cursor
    recent = {} if full else {int(s): t for s, t in base.recent if not ov.step or s < ov.step[0]}
    recent.update({s: t for s, t in zip(ov.step, ov.ts, strict=False)})
    resume, tail, tail_val = forming_tail(ov)
    if not ov.step and not full:
        resume, tail, tail_val = base.resume, base.tail, base.tail_val
    return Cursor(
        job_id=ov.job_id,
        last_step=ov.last_step if ov.last_step is not None else base.last_step,
        points=(0 if full else base.points - base.tail) + len(ov.step) if ov.step or full else base.points,
        resume=resume,
        tail=tail,
        tail_val=tail_val,
        restarts=restart_count(ov.markers),
        markers=len(ov.markers),
        ranks=ov.ranks if ov.step or full else base.ranks,
        slowest=[r.rank for r in ov.slowest_ranks],
        stragglers=stragglers(ov.slowest_ranks),
        recent=[[s, recent[s]] for s in sorted(recent)][-RECENT:],
        tick=(cursor.tick + 1) if cursor is not None else 1,
    )


def _drop_tail(p: Patch, trace: int, tail: int, keys: Sequence[str] = ("x", "y")) -> None:
    """Delete the last ``tail`` entries of the trace's arrays (index -1, ``tail`` times: the renderer
    resolves a negative index against the array as it is at that operation)."""
    for _ in range(tail):
        for key in keys:
            del p["data"][trace][key][-1]


def _extend(p: Patch, trace: int, x: list[Any], y: list[Any], **more: list[Any]) -> None:
    p["data"][trace]["x"].extend(x)
    p["data"][trace]["y"].extend(y)
    for key, values in more.items():
        p["data"][trace][key].extend(values)


def overview_patches(ov: JobOverviewPublic, cursor: Cursor) -> tuple[Any, Any, Any]:
    """Patches of the loss, throughput and step-time bands figures drawn for ``cursor``, from the
    incremental answer ``ov``: the drawn steps still forming (``cursor.tail``) deleted, ``ov``'s steps
    appended (the figures' trace order is fixed by :mod:`dashboard.training_figures` and
    :mod:`dashboard.rank_figures`). The markers are redrawn whole when their number changed (the overview returns all of them, whatever ``since_step``).
    Figures that do not change come back as ``dash.no_update``."""
    from dash import no_update

    if not ov.step and len(ov.markers) == cursor.markers:
        return no_update, no_update, no_update
    loss, tput, bands = Patch(), Patch(), Patch()
    if ov.step:
        x = list(ov.step)
        tail = cursor.tail
        _drop_tail(loss, 0, tail)
        _drop_tail(loss, 1, cursor.tail_val)  # the validation trace holds only the steps with one
        _drop_tail(tput, 0, tail)
        _drop_tail(tput, 1, tail)
        _drop_tail(bands, 0, tail)
        _drop_tail(bands, 1, tail)
        _drop_tail(bands, 2, tail, ("x", "y", "customdata"))
        _extend(loss, 0, x, [plotting.round_sig(v, 6) for v in ov.loss])
        vx, vy = training_figures.val_points(ov)
        if vx:
            _extend(loss, 1, vx, [plotting.round_sig(v, 6) for v in vy])
            loss["data"][1]["showlegend"] = True
        _extend(tput, 0, x, [plotting.round_sig(v) for v in ov.tokens_per_s])
        _extend(tput, 1, x, list(ov.reporting))
        _extend(bands, 0, x, [plotting.round_sig(v) for v in ov.step_time_p50_s])
        _extend(bands, 1, x, [plotting.round_sig(v) for v in ov.step_time_p90_s])
        _extend(bands, 2, x, [plotting.round_sig(v) for v in ov.step_time_max_s], customdata=list(ov.slowest_rank))
        bands["layout"]["title"]["text"] = rank_figures.slowest_title(ov)
    else:
        tput = bands = no_update
    if len(ov.markers) != cursor.markers:
        for i, kind in enumerate(MARKER_KINDS):
            pts = training_figures.marker_points(ov.markers, kind)
            trace = training_figures.MARKER_TRACE0 + i
            for key, values in pts.items():
                loss["data"][trace][key] = values
            loss["data"][trace]["showlegend"] = bool(pts["x"])
    return loss, tput, bands


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


def live_incident(incidents: Iterable[IncidentPublic]) -> IncidentPublic | None:
    """The newest incident still OPEN or ACTING."""
    live = [i for i in incidents if i.status in LIVE_INCIDENT]
    return max(live, key=lambda i: (i.detected_at, i.id)) if live else None


# --------------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------------


def rank_sample(ranks: int, slowest: Sequence[int], limit: int = SAMPLE_RANKS,
                include: Iterable[int] = ()) -> list[int] | None:
    """Which ranks to fetch the step breakdown of: ``None`` (all) when the job has at most ``limit``;
    else ``include`` and the slowest ranks, then an even spread over ``0..ranks-1``, ``limit`` in all."""
    if ranks <= limit:
        return None
    chosen: list[int] = []
    for r in [*include, *slowest]:
        if r not in chosen and len(chosen) < limit:
            chosen.append(r)
    spread = limit - len(chosen)
    if spread > 0:
        step = ranks / spread
        for i in range(spread):
            r = int(i * step)
            while r in chosen and r < ranks - 1:
                r += 1
            if r not in chosen:
                chosen.append(r)
    return sorted(chosen)


def parse_rank_label(label: Any) -> int | None:
    """The rank of a figure label: ``rank 5`` (maybe decorated, ``▶ rank 5 (slow)``) gives 5; a bin
    ``ranks 8-15`` gives its first rank, 8."""
    if not isinstance(label, str):
        return None
    text = label.replace("<b style='color:#d62728'>", "").replace("</b>", "").replace("▶", "")
    for word in ("ranks ", "rank "):
        if word in text:
            head = text.split(word, 1)[1].strip()
            digits = ""
            for ch in head:
                if not ch.isdigit():
                    break
                digits += ch
            return int(digits) if digits else None
    return None


def clicked_rank(click: Mapping[str, Any] | None, slowest: Sequence[int] = ()) -> int | None:
    """The rank a click on a rank view points at (Plotly ``clickData``): the ``customdata`` of a
    rank line, of a per-rank bar or of a step's max (its slowest rank), or a heatmap row's label; a
    row that bins several ranks gives the slowest of ``slowest`` inside it, else its first rank."""
    if not click or not click.get("points"):
        return None
    pt = click["points"][0]
    cd = pt.get("customdata")
    if isinstance(cd, int) and not isinstance(cd, bool):
        return cd
    label = pt.get("y") if isinstance(pt.get("y"), str) else pt.get("x")
    rank = parse_rank_label(label)
    if rank is not None and isinstance(label, str) and "ranks " in label:
        lo_hi = label.split("ranks ", 1)[1].split("-")
        try:
            lo, hi = int(lo_hi[0]), int("".join(ch for ch in lo_hi[1] if ch.isdigit()))
        except (IndexError, ValueError):
            return rank
        inside = [r for r in slowest if lo <= r <= hi]
        return inside[0] if inside else lo
    return rank


# --------------------------------------------------------------------------------------------------
# Incidents
# --------------------------------------------------------------------------------------------------


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def cause_fault(inc: IncidentPublic, faults: Iterable[FaultPublic],
                window: timedelta = FAULT_CAUSE_WINDOW) -> FaultPublic | None:
    """The injected fault that most likely caused ``inc``: the newest fault of the job fired at most
    ``window`` before the detection, on the incident's rank or node when it names one (a fault naming
    neither matches any incident)."""
    detected = _utc(inc.detected_at)
    best: FaultPublic | None = None
    for f in faults:
        if f.fired_at is None or f.status not in (FaultStatus.FIRED, FaultStatus.CLEARED):
            continue
        fired = _utc(f.fired_at)
        if not detected - window <= fired <= detected:
            continue
        if inc.rank is not None and f.rank is not None and f.rank != inc.rank:
            continue
        if inc.node_id is not None and f.node_id is not None and f.node_id != inc.node_id and f.rank is None:
            continue
        if best is None or fired > _utc(best.fired_at or fired):
            best = f
    return best


def incident_phases(inc: IncidentPublic, fault: FaultPublic | None) -> dict[str, datetime]:
    """When each phase of :data:`dashboard.recovery_figures.PHASES` the incident reached happened (UTC)."""
    phases: dict[str, datetime] = {}
    if fault is not None and fault.fired_at is not None:
        phases["fault"] = _utc(fault.fired_at)
    phases["detected"] = _utc(inc.detected_at)
    if inc.acted_at is not None:
        phases["acted"] = _utc(inc.acted_at)
    if inc.recovered_at is not None:
        phases["recovered"] = _utc(inc.recovered_at)
    return phases


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def invalid_reasons(events: Iterable[EventPublic]) -> dict[str, str]:
    """Why each checkpoint found invalid was, by path (the ``checkpoint_invalid`` events; the newest wins)."""
    out: dict[str, str] = {}
    for e in sorted((e for e in events if e.kind == "checkpoint_invalid"), key=lambda e: (e.ts, e.id)):
        path = str(e.data.get("path", ""))
        out[path] = str(e.data.get("reason") or e.message)
    return out


def restored_checkpoint(marker: JobMarker, ckpts: Sequence[CheckpointPublic],
                        invalid_at: Mapping[str, datetime] | None = None) -> CheckpointPublic | None:
    """The checkpoint a restart marker most likely restored.

    The controller does not record the restore itself (a restart marker's ``ref`` is the incident it
    ended, if any, and its step the first step run after it); a restart resumes from the newest
    checkpoint that was valid then. So: the newest checkpoint written before the restart, at or below
    its step, that is valid now or was found invalid only after the restart (``invalid_at``: when each
    path was found invalid).
    """
    at = datetime.fromtimestamp(marker.ts, UTC)
    bad = invalid_at or {}
    best = None
    for c in ckpts:
        if _utc(c.created_at) > at or (marker.step is not None and c.step > marker.step):
            continue
        if not c.valid and (c.path not in bad or _utc(bad[c.path]) <= at):
            continue
        if best is None or c.step > best.step:
            best = c
    return best


def invalid_times(events: Iterable[EventPublic]) -> dict[str, datetime]:
    """When each checkpoint path was first found invalid."""
    out: dict[str, datetime] = {}
    for e in events:
        if e.kind == "checkpoint_invalid":
            path = str(e.data.get("path", ""))
            ts = _utc(e.ts)
            if path not in out or ts < out[path]:
                out[path] = ts
    return out


def restores(markers: Iterable[JobMarker], ckpts: Sequence[CheckpointPublic],
             events: Iterable[EventPublic] = ()) -> list[tuple[JobMarker, CheckpointPublic | None]]:
    """Each restart marker (oldest first) with the checkpoint it restored (:func:`restored_checkpoint`)."""
    bad = invalid_times(events)
    return [(m, restored_checkpoint(m, ckpts, bad))
            for m in sorted((m for m in markers if m.kind == "restart"), key=lambda m: m.ts)]
