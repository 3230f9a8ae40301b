"""The node page's header line and the tables of the ranks and incidents on the node, built by pure
functions from wire-schema objects (:class:`NodePublic`, :class:`RankProcess`, :class:`IncidentPublic`),
unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dash_bootstrap_components as dbc
from dash import dcc, html

from dashboard.format import DASH, fmt_age, fmt_time
from vigil.contract.schemas import IncidentPublic, NodePublic, RankProcess


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
