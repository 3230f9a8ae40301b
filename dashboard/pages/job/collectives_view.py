"""What the job page says about collectives besides their numbers, built by pure functions:

* **estimated bytes**: collectives torch ran on its own (DDP buckets, FSDP, the user's calls), read from
  its Flight Recorder (tag :data:`vigil.contract.schemas.CAPTURED_TAG`), carry bytes estimated from the op
  and tensor sizes rather than counted by Vigil's communication layer. Wherever such a kind is labelled
  its label ends in :data:`ESTIMATED_MARK` (:func:`mark_estimated`), and the Communication tab says why
  (:func:`estimated_note`);
* **a hang's collective evidence** (``evidence["collectives"]``, written by the controller's hang
  diagnosis, ``controller/recovery/collectives.py``): who waits in which collective and who never
  entered it, then each rank's place in its collectives, one row per rank (:func:`hang_collective_rows`,
  drawn by :func:`hang_collectives_view` above the hang's stacks).

A module of its own only to keep the figure and table modules short; like them,
nothing here fetches data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dash import html

from dashboard.format import DASH, fmt_float, fmt_rank_list
from dashboard.tables import CELL_STYLE, TABLE_STYLE
from vigil.contract.schemas import JobCollectivesPublic

ESTIMATED_MARK = " (est.)"
"""Appended to the label of a kind of collective whose bytes are estimated."""
ESTIMATED_NOTE = ("Bytes of collectives marked (est.) are estimated from the op and tensor sizes (captured from "
                  "torch.distributed's Flight Recorder), not counted by Vigil's communication layer.")
NEVER_ENTERED = "never entered"
"""The marker of a rank that never entered the collective the others wait in."""
SILENT = "sent no report"
"""The marker of a live rank that sent no report (stopped, or its watcher could not speak)."""
HANG_COLUMNS = ("rank", "step", "idle s", "last done", "inside now", "")
MAX_SUMMARY_CHARS = 240
"""A longer summary line (the controller's names every waiting rank) is said again with rank ranges."""
MAX_HANG_ROWS = 64
"""Ranks listed at most (those that never entered first): a 10,000-rank hang stays readable."""
_HIGHLIGHT = {"backgroundColor": "#fde0e0", "fontWeight": "bold"}
"""The grids' highlight (stragglers, invalid checkpoints)."""


# -- Estimated bytes -----------------------------------------------------------------------------------


def mark_estimated(label: str, estimated: bool) -> str:
    """``label`` with :data:`ESTIMATED_MARK` when its bytes are estimated: ``all_reduce/torch (est.)``."""
    return label + ESTIMATED_MARK if estimated else label


def estimated_tags(coll: JobCollectivesPublic | None) -> set[str]:
    """The tags (tag, else op: as :func:`dashboard.pages.job.figures.collectives.bits_per_element_by_tag` names its
    lines) of which some kind has estimated bytes."""
    return {c.tag or c.op for c in (coll.data if coll else []) if c.estimated}


def estimated_note(coll: JobCollectivesPublic | None) -> html.Div | None:
    """The line under the Communication tab that explains :data:`ESTIMATED_MARK`; None when no kind of
    ``coll`` is estimated."""
    if not any(c.estimated for c in (coll.data if coll else [])):
        return None
    return html.Div(ESTIMATED_NOTE, className="vigil-estimated-note",
                    style={"fontSize": "13px", "color": "#555", "fontStyle": "italic", "margin": "4px 0"})


# -- A hang's collective evidence ----------------------------------------------------------------------


def collective_ref(ref: Any) -> str:
    """One collective as a person reads it: ``all_reduce #82 (world)``; a dash for none."""
    if not isinstance(ref, Mapping):
        return DASH
    text = str(ref.get("op") or "?")
    if ref.get("seq") is not None:
        text += f" #{ref['seq']}"
    return f"{text} ({ref['group']})" if ref.get("group") else text


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _seconds(value: Any) -> str:
    return fmt_float(float(value), 3) if isinstance(value, int | float) and not isinstance(value, bool) else DASH


def _found(evidence: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    found = (evidence or {}).get("collectives")
    return found if isinstance(found, Mapping) else None


def _ranks(value: Any) -> list[int]:
    return [r for r in (_int(x) for x in value or ()) if r is not None] if isinstance(value, list | tuple) else []


def hang_summary(evidence: Mapping[str, Any] | None) -> str | None:
    """The diagnosis' one line (who waits where, for whom); None when the evidence names no collective.
    Without its line, or with one of more than :data:`MAX_SUMMARY_CHARS` (thousands of waiting ranks),
    the line is built from the evidence with rank ranges (``ranks 0-6, 8-11 wait in ...``)."""
    found = _found(evidence)
    if found is None:
        return None
    line = found.get("summary") if isinstance(found.get("summary"), str) else ""
    if line and len(line) <= MAX_SUMMARY_CHARS:
        return line
    if isinstance(found.get("waiting_in"), Mapping):
        waiting, late = _ranks(found.get("waiting_ranks")), _ranks(found.get("not_entered"))
        who = (f"rank {waiting[0]} waits" if len(waiting) == 1 else
               f"ranks {fmt_rank_list(waiting)} wait" if waiting else "ranks wait")
        text = f"{who} in {collective_ref(found['waiting_in'])}"
        silent = _ranks(found.get("silent"))
        if late:
            return text + f"; rank{'s' if len(late) != 1 else ''} {fmt_rank_list(late)} never entered it"
        return text + (f"; rank{'s' if len(silent) != 1 else ''} {fmt_rank_list(silent)} sent no report" if silent else "")
    return line[:MAX_SUMMARY_CHARS - 3] + "..." if line else None


def hang_collective_rows(evidence: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per rank of a hang's collective evidence, by rank: ``rank``, ``step``, ``idle_s`` (text),
    ``last_done`` and ``inside`` (:func:`collective_ref`, a dash for none), ``marker``
    (:data:`NEVER_ENTERED` for the ranks in ``not_entered``, :data:`SILENT` for those in ``silent``, else
    empty). Missing fields read as dashes; a rank of ``not_entered`` or ``silent`` without a report still gets its row. No rows when the evidence has no
    ``collectives``."""
    found = _found(evidence)
    if found is None:
        return []
    late, silent = set(_ranks(found.get("not_entered"))), set(_ranks(found.get("silent")))
    reports = found.get("ranks") if isinstance(found.get("ranks"), Mapping) else {}
    by_rank: dict[int, Mapping[str, Any]] = {}
    for key, rep in reports.items():
        rank = _int(key)
        if rank is not None:
            by_rank[rank] = rep if isinstance(rep, Mapping) else {}
    for rank in late | silent:
        by_rank.setdefault(rank, {})
    return [
        {
            "rank": rank,
            "step": DASH if _int(rep.get("step")) is None else str(_int(rep.get("step"))),
            "idle_s": _seconds(rep.get("idle_s")),
            "last_done": collective_ref(rep.get("last_done")),
            "inside": collective_ref(rep.get("in_flight")),
            "marker": NEVER_ENTERED if rank in late else SILENT if rank in silent else "",
        }
        for rank, rep in sorted(by_rank.items())
    ]


def _shown(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` rows, those marked first, in rank order."""
    if len(rows) <= limit:
        return rows
    keep = ([r for r in rows if r["marker"]] + [r for r in rows if not r["marker"]])[:limit]
    return sorted(keep, key=lambda r: r["rank"])


def hang_collectives_view(evidence: Mapping[str, Any] | None, component_id: str | None = None,
                          max_rows: int = MAX_HANG_ROWS) -> html.Div | None:
    """The summary line in bold, then the table of :func:`hang_collective_rows` (the ranks that never
    entered highlighted; at most ``max_rows`` ranks, those first). None when the evidence names no
    collective."""
    summary, rows = hang_summary(evidence), hang_collective_rows(evidence)
    if summary is None and not rows:
        return None
    shown = _shown(rows, max_rows)
    cells = ("rank", "step", "idle_s", "last_done", "inside", "marker")
    body = [
        html.Tr([html.Td(str(r[c]), style=CELL_STYLE) for c in cells], className="vigil-hang-rank",
                style=_HIGHLIGHT if r["marker"] else None, **{"data-rank": str(r["rank"])})
        for r in shown
    ]
    if len(shown) < len(rows):
        body.append(html.Tr(html.Td(f"... and {len(rows) - len(shown)} more ranks", colSpan=len(cells),
                                    style={**CELL_STYLE, "color": "#888"})))
    children: list[Any] = [html.Div(html.B(summary or "ranks' places in their collectives"),
                                    className="vigil-hang-summary")]
    if body:
        children.append(html.Table(
            [html.Thead(html.Tr([html.Th(c, style=CELL_STYLE) for c in HANG_COLUMNS])), html.Tbody(body)],
            style={**TABLE_STYLE, "fontSize": "13px"}, className="vigil-hang-ranks"))
    extra = {"id": component_id} if component_id else {}
    return html.Div(children, className="vigil-hang-collectives", style={"margin": "6px 0"}, **extra)
