"""Unit tests of dashboard/pages/job/collectives_view.py and of where the job page's figures, grid and incident
cards use it: collectives whose bytes are estimated (captured from torch) marked ``(est.)``; a hang's
collective evidence as a summary line and one row per rank.

Needs: dash, plotly and the wire schemas only (no server, no browser).
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import pytest

from dashboard import format as fmt
from dashboard.figures import base as plotting
from dashboard.pages.job import collectives_view as cv
from dashboard.pages.job import incidents as incident_views
from dashboard.pages.job import joins, panels
from dashboard.pages.job import tables as job_tables
from dashboard.pages.job.figures import collectives as collective_figures
from tests.dashboard import job_samples as js
from vigil.contract.schemas import CAPTURED_TAG


def _walk(component: Any) -> list[Any]:
    out = [component]
    children = getattr(component, "children", None)
    if isinstance(children, list | tuple):
        for c in children:
            out += _walk(c)
    elif children is not None and not isinstance(children, str | int | float):
        out += _walk(children)
    return out


def _text(component: Any) -> str:
    parts = [c for c in _walk(component) if isinstance(c, str)]
    parts += [c.children for c in _walk(component) if isinstance(getattr(c, "children", None), str)]
    return " | ".join(parts)


def _annotations(fig: go.Figure) -> list[str]:
    return [a.text for a in fig.layout.annotations]


def _torch(op: str = "all_reduce", steps: range = range(3), **kw: Any) -> Any:
    return js.collective(op, CAPTURED_TAG, steps, **kw)


# -- Estimated bytes -----------------------------------------------------------------------------------


def test_mark_estimated() -> None:
    assert cv.mark_estimated("all_reduce/torch", True) == "all_reduce/torch (est.)"
    assert cv.mark_estimated("all_reduce/grads", False) == "all_reduce/grads"


def test_estimated_kinds_are_marked_in_every_figure_and_the_grid() -> None:
    coll = js.collectives("job", js.collective("all_gather", "weights", range(3)),
                          _torch(p50=0.05), _torch("broadcast", group="pg1", p50=0.001))
    stats = collective_figures.collective_stats(coll)
    assert [k.estimated for k in stats] == [True, False, True]
    labels = ["all_reduce/torch (est.)", "all_gather/weights", "broadcast/torch [pg1] (est.)"]
    assert [k.label for k in stats] == labels
    for fig in (collective_figures.collective_time_figure(stats), collective_figures.collective_wait_figure(stats),
                collective_figures.collective_bandwidth_figure(stats)):
        assert all(list(t.x) == labels for t in fig.data), fig.layout.title.text
    bits = collective_figures.bits_per_element_figure(coll)
    assert [t.name for t in bits.data] == ["torch (est.)", "weights"]  # the legend
    only = collective_figures.bits_per_element_figure(js.collectives("job", _torch()))
    assert [t.name for t in only.data] == ["torch (est.)"] and only.layout.showlegend  # a lone line is named too
    assert [r["kind"] for r in job_tables.collective_rows(stats)] == labels


def test_the_note_shows_only_when_a_kind_is_estimated() -> None:
    note = cv.estimated_note(js.collectives("job", js.collective("all_reduce", "grads", range(2)), _torch()))
    assert note is not None and note.children == cv.ESTIMATED_NOTE
    assert "(est.)" in cv.ESTIMATED_NOTE and "Flight Recorder" in cv.ESTIMATED_NOTE
    assert cv.estimated_note(js.collectives("job", js.collective("all_reduce", "grads", range(2)))) is None
    assert cv.estimated_note(None) is None
    assert cv.estimated_tags(js.collectives("job", _torch(), js.collective("all_reduce", "grads", range(2)))) == {
        CAPTURED_TAG}


def test_a_job_whose_only_collectives_are_torchs_is_not_waiting_for_data() -> None:
    coll = js.collectives("job", _torch(), _torch("broadcast", steps=range(1)))
    stats = collective_figures.collective_stats(coll)
    figs = [collective_figures.collective_time_figure(stats), collective_figures.collective_wait_figure(stats),
            collective_figures.collective_bandwidth_figure(stats), collective_figures.bits_per_element_figure(coll)]
    assert all(len(f.data) > 0 and plotting.WAITING_TEXT not in _annotations(f) for f in figs)
    assert len(job_tables.collective_rows(stats)) == 2
    # Estimates without a transfer time or an element count are still data, said as such.
    bare = js.collectives("job", _torch(transfer=0.0, elements_per_rank=0))
    bw = collective_figures.collective_bandwidth_figure(collective_figures.collective_stats(bare))
    bits = collective_figures.bits_per_element_figure(bare)
    assert _annotations(bw) == ["no transfer time measured"] and _annotations(bits) == ["no parameter counts reported"]


# -- A hang's collective evidence ----------------------------------------------------------------------


def test_hang_rows_one_per_rank_with_the_late_one_marked() -> None:
    evidence = {"idle_s": 31.0, "collectives": js.hang_evidence(ranks=4, late=1, seq=82)}
    rows = cv.hang_collective_rows(evidence)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert rows[0] == {"rank": 0, "step": "40", "idle_s": "31.2", "last_done": "all_reduce #81 (world)",
                       "inside": "all_reduce #82 (world)", "marker": ""}
    assert rows[1] == {"rank": 1, "step": "39", "idle_s": "32.5", "last_done": "all_reduce #81 (world)",
                       "inside": fmt.DASH, "marker": "never entered"}
    assert cv.hang_summary(evidence) == "ranks 0, 2-3 wait in all_reduce #82 of group world; rank 1 never entered it"


def test_hang_rows_with_missing_and_none_fields() -> None:
    found = {
        "waiting_in": {"group": "world", "seq": 5, "op": "broadcast"}, "waiting_ranks": [0], "not_entered": [2, 7],
        "ranks": {
            "0": {"step": 3, "idle_s": 12, "last_done": None, "in_flight": {"op": "broadcast", "seq": 5}},
            "2": {"step": None, "idle_s": None, "last_done": {"group": "pg1", "op": "all_gather"}},
            "x": {"step": 1},  # not a rank: left out
            "4": None,
        },
    }
    rows = {r["rank"]: r for r in cv.hang_collective_rows({"collectives": found})}
    assert sorted(rows) == [0, 2, 4, 7]  # 7 never entered and sent no report: still listed
    assert rows[0] == {"rank": 0, "step": "3", "idle_s": "12", "last_done": fmt.DASH,
                       "inside": "broadcast #5", "marker": ""}
    assert rows[2] == {"rank": 2, "step": fmt.DASH, "idle_s": fmt.DASH, "last_done": "all_gather (pg1)",
                       "inside": fmt.DASH, "marker": "never entered"}
    assert rows[4]["last_done"] == fmt.DASH and rows[4]["marker"] == ""
    assert rows[7] == {"rank": 7, "step": fmt.DASH, "idle_s": fmt.DASH, "last_done": fmt.DASH,
                       "inside": fmt.DASH, "marker": "never entered"}
    # No line of its own: said from the evidence.
    assert cv.hang_summary({"collectives": found}) == "rank 0 waits in broadcast #5 (world); ranks 2, 7 never entered it"
    assert cv.hang_summary({"collectives": {"ranks": {}}}) is None


def test_a_rank_that_sent_no_report_gets_its_row_and_is_said() -> None:
    """Live recovery's stopped rank: no report, so not in ``not_entered``; ``silent`` lists it."""
    found = {"waiting_in": {"group": "world", "seq": 5, "op": "all_reduce"}, "waiting_ranks": [0], "not_entered": [],
             "silent": [1], "ranks": {"0": {"step": 5, "idle_s": 6.1, "in_flight": {"op": "all_reduce", "seq": 5}}}}
    rows = {r["rank"]: r for r in cv.hang_collective_rows({"collectives": found})}
    assert rows[1]["marker"] == cv.SILENT == "sent no report" and rows[0]["marker"] == ""
    assert cv.hang_summary({"collectives": found}) == "rank 0 waits in all_reduce #5 (world); rank 1 sent no report"


def test_a_summary_naming_thousands_of_ranks_is_said_with_ranges() -> None:
    found = js.hang_evidence(ranks=2000, late=1500)
    # The controller says it with ranges itself; a longer line (one listing every rank) is said again so.
    assert found["summary"] == "ranks 0-1499, 1501-1999 wait in all_reduce #82 of group world; rank 1500 never entered it"
    listed = {**found, "summary": "ranks " + ", ".join(map(str, found["waiting_ranks"])) + " wait"}
    assert len(listed["summary"]) > cv.MAX_SUMMARY_CHARS
    assert cv.hang_summary({"collectives": listed}) == (
        "ranks 0-1499, 1501-1999 wait in all_reduce #82 (world); rank 1500 never entered it")


@pytest.mark.parametrize("evidence", [None, {}, {"idle_s": 30.0, "odd_ranks": [1]}, {"collectives": None},
                                      {"collectives": "not a mapping"}])
def test_an_evidence_without_collectives_gives_nothing(evidence: Any) -> None:
    assert cv.hang_collective_rows(evidence) == []
    assert cv.hang_summary(evidence) is None
    assert cv.hang_collectives_view(evidence) is None


def test_hang_view_bold_summary_then_the_ranks() -> None:
    view = cv.hang_collectives_view({"collectives": js.hang_evidence(ranks=4, late=1)}, "job-detail-hang-collectives-3")
    assert view is not None and view.id == "job-detail-hang-collectives-3"
    bold = next(c for c in _walk(view) if type(c).__name__ == "B")
    assert bold.children.startswith("ranks 0, 2-3 wait in all_reduce #82")
    rows = [c for c in _walk(view) if getattr(c, "className", None) == "vigil-hang-rank"]
    assert [r.to_plotly_json()["props"]["data-rank"] for r in rows] == ["0", "1", "2", "3"]
    assert [bool(r.style) for r in rows] == [False, True, False, False]  # the rank that never entered
    assert "never entered" in _text(rows[1]) and "all_reduce #82 (world)" in _text(rows[0])


def test_hang_view_of_many_ranks_keeps_the_late_ones() -> None:
    view = cv.hang_collectives_view({"collectives": js.hang_evidence(ranks=200, late=150)}, max_rows=10)
    rows = [c for c in _walk(view) if getattr(c, "className", None) == "vigil-hang-rank"]
    assert [r.to_plotly_json()["props"]["data-rank"] for r in rows] == [*map(str, range(9)), "150"]
    assert "... and 190 more ranks" in _text(view)


def test_incident_card_shows_the_collectives_above_the_stacks() -> None:
    evidence = {"idle_s": 31.5, "odd_ranks": [1], "stack_groups": [{"ranks": [0], "signature": "s"}],
                "collectives": js.hang_evidence(ranks=4, late=1)}
    inc = js.incident(3, evidence=evidence)
    where = cv.hang_collectives_view(inc.evidence, "job-detail-hang-collectives-3")
    card = incident_views.incident_card(inc, joins.incident_phases(inc, None), None, js.stacks(), where)
    ids = [getattr(c, "id", None) for c in _walk(card)]
    assert ids.index("job-detail-hang-collectives-3") < ids.index("job-detail-stacks")
    text = _text(card)
    assert text.count("rank 1 never entered it") == 1  # not repeated by the evidence table
    assert "waiting_ranks" not in text and "idle_s" in text
    # Where the view is not drawn (a marker's details), the evidence row is the summary, not JSON.
    detail = panels.marker_detail(["incident", 40, "hang", "3", js.TS0], inc)
    assert "rank 1 never entered it" in _text(detail) and "waiting_ranks" not in _text(detail)
