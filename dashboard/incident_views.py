"""The job page's incident views: an incident's card (timeline, action, evidence, a hang's place in
the collectives and its py-spy stacks), the evidence table, the timeline line and the stack
comparison (the odd ranks' stacks against the majority's). Pure functions from wire-schema objects to
Dash components.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import dash_bootstrap_components as dbc
from dash import html

from controller.schemas import FaultPublic, IncidentPublic, StacksPublic
from dashboard.format import DASH, fmt_duration, fmt_float, fmt_rank_list, fmt_time, incident_line
from dashboard.tables import CELL_STYLE, ROW_STYLE, TABLE_STYLE, empty_row


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
        rows = [empty_row(("key", "value"), "no evidence recorded")]
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
