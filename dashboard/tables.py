"""Tables and summaries of the dashboard, built by pure functions from wire-schema objects.

Like :mod:`dashboard.figures`, nothing here fetches data; each function maps schema objects to
Dash components, so the pages' callbacks stay thin and these are unit-tested without a server.
Rows carry ``data-*`` attributes (job id, node id, event id) so tests and users' scripts can find
them without depending on the column layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from dash import dcc, html

from controller.schemas import (
    DEFAULT_ENTRYPOINT,
    EventsPublic,
    JobPublic,
    JobsPublic,
    JobStatus,
    NodePublic,
    NodesPublic,
    NodeState,
    RankProcess,
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


def job_summary(job: JobPublic) -> list[Any]:
    """Header of the job page: name, status, and a one-line summary of the spec and timings."""
    spec = job.spec
    m = spec.model
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
        html.Div(
            [html.Span([html.B(f"{k}: "), v, "  "], style={"marginRight": "12px"}) for k, v in facts],
            id="job-detail-facts",
        ),
    ]
    if job.message:
        out.append(html.Div(job.message, id="job-detail-message", style={"color": "#a33"}))
    return out


def error_banner(message: str, component_id: str) -> html.Div:
    """A visible error line (controller unreachable, bad answer)."""
    return html.Div(
        message, id=component_id, className="vigil-error", style={"color": "#a33", "padding": "6px 0"}
    )
