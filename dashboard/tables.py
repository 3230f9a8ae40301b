"""The list pages' tables (jobs, nodes, events), the status badge and the error banner, built by pure
functions from wire-schema objects; also the table and row styles the other views share.

Nothing here fetches data; each function maps schema objects to Dash components, so the pages'
callbacks stay thin and these are unit-tested without a server. Rows carry ``data-*`` attributes
(job id, node id, event id) so tests and users' scripts can find them without depending on the
column layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from dash import dcc, html

from controller.schemas import (
    EventsPublic,
    JobsPublic,
    JobStatus,
    NodePublic,
    NodesPublic,
    NodeState,
)
from dashboard.format import (
    DASH,
    fmt_age,
    fmt_float,
    fmt_host,
    fmt_progress,
    fmt_ranks,
    fmt_time,
    fmt_workers,
)

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

ROW_STYLE = {"display": "flex", "flexWrap": "wrap", "gap": "8px", "margin": 0}
"""Row layout that holds without the Bootstrap stylesheet too."""


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


def empty_row(columns: Sequence[str], message: str) -> html.Tr:
    """A single row spanning ``columns`` that says ``message`` (a table with nothing to list)."""
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
        rows = [empty_row(JOB_COLUMNS, "no jobs yet")]
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
        rows = [empty_row(NODE_COLUMNS, "no nodes have reported yet")]
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
        rows = [empty_row(EVENT_COLUMNS, "no events")]
    return html.Table([_header(EVENT_COLUMNS), html.Tbody(rows)], style=TABLE_STYLE)


def error_banner(message: str, component_id: str) -> html.Div:
    """A visible error line (controller unreachable, bad answer)."""
    return html.Div(
        message, id=component_id, className="vigil-error", style={"color": "#a33", "padding": "6px 0"}
    )
