"""Unit tests of the job page's tab builders (dashboard/pages/job/tabs.py) against a fake client: each
tab gives one value per output it declares, the figures are figures, a wide job's heatmap is redrawn
on every few ticks only, and the Ranks tab's seconds lost to slow ranks (bars by node, rows, words when
nothing is known or lost) and the Goodput figure's "slow ranks" cause.

Needs: dash, plotly and the wire schemas only (no server, no browser).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import dash
import plotly.graph_objects as go
import pytest

from dashboard.pages.job.clicks import clicked_rank
from dashboard.pages.job.cursor import advance
from dashboard.pages.job.figures.ranks import LOST_BARS, seconds_lost_figure
from dashboard.pages.job.figures.recovery import goodput_figure
from dashboard.pages.job.tables import seconds_lost_rows
from dashboard.pages.job.tabs import HEATMAP_BIG_JOB, SLOW_REFRESH_EVERY, TAB_BUILDERS, TAB_OUTPUTS
from tests.dashboard import job_samples as js
from vigil.contract.schemas import EventsPublic, FaultsPublic, IncidentsPublic, RankLost


class _Client:
    """What the tabs read of :class:`vigil.contract.client.VigilClient`, from the samples; counts the reads."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        answers = {
            "job_heatmap": lambda: js.heatmap(),
            "job_steps": lambda: js.job_steps(ranks=4, slow=2),
            "job_collectives": lambda: js.collectives("job", js.collective("all_reduce", "grads", range(5))),
            "job_incidents": lambda: IncidentsPublic(data=[js.incident(1, evidence=js.hang_evidence())], count=1),
            "list_faults": lambda: FaultsPublic(data=[js.fault(1)], count=1),
            "job_stacks": lambda: js.stacks(),
            "job_checkpoints": lambda: SimpleNamespace(data=[js.checkpoint(1, 5), js.checkpoint(2, 8, valid=False)]),
            "list_events": lambda: EventsPublic(data=[], count=0),
            "job_overview": lambda: js.overview(markers=[js.marker("restart", 6, ref="1")]),
            "job_goodput": lambda: js.goodput(),
            "job_seconds_lost": lambda: js.seconds_lost(),
        }
        if name not in answers:
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return answers[name]()
        return call


@pytest.mark.parametrize("tab", sorted(TAB_BUILDERS))
@pytest.mark.parametrize("rank", [None, 2])
def test_each_tab_fills_each_of_its_outputs(tab: str, rank: int | None) -> None:
    cursor = advance(None, js.overview(ranks=4, slow=2), full=True)
    values = TAB_BUILDERS[tab](_Client(), "job", cursor, rank, False)
    assert len(values) == len(TAB_OUTPUTS[tab])
    for (_, prop), value in zip(TAB_OUTPUTS[tab], values, strict=True):
        if prop == "figure":
            assert isinstance(value, go.Figure) or value is dash.no_update, (tab, value)


def test_a_wide_jobs_heatmap_waits_for_every_few_ticks() -> None:
    cursor = advance(None, js.overview(ranks=HEATMAP_BIG_JOB + 1), full=True)
    assert cursor.tick % SLOW_REFRESH_EVERY  # not a slow tick
    client = _Client()
    heat, *_ = TAB_BUILDERS["ranks"](client, "job", cursor, None, True)
    assert heat is dash.no_update and "job_heatmap" not in client.calls
    heat, *_ = TAB_BUILDERS["ranks"](client, "job", cursor, None, False)  # the tab opened: drawn now
    assert isinstance(heat, go.Figure) and "job_heatmap" in client.calls


def test_the_ranks_tab_ranks_the_seconds_each_rank_cost() -> None:
    cursor = advance(None, js.overview(ranks=4, slow=2), full=True)
    out = dict(zip([cid for cid, _ in TAB_OUTPUTS["ranks"]], TAB_BUILDERS["ranks"](_Client(), "job", cursor, None,
                                                                                  False), strict=True))
    fig, rows = out["job-detail-rank-lost"], out["job-detail-rank-lost-table"]
    # Rank 1 ran at the median pace (0 s): neither a bar nor a row.
    assert list(fig.data[0].x) == ["rank 2", "rank 0"] and list(fig.data[0].y) == [6.0, 0.2]
    assert list(fig.data[0].text) == ["n1", "n0"]
    assert "6.2 s (3.1% of wall time) over 50 steps" in fig.layout.title.text
    assert rows[0] == {"rank": 2, "node_id": "n1", "seconds_lost": 6.0, "share_pct": 3.0, "steps_charged": 48,
                       "last_step_lost_s": 0.12}
    assert [r["rank"] for r in rows] == [2, 0]


def test_seconds_lost_unknown_or_nothing_lost_says_so_in_words() -> None:
    fig = seconds_lost_figure(js.seconds_lost(steps=0))
    assert not fig.data and "not known yet" in fig.layout.annotations[0].text
    assert not seconds_lost_figure(None).data
    clean = js.seconds_lost().model_copy(update={"seconds_lost": 0.0, "share_of_wall": 0.0, "ranks": [
        r.model_copy(update={"seconds_lost": 0.0, "share_of_wall": 0.0, "steps_charged": 0})
        for r in js.seconds_lost().ranks]})
    fig = seconds_lost_figure(clean)
    assert not fig.data and "every step ran at the median rank's pace (50 steps counted)" in \
        fig.layout.annotations[0].text
    assert seconds_lost_rows(clean) == []


def test_seconds_lost_bars_are_colored_by_node_and_a_click_selects_the_rank() -> None:
    sl = js.seconds_lost()
    more = [RankLost(rank=r, node_id="n1" if r % 2 else "n0", seconds_lost=5.0 - 0.1 * r, share_of_wall=0.02,
                     steps_charged=10, last_step_lost_s=0.1) for r in range(3, 40)]
    fig = seconds_lost_figure(sl.model_copy(update={"ranks": [*sl.ranks[:2], *more]}))
    bar = fig.data[0]
    assert len(bar.x) == LOST_BARS and bar.x[:3] == ("rank 2", "rank 0", "rank 3")
    colors = dict(zip(bar.text, bar.marker.color, strict=True))
    assert len(set(colors.values())) == 2 and all(c == colors[n] for n, c in zip(bar.text, bar.marker.color,
                                                                                  strict=True))
    assert fig.layout.xaxis.type == "category"  # most first, as listed
    # What Plotly sends on a click on rank 3's bar: its rank, not its steps.
    assert clicked_rank({"points": [{"x": bar.x[2], "y": bar.y[2], "customdata": bar.customdata[2]}]}) == 3


def test_the_goodput_figure_names_slow_ranks_as_a_cause() -> None:
    gp = js.goodput()
    fig = goodput_figure(gp.model_copy(update={"lost_s": {**gp.lost_s, "slow_ranks": 6.2}}))
    assert "lost: slow ranks" in fig.data[0].x
