"""Tables and summaries of the dashboard, built by pure functions from wire-schema objects.

Like :mod:`dashboard.figures`, nothing here fetches data; each function maps schema objects to
Dash components, so the pages' callbacks stay thin and these are unit-tested without a server.
Rows carry ``data-*`` attributes (job id, node id, event id) so tests and users' scripts can find
them without depending on the column layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import dash_bootstrap_components as dbc
from dash import dcc, html

from controller.schemas import (
    DEFAULT_ENTRYPOINT,
    CheckpointPublic,
    EventsPublic,
    FaultPublic,
    GoodputPublic,
    IncidentPublic,
    JobMarker,
    JobPublic,
    JobsPublic,
    JobStatus,
    NodePublic,
    NodesPublic,
    NodeState,
    RankProcess,
    RankSummary,
    StacksPublic,
)

DASH = "–"
"""Shown for a missing value."""

STATUS_COLORS: dict[str, str] = {
    JobStatus.PENDING.value: "#8a8a8a",
    JobStatus.RUNNING.value: "#1f77b4",
    JobStatus.SUCCEEDED.value: "#2ca02c",
    JobStatus.FAILED.value: "#d62728",
    JobStatus.CANCELLED.value: "#ff7f0e",
    NodeState.ALIVE.value: "#2ca02c",
    NodeState.DEAD.value: "#d62728",
    NodeState.EVICTED.value: "#ff7f0e",
}

TABLE_STYLE = {"borderCollapse": "collapse", "width": "100%", "fontSize": "14px"}
CELL_STYLE = {"borderBottom": "1px solid #ddd", "padding": "4px 8px", "textAlign": "left"}

JOB_COLUMNS = ("id", "name", "status", "optimizer", "workers", "step", "last loss", "created")
NODE_COLUMNS = ("id", "hostname", "address", "state", "heartbeat age", "ranks", "host")
EVENT_COLUMNS = ("time", "kind", "job", "node", "message")


# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------


def fmt_time(ts: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` in UTC (naive datetimes are taken as UTC), or a dash."""
    if ts is None:
        return DASH
    if ts.tzinfo is not None:
        ts = ts.astimezone(UTC)
    return ts.strftime("%Y-%m-%d %H:%M:%S")


def fmt_float(value: float | None, digits: int = 4) -> str:
    """``digits`` significant digits; ``nan``/``inf`` spelled out; ``None`` as a dash."""
    if value is None:
        return DASH
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def fmt_age(seconds: float | None) -> str:
    """A heartbeat age: ``0.8 s``, ``42 s``, ``3 min``, ``2.5 h``; a dash for never."""
    if seconds is None:
        return DASH
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_workers(job: JobPublic) -> str:
    """``4`` for a fixed size, ``2–6`` for an elastic job."""
    s = job.spec.scaling
    return str(s.min_workers) if s.min_workers == s.max_workers else f"{s.min_workers}{DASH}{s.max_workers}"


def fmt_progress(job: JobPublic) -> str:
    """``last step / steps``."""
    last = DASH if job.last_step is None else str(job.last_step)
    return f"{last} / {job.spec.steps}"


def fmt_ranks(ranks: Sequence[RankProcess]) -> str:
    """Ranks grouped by job: ``job-a: 0, 1; job-b: 3``; dead ranks marked with ``†``."""
    if not ranks:
        return DASH
    by_job: dict[str, list[str]] = {}
    for r in sorted(ranks, key=lambda r: (r.job_id, r.rank)):
        by_job.setdefault(r.job_id, []).append(f"{r.rank}" if r.alive else f"{r.rank}†")
    return "; ".join(f"{job}: {', '.join(rs)}" for job, rs in by_job.items())


def fmt_host(host: Mapping[str, Any]) -> str:
    """Host metrics as ``key=value`` pairs (floats to 3 significant digits, nested dicts flattened)."""
    if not host:
        return DASH
    parts: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k in sorted(value):
                walk(f"{prefix}.{k}" if prefix else str(k), value[k])
        elif isinstance(value, float):
            parts.append(f"{prefix}={fmt_float(value, 3)}")
        else:
            parts.append(f"{prefix}={value}")

    walk("", host)
    return ", ".join(parts)


def status_badge(status: str, prefix: str) -> html.Span:
    """A coloured status label; its id is ``{prefix}-status`` (page-prefixed)."""
    return html.Span(
        status,
        id=f"{prefix}-status",
        className=f"vigil-status vigil-status-{status.lower()}",
        style={
            "backgroundColor": STATUS_COLORS.get(status, "#8a8a8a"),
            "color": "white",
            "borderRadius": "4px",
            "padding": "1px 6px",
            "fontSize": "12px",
        },
    )


def _badge_cell(status: str) -> html.Td:
    return html.Td(
        html.Span(status, style={"color": STATUS_COLORS.get(status, "#333"), "fontWeight": "bold"}),
        style=CELL_STYLE,
    )


def _header(columns: Sequence[str]) -> html.Thead:
    return html.Thead(html.Tr([html.Th(c, style=CELL_STYLE) for c in columns]))


def _empty_row(columns: Sequence[str], message: str) -> html.Tr:
    return html.Tr(html.Td(message, colSpan=len(columns), style={**CELL_STYLE, "color": "#888"}))


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def jobs_table(jobs: JobsPublic, link_prefix: str, table_id: str = "jobs-table-body") -> html.Table:
    """The jobs list: one row per job, newest first as the controller returns them.

    ``link_prefix`` is the dashboard's URL prefix (``/dashboard/`` when mounted); each job id
    links to ``{link_prefix}jobs/{id}``.
    """
    rows = [
        html.Tr(
            [
                html.Td(dcc.Link(job.id, href=f"{link_prefix}jobs/{job.id}"), style=CELL_STYLE),
                html.Td(job.name, style=CELL_STYLE),
                _badge_cell(job.status.value),
                html.Td(job.spec.optimizer.kind, style=CELL_STYLE),
                html.Td(fmt_workers(job), style=CELL_STYLE),
                html.Td(fmt_progress(job), style=CELL_STYLE),
                html.Td(fmt_float(job.last_loss), style=CELL_STYLE),
                html.Td(fmt_time(job.created_at), style=CELL_STYLE),
            ],
            className="vigil-job-row",
            **{"data-job-id": job.id},
        )
        for job in jobs.data
    ]
    if not rows:
        rows = [_empty_row(JOB_COLUMNS, "no jobs yet")]
    return html.Table([_header(JOB_COLUMNS), html.Tbody(rows, id=table_id)], style=TABLE_STYLE)


def nodes_table(nodes: NodesPublic | Sequence[NodePublic]) -> html.Table:
    """The nodes list: state, heartbeat age, the ranks the agent sees, and its host metrics."""
    data = nodes.data if isinstance(nodes, NodesPublic) else list(nodes)
    rows = [
        html.Tr(
            [
                html.Td(n.id, style=CELL_STYLE),
                html.Td(n.hostname or DASH, style=CELL_STYLE),
                html.Td(n.address or DASH, style=CELL_STYLE),
                _badge_cell(n.state.value),
                html.Td(fmt_age(n.heartbeat_age_s), style=CELL_STYLE),
                html.Td(fmt_ranks(n.ranks), style=CELL_STYLE),
                html.Td(fmt_host(n.host), style={**CELL_STYLE, "fontSize": "12px"}),
            ],
            className="vigil-node-row",
            **{"data-node-id": n.id},
        )
        for n in data
    ]
    if not rows:
        rows = [_empty_row(NODE_COLUMNS, "no nodes have reported yet")]
    return html.Table([_header(NODE_COLUMNS), html.Tbody(rows)], style=TABLE_STYLE)


def events_table(events: EventsPublic, link_prefix: str) -> html.Table:
    """Events, in the order the controller returns them (newest first); job ids link to the job."""
    rows = [
        html.Tr(
            [
                html.Td(fmt_time(e.ts), style=CELL_STYLE),
                html.Td(e.kind, style=CELL_STYLE),
                html.Td(
                    dcc.Link(e.job_id, href=f"{link_prefix}jobs/{e.job_id}") if e.job_id else DASH,
                    style=CELL_STYLE,
                ),
                html.Td(e.node_id or DASH, style=CELL_STYLE),
                html.Td(e.message, style=CELL_STYLE),
            ],
            className="vigil-event-row",
            **{"data-event-id": str(e.id)},
        )
        for e in events.data
    ]
    if not rows:
        rows = [_empty_row(EVENT_COLUMNS, "no events")]
    return html.Table([_header(EVENT_COLUMNS), html.Tbody(rows)], style=TABLE_STYLE)


@dataclass(frozen=True)
class Vitals:
    """What the job page's header says about a job beyond its record (all optional)."""

    eta_s: float | None = None
    """Seconds to the last step at the recent pace."""
    restarts: int | None = None
    """Restarts seen so far."""
    incident: IncidentPublic | None = None
    """The incident under way (OPEN or ACTING), if any."""
    ranks: int | None = None
    """Ranks that reported recently."""


def fmt_duration(seconds: float | None) -> str:
    """``1.3 s``, ``45 s``, ``12 min``, ``3 h 05 min``; a dash for unknown."""
    if seconds is None or not math.isfinite(seconds):
        return DASH
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    h, m = divmod(int(seconds // 60), 60)
    return f"{h} h {m:02d} min"


def fmt_bytes(n: float | None) -> str:
    """``512 B``, ``1.5 kB``, ``2.25 MB``, ``3.1 GB`` (powers of 1000)."""
    if n is None:
        return DASH
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rank_list(ranks: Sequence[int], limit: int = 12) -> str:
    """``0-3, 5, 7-9`` (runs collapsed; at most ``limit`` pieces, then ``... (N ranks)``)."""
    rs = sorted(set(ranks))
    if not rs:
        return DASH
    runs: list[tuple[int, int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > limit:
        return ", ".join(parts[:limit]) + f", ... ({len(rs)} ranks)"
    return ", ".join(parts)


def incident_line(inc: IncidentPublic) -> str:
    """``hang (ACTING): rank 1 on node-2``"""
    where = ", ".join(x for x in (f"rank {inc.rank}" if inc.rank is not None else "",
                                  f"node {inc.node_id}" if inc.node_id else "") if x)
    return f"{inc.kind.value} ({inc.status.value})" + (f": {where}" if where else "")


def _vital(label: str, value: Any, component_id: str) -> html.Span:
    return html.Span([html.B(f"{label}: "), html.Span(value, id=component_id)], style={"marginRight": "18px"})


def job_header(job: JobPublic, vitals: Vitals | None = None) -> list[Any]:
    """The job page's header: name and status, progress bar, ETA, restarts, the incident under way,
    then a one-line summary of the spec and timings."""
    v = vitals or Vitals()
    spec = job.spec
    m = spec.model
    done = -1 if job.last_step is None else job.last_step
    incident: Any = DASH
    if v.incident is not None:
        incident = html.Span(incident_line(v.incident), style={"color": "#d62728", "fontWeight": "bold"})
    status_line = html.Div(
        [
            html.Span(
                [html.Progress(value=str(max(done + 1, 0)), max=str(max(spec.steps, 1)), id="job-detail-progress",
                               style={"width": "180px", "verticalAlign": "middle", "marginRight": "6px"}),
                 html.Span(fmt_progress(job), id="job-detail-step")],
                style={"marginRight": "18px"},
            ),
            _vital("ETA", DASH if job.status.is_terminal() else fmt_duration(v.eta_s), "job-detail-eta"),
            _vital("restarts", DASH if v.restarts is None else str(v.restarts), "job-detail-restarts"),
            _vital("ranks", DASH if v.ranks is None else str(v.ranks), "job-detail-ranks"),
            _vital("incident", incident, "job-detail-incident"),
        ],
        id="job-detail-vitals",
        style={"margin": "4px 0 6px 0"},
    )
    facts = [
        ("id", job.id),
        ("entry point", spec.entrypoint),
        ("optimizer", f"{spec.optimizer.kind} (lr {fmt_float(spec.optimizer.lr, 3)})"),
        ("workers", fmt_workers(job)),
        ("step", fmt_progress(job)),
        ("last loss", fmt_float(job.last_loss)),
    ]
    if spec.entrypoint == DEFAULT_ENTRYPOINT or spec.entrypoint.startswith("gpt_train:"):
        # The bundled GPT example's own settings; other code has its `config` instead.
        facts += [("batch", f"{spec.batch_size} x {m.context} bytes per rank"),
                  ("model", f"{m.n_layer} layers, {m.n_head} heads, d_model {m.d_model}")]
    if spec.working_dir:
        facts.append(("code", spec.working_dir[:19]))
    facts += [
        ("recovery", spec.recovery.policy.value),
        ("created", fmt_time(job.created_at)),
        ("started", fmt_time(job.started_at)),
        ("finished", fmt_time(job.finished_at)),
    ]
    out: list[Any] = [
        html.H2([job.name, " ", status_badge(job.status.value, "job-detail")], id="job-detail-title"),
        status_line,
        html.Div(
            [html.Span([html.B(f"{k}: "), v_, "  "], style={"marginRight": "12px"}) for k, v_ in facts],
            id="job-detail-facts",
            style={"fontSize": "13px", "color": "#444"},
        ),
    ]
    if job.message:
        out.append(html.Div(job.message, id="job-detail-message", style={"color": "#a33"}))
    return out


def job_summary(job: JobPublic) -> list[Any]:
    """Header of the job page without the live vitals (:func:`job_header`)."""
    return job_header(job)


def error_banner(message: str, component_id: str) -> html.Div:
    """A visible error line (controller unreachable, bad answer)."""
    return html.Div(
        message, id=component_id, className="vigil-error", style={"color": "#a33", "padding": "6px 0"}
    )


# ==================================================================================================
# The job page's diagnosis components (sortable / filterable grids, incident cards, stacks)
# ==================================================================================================

GRID_DEFAULT_COL = {"sortable": True, "filter": True, "resizable": True, "minWidth": 80}

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


def grid(component_id: str, columns: list[dict[str, Any]], *, row_id: str | None = None,
         highlight: str | None = None, auto_height: bool = True, height: str = "360px") -> Any:
    """A sortable, filterable AG Grid. ``row_id``: the field that identifies a row (rows keep their
    identity across refreshes); ``highlight``: a JavaScript condition on ``params.data`` whose rows are
    drawn red and bold (the stragglers, the invalid checkpoints); ``auto_height``: every row rendered
    (small tables), else a scrolling grid ``height`` high."""
    import dash_ag_grid as dag

    options: dict[str, Any] = {"animateRows": False}
    if auto_height:
        options["domLayout"] = "autoHeight"
    kwargs: dict[str, Any] = {}
    if row_id is not None:
        kwargs["getRowId"] = f"params.data.{row_id}"
    if highlight is not None:
        kwargs["getRowStyle"] = {"styleConditions": [
            {"condition": highlight, "style": {"backgroundColor": "#fde0e0", "fontWeight": "bold"}}]}
    return dag.AgGrid(
        id=component_id,
        columnDefs=columns,
        rowData=[],
        defaultColDef={**GRID_DEFAULT_COL, "flex": 1},
        dashGridOptions=options,
        style={"width": "100%"} if auto_height else {"width": "100%", "height": height},
        **kwargs,
    )


def _num(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{digits}g}")


def slowest_rank_rows(slowest: Sequence[RankSummary], straggler_ratio: float) -> list[dict[str, Any]]:
    """Rows of the slowest-ranks grid, slowest first; a rank at least ``straggler_ratio`` x the median
    is flagged ``straggler``."""
    return [
        {
            "rank": r.rank,
            "node_id": r.node_id,
            "vs_median": _num(r.vs_median, 3),
            "step_time_mean_s": _num(r.step_time_mean_s),
            "step_time_max_s": _num(r.step_time_max_s),
            "comm_wait_mean_s": _num(r.comm_wait_mean_s),
            "steps": r.steps,
            "flag": "straggler" if r.vs_median >= straggler_ratio else "",
        }
        for r in slowest
    ]


def collective_rows(stats: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows of the collectives grid from :func:`dashboard.figures.collective_stats`."""
    return [
        {
            "kind": k.label,
            "calls_per_step": _num(k.calls_per_step, 3),
            "p50_s": _num(k.p50_s),
            "max_s": _num(k.max_s),
            "slowest_rank": k.slowest_rank,
            "transfer_s": _num(k.transfer_s),
            "wait_p50_s": _num(k.wait_p50_s),
            "wait_max_s": _num(k.wait_max_s),
            "wire_per_rank": fmt_bytes(k.wire_bytes_per_rank),
            "bandwidth": None if k.bandwidth_bytes_per_s is None else _num(k.bandwidth_bytes_per_s / 1e9, 3),
            "bits_per_param": _num(k.bits_per_element, 3),
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


def _ago(later: datetime, earlier: datetime) -> str:
    return f"+{fmt_duration((later - earlier).total_seconds())}"


def timeline_text(phases: Mapping[str, datetime]) -> str:
    """``fault 12:00:01 -> detected +16 s -> acted +2 s -> recovered +31 s`` (each step after the last)."""
    out: list[str] = []
    prev: datetime | None = None
    for key in ("fault", "detected", "acted", "recovered"):
        if key not in phases:
            continue
        t = phases[key]
        out.append(f"{key} {t.strftime('%H:%M:%S')}" if prev is None else f"{key} {_ago(t, prev)}")
        prev = t
    return " -> ".join(out)


def _evidence_value(value: Any) -> str:
    if isinstance(value, float):
        return fmt_float(value, 4)
    if isinstance(value, Mapping) and isinstance(value.get("summary"), str):  # a finding with its own line
        text = value["summary"]  # (a hang's "collectives")
        return text if len(text) <= 300 else text[:297] + "..."
    if isinstance(value, Mapping | list):
        text = json.dumps(value, default=str)
        return text if len(text) <= 300 else text[:297] + "..."
    return str(value)


def evidence_table(evidence: Mapping[str, Any], skip: Sequence[str] = ("stack_groups",)) -> html.Table:
    """An incident's evidence as ``key | value`` rows (the numbers that triggered it)."""
    rows = [html.Tr([html.Td(k, style={**CELL_STYLE, "fontWeight": "bold", "width": "180px"}),
                     html.Td(_evidence_value(v), style={**CELL_STYLE, "fontFamily": "monospace"})])
            for k, v in sorted(evidence.items()) if k not in skip]
    if not rows:
        rows = [_empty_row(("key", "value"), "no evidence recorded")]
    return html.Table(html.Tbody(rows), style={**TABLE_STYLE, "fontSize": "13px"}, className="vigil-evidence")


def _diff_lines(text: str, reference: str, mark: str) -> list[Any]:
    """``text`` line by line, the lines absent from ``reference`` highlighted with ``mark``."""
    ref = {line.strip() for line in reference.splitlines()}
    out: list[Any] = []
    for line in text.splitlines():
        differs = line.strip() not in ref
        out.append(html.Span(line + "\n", className="vigil-stack-diff" if differs else None,
                             style={"backgroundColor": mark} if differs else None))
    return out


_PRE = {"whiteSpace": "pre-wrap", "fontSize": "12px", "background": "#f7f7f7", "padding": "6px",
        "maxHeight": "420px", "overflow": "auto", "margin": 0}


def stack_comparison(stacks: StacksPublic, evidence: Mapping[str, Any] | None = None, max_odd: int = 4) -> html.Div:
    """A hang's py-spy stacks: the groups of ranks sharing a stack, then the odd ranks' stacks side
    by side with the majority's (lines the majority does not have highlighted). ``evidence``: the
    incident's, whose ``odd_ranks`` are used when the stacks name none."""
    groups = list(stacks.groups)
    odd = list(stacks.odd_ranks) or list((evidence or {}).get("odd_ranks") or [])
    majority = groups[0] if groups else None
    group_rows = [
        html.Li([html.B(f"{len(g.ranks)} rank{'s' if len(g.ranks) != 1 else ''} ({fmt_rank_list(g.ranks)}): "),
                 html.Code(g.signature)], className="vigil-stack-group", **{"data-ranks": ",".join(map(str, g.ranks))})
        for g in groups
    ]
    columns: list[Any] = []
    if majority is not None:
        columns.append(dbc.Col([
            html.Div(f"majority: ranks {fmt_rank_list(majority.ranks)}", style={"fontWeight": "bold"}),
            html.Pre(majority.sample, id="job-detail-stack-majority", style=_PRE),
        ], style={"flex": "1 1 420px", "minWidth": 0}))
    for i, rank in enumerate(odd[:max_odd]):
        text = stacks.stacks.get(rank, "")
        if not text:
            other = next((g for g in groups if rank in g.ranks), None)
            text = other.sample if other is not None else "(no stack collected)"
        columns.append(dbc.Col([
            html.Div(f"odd rank {rank}", style={"fontWeight": "bold", "color": "#d62728"}),
            html.Pre(_diff_lines(text, majority.sample if majority else "", "#fdd"),
                     id="job-detail-stack-odd" if i == 0 else f"job-detail-stack-odd-{rank}",
                     className="vigil-stack-odd", style=_PRE, **{"data-rank": str(rank)}),
        ], style={"flex": "1 1 420px", "minWidth": 0}))
    head = f"py-spy stacks of {len(stacks.stacks)} ranks"
    if stacks.collected_at is not None:
        head += f", collected {fmt_time(stacks.collected_at)}"
    head += f"; odd rank{'s' if len(odd) != 1 else ''} out: {fmt_rank_list(odd)}" if odd else "; no odd rank out"
    return html.Div(
        [html.Div(head, style={"fontWeight": "bold"}), html.Ul(group_rows),
         dbc.Row(columns, style=ROW_STYLE)],
        id="job-detail-stacks",
    )


ROW_STYLE = {"display": "flex", "flexWrap": "wrap", "gap": "8px", "margin": 0}
"""Row layout that holds without the Bootstrap stylesheet too."""


def incident_card(inc: IncidentPublic, phases: Mapping[str, datetime], fault: FaultPublic | None = None,
                  stacks: StacksPublic | None = None, collectives: Any = None) -> Any:
    """One incident: what and where, its timeline (fault -> detected -> acted -> recovered), the
    action, the evidence, and for a diagnosed hang where each rank stands in its collectives
    (``collectives``: :func:`dashboard.collectives_view.hang_collectives_view`, in place of its evidence
    row) above the grouped stacks (``stacks``) with the odd rank's against the majority's."""
    body: list[Any] = [
        html.Div([html.B("timeline: "), timeline_text(phases) or DASH], className="vigil-incident-timeline"),
        html.Div([html.B("action: "), inc.action or "none yet"], className="vigil-incident-action"),
    ]
    if fault is not None:
        target = f"rank {fault.rank}" if fault.rank is not None else (fault.node_id or "")
        body.append(html.Div([html.B("injected fault: "), f"#{fault.id} {fault.kind.value} {target} at step {fault.step}"
                             + (f" (hit step {fault.hit_step})" if fault.hit_step not in (None, fault.step) else "")]))
    if inc.step_at_detect is not None:
        body.append(html.Div([html.B("step at detection: "), str(inc.step_at_detect)]))
    skip = ("stack_groups", "collectives") if collectives is not None else ("stack_groups",)
    body.append(html.Details([html.Summary("evidence"), evidence_table(inc.evidence, skip)], open=True))
    if collectives is not None:
        body.append(collectives)
    if stacks is not None and stacks.groups:
        body.append(stack_comparison(stacks, inc.evidence))
    elif inc.evidence.get("stack_groups"):
        groups = inc.evidence["stack_groups"]
        body.append(html.Ul([html.Li(f"{len(g.get('ranks', []))} ranks ({fmt_rank_list(g.get('ranks', []))}): "
                                     f"{g.get('signature', '')}") for g in groups]))
    color = STATUS_INCIDENT_COLORS.get(inc.status.value, "#888")
    card = dbc.Card(
        [dbc.CardHeader(html.Span([html.B(f"#{inc.id} {inc.kind.value}"), f" · {incident_line(inc)}",
                                   f" · detected {fmt_time(inc.detected_at)}"])),
         dbc.CardBody(body)],
        style={"borderLeft": f"4px solid {color}", "padding": "4px 8px"},
    )
    return html.Div(card, id=f"job-detail-incident-{inc.id}", className="vigil-incident", style={"margin": "8px 0"},
                    **{"data-incident-id": str(inc.id), "data-kind": inc.kind.value})


STATUS_INCIDENT_COLORS = {"OPEN": "#d62728", "ACTING": "#ff7f0e", "RECOVERED": "#2ca02c", "FAILED": "#7f0000",
                          "CLOSED": "#8a8a8a"}


def goodput_summary(gp: GoodputPublic | None) -> html.Div:
    """The ETTR as a big number (``job-detail-ettr``), then productive and lost time in words."""
    if gp is None:
        return html.Div("no goodput yet", id="job-detail-goodput-text", style={"color": "#888"})
    ettr = DASH if gp.ettr is None else f"{gp.ettr:.3f}"
    lost = sorted(((c, v) for c, v in gp.lost_s.items() if v > 0), key=lambda cv: -cv[1])
    return html.Div(
        [
            html.Div([html.Span("ETTR ", style={"fontSize": "18px"}),
                      html.Span(ettr, id="job-detail-ettr", style={"fontSize": "36px", "fontWeight": "bold"})]),
            html.Div(f"productive {fmt_duration(gp.productive_s)} of {fmt_duration(gp.wall_s)} wall; "
                     f"{gp.restarts} restart{'s' if gp.restarts != 1 else ''}, {gp.steps_rerun} steps re-run",
                     id="job-detail-goodput-text"),
            html.Ul([html.Li(f"{c.replace('_', ' ')}: {fmt_duration(v)} ({100 * v / gp.wall_s:.1f}%)")
                     for c, v in lost if gp.wall_s > 0], id="job-detail-lost"),
        ],
    )


def marker_detail(marker: Sequence[Any] | None, incident: IncidentPublic | None = None,
                  checkpoint: CheckpointPublic | None = None) -> Any:
    """What a click on a marker of the loss curve shows: the marker (``[kind, step, label, ref, ts]``),
    and the incident or checkpoint it refers to."""
    if not marker:
        return html.Div("click a marker on the loss curve for its details", style={"color": "#888"})
    kind, step, label, _ref, ts = (list(marker) + [None] * 5)[:5]
    when = fmt_time(datetime.fromtimestamp(float(ts), UTC)) if isinstance(ts, int | float) else DASH
    out: list[Any] = [html.Div([html.B(f"{kind} at step {step}: "), label, f" ({when})"])]
    if incident is not None:
        out.append(html.Div([html.B("incident: "), incident_line(incident), " · action: ",
                             incident.action or "none yet"]))
        out.append(evidence_table(incident.evidence))
    if checkpoint is not None:
        out.append(html.Div([html.B("checkpoint: "), f"step {checkpoint.step}, {fmt_bytes(checkpoint.bytes)}, ",
                             "valid" if checkpoint.valid else "INVALID", f", {checkpoint.path}"]))
    return html.Div(out, className="vigil-marker-detail")


def rank_detail(rank: int | None, summary: RankSummary | None = None, node_id: str | None = None) -> Any:
    """One line about the selected rank: its node and how it compares with the median rank."""
    if rank is None:
        return html.Span("no rank selected: click a rank (heatmap row, slowest ranks, a line) for its breakdown",
                         style={"color": "#888"})
    parts = [html.B(f"rank {rank}")]
    node = (summary.node_id if summary is not None else None) or node_id
    if node:
        parts.append(f" on {node}")
    if summary is not None:
        parts.append(f": mean step {fmt_float(summary.step_time_mean_s, 3)} s, "
                     f"{summary.vs_median:.2f}x the median rank")
    return html.Span(parts)
