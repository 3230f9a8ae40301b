"""The job page as a diagnosis, in a real browser, against the REAL controller.

Debian's headless Chromium (selenium) reads what a user sees on the job page of the dashboard mounted
in the real controller (``dashboard_site``: uvicorn, SQLite), after :func:`tests.dashboard.job_seed.
seed_diagnosis` told the controller, through its REST API, the story of a 12-rank job: rank 5 a
straggler (the seconds it cost ranked from ``GET /jobs/{id}/stragglers``), a hang of rank 7 diagnosed from
its place in the collectives and py-spy stacks, a corrupt checkpoint, a restart from step 20. The controller's own monitor and aggregator did the rest (driven one
pass at a time). A second job's only collectives are torch's own, their bytes estimated
(:func:`tests.dashboard.job_seed.seed_torch_only`).

Needs: ``apt-get install -y chromium chromium-driver`` (skipped without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dashboard.figures.base import WAITING_TEXT
from dashboard.pages.job.collectives_view import ESTIMATED_NOTE
from tests.dashboard.conftest import Site
from tests.dashboard.harness import Browser
from tests.dashboard.job_seed import (
    CORRUPT,
    HANG_SUMMARY,
    ODD,
    SLOW,
    Diagnosis,
    seed_diagnosis,
    seed_torch_only,
)

_TRACE_Y_JS = """
const root = document.getElementById(arguments[0]);
const gd = root && root.querySelector('.js-plotly-plot');
if (!gd || !gd.data) { return null; }
const out = {};
gd.data.forEach(t => { out[t.name] = Array.from(t.y || []); });
return out;
"""
_LAYOUT_JS = """
const root = document.getElementById(arguments[0]);
const gd = root && root.querySelector('.js-plotly-plot');
return gd && gd.layout ? JSON.parse(JSON.stringify(gd.layout)) : null;
"""


@pytest.fixture
def diag(page: Browser, dashboard_site: Site) -> Iterator[tuple[Browser, Diagnosis]]:
    """The diagnosis job stored, and the browser on its page."""
    d = seed_diagnosis(dashboard_site.controller)
    assert d.incident_id is not None and d.restart_step is not None, d
    page.get(f"{dashboard_site.dashboard}jobs/{d.job_id}")
    page.wait_for(lambda: "diagnose-me" in (page.text("job-detail-header") or ""), what="the job's header")
    yield page, d


_HANG_JS = """
const root = document.getElementById(arguments[0]);
const stacks = document.getElementById('job-detail-stacks');
if (!root || !stacks) { return null; }
const bold = root.querySelector('.vigil-hang-summary b');
return {
  summary: bold ? bold.innerText : null,
  rows: Array.from(root.querySelectorAll('.vigil-hang-rank')).map(r => [r.dataset.rank, r.innerText]),
  above_stacks: root.getBoundingClientRect().bottom <= stacks.getBoundingClientRect().top,
};
"""


def _open_tab(page: Browser, tab: str) -> None:
    page.wait_css(f"#job-detail-tab-{tab}")[0].click()


def _graph_with_data(page: Browser, graph_id: str) -> dict[str, Any]:
    return page.wait_for(lambda: (g := page.graph(graph_id)) and g["traces"] and g, what=f"{graph_id} drawn")


_POINT_JS = """
const root = document.getElementById(arguments[0]);
for (const g of root.querySelectorAll('.scatterlayer .trace')) {
  const cd = g.__data__;
  if (cd && cd[0] && cd[0].trace && cd[0].trace.name === arguments[1]) { return g.querySelector('path.point'); }
}
return null;
"""


def _click_point(page: Browser, graph_id: str, trace_name: str) -> None:
    """A real mouse click on the (first) point of the trace named ``trace_name``."""
    from selenium.webdriver.common.action_chains import ActionChains

    point = page.wait_for(lambda: page.js(_POINT_JS, graph_id, trace_name), what=f"a point of {trace_name}")
    ActionChains(page.driver).move_to_element(point).pause(0.5).perform()
    ActionChains(page.driver).click().perform()


def _grid_rows(page: Browser, grid_id: str) -> list[Any]:
    return page.css(f"#{grid_id} .ag-center-cols-container .ag-row")


def test_loss_curve_marks_the_restart_and_a_click_tells_what_happened(diag: tuple[Browser, Diagnosis]) -> None:
    page, d = diag
    loss = _graph_with_data(page, "job-detail-loss")
    by_name = {t["name"]: t for t in loss["traces"]}
    assert by_name["train loss"]["x"] == list(range(40))  # steps 0-39, the re-run 21-29 latest attempts
    # The restart went back to step 20: the first step run after it is 21, where its marker is (one
    # marker, even when its recorded time rounds past step 21's end).
    assert by_name["restart"]["x"] == [21] and d.restart_step == 21
    assert by_name["incident"]["x"] == [29] and by_name["fault"]["x"] == [29]
    assert by_name["checkpoint"]["x"] == [10, 20, CORRUPT]
    assert by_name["validation loss"]["x"] == [0, 10, 20, 30]

    header = page.text("job-detail-header")
    assert "RUNNING" in header and "restarts: " in header and "39 / 100" in header, header

    def click_until(trace: str, expected: str) -> str:
        for _ in range(5):  # a refresh redrawing the figure under the pointer may swallow a click: again
            _click_point(page, "job-detail-loss", trace)
            try:
                return page.wait_for(lambda: expected in (text := page.text("job-detail-marker-detail") or "") and text,
                                     timeout=4, what=f"the {trace}'s details")
            except AssertionError:
                continue
        raise AssertionError(f"{expected!r} not in {page.text('job-detail-marker-detail')!r}")

    detail = click_until("restart", "restart at step 2")
    assert "restart" in detail.splitlines()[0]
    detail = click_until("incident", "incident at step 29")
    assert "hang (RECOVERED): rank 7, node node-b" in detail and "killed hung rank(s) [7]" in detail, detail
    assert "odd_ranks" in detail  # the incident's evidence
    assert page.console_errors() == []


def test_straggler_is_named_highlighted_and_its_breakdown_shown(diag: tuple[Browser, Diagnosis]) -> None:
    page, _ = diag
    _open_tab(page, "ranks")
    page.wait_for(lambda: f"slowest: rank {SLOW} (5.0x median)" in (page.js(_LAYOUT_JS, "job-detail-step-time") or {})
                  .get("title", {}).get("text", ""), what="the straggler named on the step time bands")
    bands = page.graph("job-detail-step-time")
    assert [t["name"] for t in bands["traces"]] == ["p50", "p90", "max (slowest rank)"]  # 12 ranks: no line each
    assert page.css("#job-detail-rank-lines-box")[0].is_displayed() is False

    rows = page.wait_for(lambda: _grid_rows(page, "job-detail-slowest"), what="slowest ranks")
    first = rows[0]
    assert first.get_attribute("row-id") == str(SLOW)
    assert "straggler" in first.text and "node-a" in first.text, first.text
    assert "253, 224, 224" in (first.value_of_css_property("background-color") or ""), "straggler row highlighted"

    heat = _graph_with_data(page, "job-detail-heatmap")
    assert heat["traces"][0]["rows"] == 12
    ticks = page.js(_LAYOUT_JS, "job-detail-heatmap")["yaxis"]["ticktext"]
    assert [t for t in ticks if "▶" in t] == [f"<b style='color:#d62728'>▶ rank {SLOW}</b>"]

    # Click the straggler's row: its breakdown.
    page.css(f'#job-detail-slowest .ag-row[row-id="{SLOW}"] .ag-cell')[0].click()
    page.wait_for(lambda: f"rank {SLOW} on node-a" in (page.text("job-detail-rank-info") or ""), what="rank info")
    page.wait_for(lambda: f"Step breakdown: rank {SLOW}" in (page.js(_LAYOUT_JS, "job-detail-rank-breakdown") or {})
                  .get("title", {}).get("text", ""), what="the rank's breakdown")
    ys = page.js(_TRACE_Y_JS, "job-detail-rank-breakdown")
    assert set(ys["forward+backward"]) == {0.45}

    # Where the time goes, per rank: the straggler's forward+backward stands out.
    _open_tab(page, "breakdown")
    per_rank = _graph_with_data(page, "job-detail-breakdown-rank")
    labels = per_rank["traces"][0]["x"]
    fb = page.js(_TRACE_Y_JS, "job-detail-breakdown-rank")["forward+backward"]
    assert labels[fb.index(max(fb))] == f"▶ rank {SLOW}" and max(fb) == pytest.approx(0.45)

    _open_tab(page, "communication")
    _graph_with_data(page, "job-detail-coll-bits")
    bits = page.wait_for(lambda: page.js(_TRACE_Y_JS, "job-detail-coll-bits"), what="bits per parameter")
    assert set(bits["grads"]) == {32.0} and set(bits["weights"]) == {4.0}
    kinds = page.wait_for(lambda: [r.get_attribute("row-id") for r in _grid_rows(page, "job-detail-collectives")],
                          what="collectives grid")
    assert sorted(kinds) == ["all_gather/weights", "all_reduce/grads"]
    assert not page.text("job-detail-coll-note")  # Vigil counted these bytes: nothing estimated
    assert page.console_errors() == []


def test_seconds_lost_ranks_the_straggler_and_a_row_selects_it(diag: tuple[Browser, Diagnosis]) -> None:
    page, _ = diag
    _open_tab(page, "ranks")
    # Rank 5 computes 0.45 s a step against 0.05 s: every step's seconds lost are its alone, and the other
    # eleven ranks, at the median pace, cost nothing (no bar, no row).
    lost = _graph_with_data(page, "job-detail-rank-lost")
    assert lost["traces"][0]["x"] == [f"rank {SLOW}"], lost
    title = page.js(_LAYOUT_JS, "job-detail-rank-lost")["title"]["text"]
    assert title.startswith("Seconds lost to slow ranks: ") and "% of wall time) over " in title, title
    rows = page.wait_for(lambda: _grid_rows(page, "job-detail-rank-lost-table"), what="seconds-lost rows")
    assert [r.get_attribute("row-id") for r in rows] == [str(SLOW)] and "node-a" in rows[0].text, rows[0].text

    cell = page.css(f'#job-detail-rank-lost-table .ag-row[row-id="{SLOW}"] .ag-cell')[0]
    # Below the fold, and Bootstrap makes scrolling smooth: Selenium's own scroll leaves it unclickable.
    page.js("arguments[0].scrollIntoView({block: 'center', behavior: 'instant'});", cell)
    cell.click()
    page.wait_for(lambda: f"rank {SLOW} on node-a" in (page.text("job-detail-rank-info") or ""), what="rank info")

    page.js("window.scrollTo({top: 0, behavior: 'instant'});")  # back to the tabs
    _open_tab(page, "goodput")
    goodput = _graph_with_data(page, "job-detail-goodput-figure")
    assert "lost: slow ranks" in goodput["traces"][0]["x"], goodput
    assert page.console_errors() == []


def test_hang_stacks_checkpoints_and_goodput(diag: tuple[Browser, Diagnosis]) -> None:
    page, d = diag
    _open_tab(page, "incidents")
    card = page.wait_css(f"#job-detail-incident-{d.incident_id}")[0]
    text = card.text
    # Where each rank stands in its collectives, above the stacks: rank 7 never entered the all-reduce.
    where = page.wait_for(lambda: page.js(_HANG_JS, f"job-detail-hang-collectives-{d.incident_id}"),
                          what="the hang's collectives")
    assert HANG_SUMMARY in where["summary"], where
    assert [r for r, text in where["rows"] if "never entered" in text] == [str(ODD)] and len(where["rows"]) == 12
    assert where["above_stacks"], where
    for expected in ("hang", "RECOVERED", "rank 7", "fault ", "detected +", "acted +", "recovered +",
                     "killed hung rank(s) [7]", "injected fault", "hang_rank rank 7 at step 29"):
        assert expected in text, (expected, text)
    odd = page.wait_css("#job-detail-stack-odd")[0]
    assert odd.get_attribute("data-rank") == str(ODD)
    assert "forward (vigil/model.py:120)" in odd.text
    diff = [e.text for e in page.css("#job-detail-stack-odd .vigil-stack-diff")]
    assert any("forward (vigil/model.py:120)" in line for line in diff)
    assert "all_reduce (vigil/comm.py:90)" in page.text("job-detail-stack-majority")
    assert f"odd rank out: {ODD}" in page.text("job-detail-stacks")
    timeline = _graph_with_data(page, "job-detail-incident-timeline")
    assert {t["name"] for t in timeline["traces"] if t["n"]} >= {"fault", "detected", "acted", "recovered"}

    _open_tab(page, "checkpoints")
    rows = page.wait_for(lambda: {r.get_attribute("row-id"): r.text for r in _grid_rows(page, "job-detail-checkpoints")}
                         if len(_grid_rows(page, "job-detail-checkpoints")) == 3 else None, what="checkpoints")
    by_step = {t.split()[0]: t for t in rows.values()}
    assert "NO" in by_step[str(CORRUPT)] and "sha256 mismatch in model.pt" in by_step[str(CORRUPT)]
    assert "restart 1" in by_step["20"] and "yes" in by_step["20"]
    assert "restart" not in by_step["10"]

    _open_tab(page, "goodput")
    ettr = page.wait_for(lambda: page.text("job-detail-ettr"), what="ETTR")
    assert 0.0 < float(ettr) < 1.0, ettr
    assert "1 restart" in page.text("job-detail-goodput")
    goodput = _graph_with_data(page, "job-detail-goodput-figure")
    assert goodput["traces"][0]["x"][0] == "productive"
    assert page.console_errors() == []


def test_torch_only_collectives_are_drawn_and_marked_estimated(page: Browser, dashboard_site: Site) -> None:
    job_id = seed_torch_only(dashboard_site.controller)
    page.get(f"{dashboard_site.dashboard}jobs/{job_id}")
    page.wait_for(lambda: "plain-ddp" in (page.text("job-detail-header") or ""), what="the job's header")
    _open_tab(page, "communication")
    kinds = page.wait_for(lambda: sorted(r.get_attribute("row-id") for r in _grid_rows(page, "job-detail-collectives")),
                          what="collectives grid")
    assert kinds == ["all_reduce/torch (est.)", "broadcast/torch (est.)"]
    graphs = ("job-detail-coll-time", "job-detail-coll-wait", "job-detail-coll-bandwidth", "job-detail-coll-bits")
    drawn = {g: _graph_with_data(page, g) for g in graphs}
    assert all(WAITING_TEXT not in d["annotations"] for d in drawn.values()), drawn
    assert set(drawn["job-detail-coll-time"]["traces"][0]["x"]) == {"all_reduce/torch (est.)",
                                                                    "broadcast/torch (est.)"}
    assert [t["name"] for t in drawn["job-detail-coll-bits"]["traces"]] == ["torch (est.)"]
    assert page.wait_for(lambda: page.text("job-detail-coll-note"), what="the note") == ESTIMATED_NOTE
    assert WAITING_TEXT not in page.text("job-detail-tab-communication")
    assert page.console_errors() == []
