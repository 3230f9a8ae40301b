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

from dashboard.format import DASH, fmt_duration, fmt_float, fmt_rank_list, fmt_time, incident_line
from dashboard.tables import CELL_STYLE, ROW_STYLE, TABLE_STYLE, empty_row
from vigil.contract.schemas import FaultPublic, IncidentPublic, StacksPublic


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


def adapt_line(adapt: Mapping[str, Any]) -> str:
    """What ``recovery.policy: adapt`` did (an incident's ``evidence.adapt``), in one line: the setting, when the
    ranks took it, the step time before / after (and healthy), the eviction verdict, the way back."""
    params = ", ".join(f"{k} {v}" for k, v in sorted((adapt.get("params") or {}).items())) or "the spec's setting"
    when = (f"from step {adapt['switched_step']}" if adapt.get("switched_step") is not None
            else f"asked at step {adapt.get('requested_step')}, waiting for the next checkpoint boundary")
    out = [f"adapted to {params} (version {adapt.get('version')}) {when}"]

    def secs(key: str) -> str:
        v = adapt.get(key)
        return f"{v:.3f} s" if isinstance(v, int | float) else "?"

    out.append(f"step time {secs('step_s_before')} before, {secs('step_s_after')} after (healthy {secs('step_s_healthy')})")
    verdict = adapt.get("eviction")
    if isinstance(verdict, Mapping):
        out.append("evicted: still slower than an eviction costs" if verdict.get("worth")
                   else f"eviction not worth it ({verdict.get('projected_lost_s')} s over {verdict.get('steps_left')} steps "
                        f"left vs a {verdict.get('restart_s')} s restart)")
    back = adapt.get("revert")
    if isinstance(back, Mapping):
        out.append(f"back to the spec's setting from step {back['switched_step']}" if back.get("switched_step") is not None
                   else f"back to the spec's setting asked ({back.get('why')})")
    return "; ".join(out)


HEAL_PHASE_NAMES = {"detected": "detected", "acted": "Vigil acted", "quorum_without": "quorum without it",
                    "heal_started": "heal started", "healed": "healed", "first_step_together": "first step together",
                    "recovered": "recovered"}


def heal_timeline_view(timeline: Sequence[Mapping[str, Any]]) -> html.Div:
    """A live recovery phase by phase (an incident's ``evidence.timeline``, controller/recovery/heal_timeline.py):
    a headline (detection to the first step together, the heal's seconds and bytes) over one row per phase
    with its time from the detection and what happened."""
    at = {p.get("phase"): p for p in timeline if isinstance(p, Mapping)}
    head: list[str] = []
    if "first_step_together" in at:
        head.append(f"training together again {at['first_step_together']['after_s']:+.2f} s after the detection")
    if "healed" in at and "heal_started" in at:
        head.append(f"heal {at['healed']['ts'] - at['heal_started']['ts']:.2f} s")
    rows = [html.Tr([html.Td(f"{p.get('after_s', 0):+.2f} s", style={**CELL_STYLE, "fontFamily": "monospace",
                                                                      "textAlign": "right", "width": "90px"}),
                     html.Td(HEAL_PHASE_NAMES.get(str(p.get("phase")), str(p.get("phase"))),
                             style={**CELL_STYLE, "fontWeight": "bold", "width": "160px"}),
                     html.Td(str(p.get("detail", "")), style=CELL_STYLE)],
                    className="vigil-heal-phase", **{"data-phase": str(p.get("phase"))})
            for p in timeline if isinstance(p, Mapping)]
    return html.Div([html.B("live recovery: "), "; ".join(head) or DASH,
                     html.Table(html.Tbody(rows), style={**TABLE_STYLE, "fontSize": "13px"})],
                    className="vigil-heal-timeline")


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
    (``collectives``: :func:`dashboard.pages.job.collectives_view.hang_collectives_view`, in place of its evidence
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
    if isinstance(inc.evidence.get("adapt"), Mapping):
        body.append(html.Div([html.B("adaptation: "), adapt_line(inc.evidence["adapt"])], className="vigil-incident-adapt"))
    if isinstance(inc.evidence.get("timeline"), list):
        body.append(heal_timeline_view(inc.evidence["timeline"]))
    skip = ("stack_groups", "adapt", "timeline", *(("collectives",) if collectives is not None else ()))
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
