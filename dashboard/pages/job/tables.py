"""The job page's sortable, filterable grids (dash-ag-grid, :func:`dashboard.tables.grid`): their column
definitions and the rows of each grid (slowest ranks, collectives, checkpoints, events) built by pure
functions from wire-schema objects. Rows are plain JSON values, numbers rounded to a few significant
digits, so columns sort and filter as numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dashboard.format import fmt_bytes, fmt_time, round_sig
from vigil.contract.schemas import CheckpointPublic, EventsPublic, JobMarker, RankSummary, SecondsLostPublic

SLOWEST_COLUMNS: list[dict[str, Any]] = [
    {"field": "rank", "headerName": "rank", "maxWidth": 90},
    {"field": "node_id", "headerName": "node"},
    {"field": "vs_median", "headerName": "x median", "sort": "desc"},
    {"field": "step_time_mean_s", "headerName": "mean step (s)"},
    {"field": "step_time_max_s", "headerName": "max step (s)"},
    {"field": "comm_wait_mean_s", "headerName": "wait in collectives (s)"},
    {"field": "steps", "headerName": "steps", "maxWidth": 90},
    {"field": "flag", "headerName": "", "maxWidth": 110},
]
LOST_COLUMNS: list[dict[str, Any]] = [
    {"field": "rank", "headerName": "rank", "maxWidth": 90},
    {"field": "node_id", "headerName": "node"},
    {"field": "seconds_lost", "headerName": "seconds lost", "sort": "desc"},
    {"field": "share_pct", "headerName": "% of wall time"},
    {"field": "steps_charged", "headerName": "steps slower than median"},
    {"field": "last_step_lost_s", "headerName": "newest step (s)"},
]
COLLECTIVE_COLUMNS: list[dict[str, Any]] = [
    {"field": "kind", "headerName": "collective", "minWidth": 220},  # op/tag [group] (est.) in full
    {"field": "calls_per_step", "headerName": "calls / step"},
    {"field": "p50_s", "headerName": "p50 (s)"},
    {"field": "max_s", "headerName": "max (s)"},
    {"field": "slowest_rank", "headerName": "slowest rank"},
    {"field": "transfer_s", "headerName": "transfer (s)"},
    {"field": "wait_p50_s", "headerName": "wait p50 (s)"},
    {"field": "wait_max_s", "headerName": "wait max (s)"},
    {"field": "wire_per_rank", "headerName": "wire / rank / step"},
    {"field": "bandwidth", "headerName": "GB/s per rank"},
    {"field": "bits_per_param", "headerName": "bits / param"},
]
CHECKPOINT_COLUMNS: list[dict[str, Any]] = [
    {"field": "step", "headerName": "step", "maxWidth": 100},
    {"field": "created", "headerName": "written (UTC)"},
    {"field": "valid", "headerName": "valid", "maxWidth": 100},
    {"field": "why", "headerName": "why invalid"},
    {"field": "size", "headerName": "size"},
    {"field": "files", "headerName": "files", "maxWidth": 90},
    {"field": "restored_by", "headerName": "restored by"},
    {"field": "path", "headerName": "path"},
]
EVENT_GRID_COLUMNS: list[dict[str, Any]] = [
    {"field": "time", "headerName": "time (UTC)", "maxWidth": 200},
    {"field": "kind", "headerName": "kind", "maxWidth": 180},
    {"field": "node", "headerName": "node", "maxWidth": 160},
    {"field": "message", "headerName": "message", "flex": 3},
]


def slowest_rank_rows(slowest: Sequence[RankSummary], straggler_ratio: float) -> list[dict[str, Any]]:
    """Rows of the slowest-ranks grid, slowest first; a rank at least ``straggler_ratio`` x the median
    is flagged ``straggler``."""
    return [
        {
            "rank": r.rank,
            "node_id": r.node_id,
            "vs_median": round_sig(r.vs_median, 3),
            "step_time_mean_s": round_sig(r.step_time_mean_s),
            "step_time_max_s": round_sig(r.step_time_max_s),
            "comm_wait_mean_s": round_sig(r.comm_wait_mean_s),
            "steps": r.steps,
            "flag": "straggler" if r.vs_median >= straggler_ratio else "",
        }
        for r in slowest
    ]


def seconds_lost_rows(sl: SecondsLostPublic | None) -> list[dict[str, Any]]:
    """Rows of the seconds-lost grid: every rank that cost the job time, most seconds lost first (the
    controller also lists the ranks at or below the median pace, at 0 s: left out, a wide job has
    thousands)."""
    if sl is None:
        return []
    return [{"rank": r.rank, "node_id": r.node_id, "seconds_lost": round_sig(r.seconds_lost),
             "share_pct": round_sig(100 * r.share_of_wall, 3) if r.share_of_wall is not None else None,
             "steps_charged": r.steps_charged, "last_step_lost_s": round_sig(r.last_step_lost_s)}
            for r in sl.ranks if r.seconds_lost > 0]


def collective_rows(stats: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows of the collectives grid from :func:`dashboard.pages.job.figures.collectives.collective_stats`."""
    return [
        {
            "kind": k.label,
            "calls_per_step": round_sig(k.calls_per_step, 3),
            "p50_s": round_sig(k.p50_s),
            "max_s": round_sig(k.max_s),
            "slowest_rank": k.slowest_rank,
            "transfer_s": round_sig(k.transfer_s),
            "wait_p50_s": round_sig(k.wait_p50_s),
            "wait_max_s": round_sig(k.wait_max_s),
            "wire_per_rank": fmt_bytes(k.wire_bytes_per_rank),
            "bandwidth": None if k.bandwidth_bytes_per_s is None else round_sig(k.bandwidth_bytes_per_s / 1e9, 3),
            "bits_per_param": round_sig(k.bits_per_element, 3),
        }
        for k in stats
    ]


def checkpoint_rows(ckpts: Sequence[CheckpointPublic], reasons: Mapping[str, str],
                    restores: Sequence[tuple[JobMarker, CheckpointPublic | None]]) -> list[dict[str, Any]]:
    """Rows of the checkpoints grid, newest step first: valid or not (and why), size, and the restarts
    (numbered from 1, oldest first) that restored it."""
    by: dict[int, list[str]] = {}
    for i, (_, restored) in enumerate(restores, start=1):
        if restored is not None:
            by.setdefault(restored.id, []).append(f"restart {i}")
    return [
        {
            "id": c.id,
            "step": c.step,
            "created": fmt_time(c.created_at),
            "valid": "yes" if c.valid else "NO",
            "why": "" if c.valid else reasons.get(c.path, "reported invalid"),
            "size": fmt_bytes(c.bytes),
            "files": c.files,
            "restored_by": ", ".join(by.get(c.id, [])),
            "path": c.path,
        }
        for c in sorted(ckpts, key=lambda c: (-c.step, -c.id))
    ]


def event_rows(events: EventsPublic) -> list[dict[str, Any]]:
    """Rows of the job's events grid (newest first, as the controller returns them)."""
    return [
        {"id": e.id, "time": fmt_time(e.ts), "kind": e.kind, "node": e.node_id or "", "message": e.message}
        for e in events.data
    ]
