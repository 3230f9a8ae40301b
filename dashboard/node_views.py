"""Pure builders of the node page (``/nodes/<id>``): its history figures (utilisation, load, network,
NIC errors, GPUs against time), its header line, and the tables of the ranks and incidents on it.

Nothing here fetches data: every function maps wire-schema objects (:class:`NodePublic`,
:class:`NodeHistoryPublic`, :class:`IncidentPublic`) to Plotly figures or small Dash components, so
the page's callbacks stay thin and all of this is unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import dash_bootstrap_components as dbc
import plotly.graph_objects as go
from dash import dcc, html

from controller.schemas import IncidentPublic, NodeHistoryPublic, NodePublic, RankProcess
from dashboard.format import DASH, fmt_age, fmt_time
from dashboard.plotting import MARGIN, WAITING_TEXT, empty_figure


def _times(ts: Sequence[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, UTC) for t in ts]


def _time_lines(
    history: NodeHistoryPublic | None,
    series: Sequence[tuple[str, str]],
    title: str,
    y_title: str,
    *,
    y_range: tuple[float, float] | None = None,
    absent: str = WAITING_TEXT,
) -> go.Figure:
    """One line per ``(label, NodeHistoryPublic field)`` against time; series with no value are left out.
    No point at all gives an empty figure saying ``absent``."""
    if history is None or not history.ts:
        return empty_figure(title)
    x = _times(history.ts)
    fig = go.Figure()
    for label, name in series:
        values = getattr(history, name)
        if not any(v is not None for v in values):
            continue
        fig.add_trace(go.Scatter(x=x, y=list(values), mode="lines", name=label, connectgaps=False))
    if not fig.data:
        return empty_figure(title, absent)
    yaxis: dict[str, Any] = {"title": {"text": y_title}}
    if y_range is not None:
        yaxis["range"] = list(y_range)
    fig.update_layout(title={"text": title}, margin=MARGIN, xaxis={"title": {"text": "time (UTC)"}}, yaxis=yaxis,
                      uirevision=f"{history.node_id}-{title}", legend={"orientation": "h", "y": -0.25})
    return fig


def node_utilisation_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """CPU, memory and (fullest) disk use in percent against time."""
    return _time_lines(history, [("CPU", "cpu_percent"), ("memory", "memory_percent"), ("disk", "disk_percent")],
                       "CPU, memory, disk", "%", y_range=(0, 100))


def node_load_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """The 1-minute load average against time."""
    return _time_lines(history, [("load 1m", "load_1m")], "Load average", "runnable tasks")


def node_network_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """Bytes per second received and sent (summed over the node's interfaces) against time."""
    fig = _time_lines(history, [("rx", "rx_bytes_per_s"), ("tx", "tx_bytes_per_s")], "Network", "bytes / s")
    if fig.data:
        fig.update_yaxes(tickformat="~s")
    return fig


def node_nic_errors_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """NIC errors and drops per second (summed over interfaces) against time."""
    return _time_lines(history, [("errors", "nic_errors_per_s"), ("drops", "nic_drops_per_s")],
                       "NIC errors and drops", "per second")


def node_gpu_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """Mean GPU utilisation and GPU memory use in percent; "no GPU" when the node never reported one."""
    return _time_lines(history, [("GPU util", "gpu_util_percent"), ("GPU memory", "gpu_memory_percent")],
                       "GPUs", "%", y_range=(0, 100), absent="no GPU on this node")


def history_has_gpu(history: NodeHistoryPublic | None) -> bool:
    return history is not None and any(v is not None for v in history.gpu_util_percent + history.gpu_memory_percent)


# --------------------------------------------------------------------------------------------------
# Node page tables
# --------------------------------------------------------------------------------------------------


def node_facts(node: NodePublic) -> html.Div:
    """The node page's header line: state, host, address, heartbeat, agent."""
    color = {"ALIVE": "success", "DEAD": "danger", "EVICTED": "warning"}.get(node.state.value, "secondary")
    facts = [("host", node.hostname or DASH), ("address", node.address or DASH),
             ("heartbeat", fmt_age(node.heartbeat_age_s) + (" ago" if node.heartbeat_age_s is not None else "")),
             ("agent", node.agent_id or DASH)]
    return html.Div([
        html.H2([f"Node {node.id} ", dbc.Badge(node.state.value, color=color, id="node-detail-state")],
                id="node-detail-title"),
        html.Div([html.Span([html.B(f"{k}: "), v], className="me-3") for k, v in facts], id="node-detail-facts"),
    ])


def ranks_table(ranks: Sequence[RankProcess], link_prefix: str) -> Any:
    """The ranks the node's agent sees: job (linked), rank, pid, alive."""
    if not ranks:
        return html.Div("no ranks on this node", className="text-muted")
    rows = [
        html.Tr([html.Td(dcc.Link(r.job_id, href=f"{link_prefix}jobs/{r.job_id}")), html.Td(str(r.rank)),
                 html.Td(str(r.pid)), html.Td("yes" if r.alive else "no")],
                className="vigil-rank-row", **{"data-rank": str(r.rank)})
        for r in sorted(ranks, key=lambda r: (r.job_id, r.rank))
    ]
    head = html.Thead(html.Tr([html.Th(c) for c in ("job", "rank", "pid", "alive")]))
    return dbc.Table([head, html.Tbody(rows)], size="sm", striped=True, hover=True)


def incidents_table(incidents: Sequence[IncidentPublic], link_prefix: str) -> Any:
    """Incidents on the node, newest first: when, kind, status, job (linked), rank, action."""
    if not incidents:
        return html.Div("no incidents on this node", className="text-muted")
    rows = [
        html.Tr([
            html.Td(fmt_time(i.detected_at)),
            html.Td(i.kind.value), html.Td(i.status.value),
            html.Td(dcc.Link(i.job_id, href=f"{link_prefix}jobs/{i.job_id}") if i.job_id else DASH),
            html.Td(DASH if i.rank is None else str(i.rank)), html.Td(i.action or DASH),
        ], className="vigil-incident-row", **{"data-incident-id": str(i.id)})
        for i in incidents
    ]
    head = html.Thead(html.Tr([html.Th(c) for c in ("detected", "kind", "status", "job", "rank", "action")]))
    return dbc.Table([head, html.Tbody(rows)], size="sm", striped=True, hover=True)
