"""Unit tests of dashboard/figures.py: pure functions from wire schemas to Plotly figures.

Needs: plotly and the wire schemas only (no server, no browser).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import pytest

from controller.schemas import JobMetrics, RankSeries
from dashboard import figures
from tests.dashboard.samples import make_metrics, rank_series


def _annotations(fig: go.Figure) -> list[str]:
    return [a.text for a in fig.layout.annotations]


EMPTY_INPUTS = [
    None,
    JobMetrics(job_id="j", ranks=[]),
    JobMetrics(
        job_id="j", ranks=[RankSeries(rank=0, step=[], ts=[], loss=[], step_time_s=[], tokens_per_s=[])]
    ),
]
BUILDERS = [
    figures.loss_figure,
    figures.step_time_figure,
    figures.throughput_figure,
    figures.step_time_heatmap,
]


@pytest.mark.parametrize("build", BUILDERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("metrics", EMPTY_INPUTS, ids=["none", "no-ranks", "rank-without-steps"])
def test_empty_input_gives_waiting_figure(build, metrics) -> None:
    fig = build(metrics)
    assert isinstance(fig, go.Figure)
    assert len(fig.data) == 0
    assert _annotations(fig) == [figures.WAITING_TEXT]
    fig.to_json()  # serialisable, as Dash will send it


def test_loss_one_trace_per_rank_with_all_points() -> None:
    metrics = make_metrics("job", [5, 5, 3])
    fig = figures.loss_figure(metrics)
    assert [t.name for t in fig.data] == ["rank 0", "rank 1", "rank 2"]
    assert [len(t.x) for t in fig.data] == [5, 5, 3]
    assert list(fig.data[2].x) == [0, 1, 2]
    assert list(fig.data[1].y) == metrics.ranks[1].loss
    assert not _annotations(fig)
    assert fig.layout.uirevision == "job"  # zoom survives refreshes of the same job


def test_loss_nan_is_a_gap_not_an_error() -> None:
    metrics = JobMetrics(job_id="j", ranks=[rank_series(0, 4, nan_at=2)])
    fig = figures.loss_figure(metrics)
    (trace,) = fig.data
    assert list(trace.y)[2] is None
    assert trace.connectgaps is False
    assert len(trace.x) == 4


def test_ranks_are_sorted_and_empty_ranks_dropped() -> None:
    empty = RankSeries(rank=1, step=[], ts=[], loss=[], step_time_s=[], tokens_per_s=[])
    metrics = JobMetrics(job_id="j", ranks=[rank_series(3, 2), empty, rank_series(0, 2)])
    assert [t.name for t in figures.step_time_figure(metrics).data] == ["rank 0", "rank 3"]


def test_step_time_lines_carry_step_times() -> None:
    metrics = make_metrics("job", [4, 4], slow_ranks=frozenset({1}))
    fig = figures.step_time_figure(metrics)
    assert [len(t.y) for t in fig.data] == [4, 4]
    assert min(fig.data[1].y) > max(fig.data[0].y)  # the straggler is visibly slower


def test_throughput_adds_total_of_ranks_per_step() -> None:
    a = RankSeries(
        rank=0, step=[0, 1, 2], ts=[0, 1, 2], loss=[1, 1, 1], step_time_s=[1, 1, 1], tokens_per_s=[10, 20, 30]
    )
    b = RankSeries(rank=1, step=[0, 1], ts=[0, 1], loss=[1, 1], step_time_s=[1, 1], tokens_per_s=[1, 2])
    fig = figures.throughput_figure(JobMetrics(job_id="j", ranks=[a, b]))
    assert [t.name for t in fig.data] == ["rank 0", "rank 1", "total"]
    total = fig.data[2]
    assert list(total.x) == [0, 1, 2]
    assert list(total.y) == [11, 22, 30]


def test_throughput_single_rank_has_no_total() -> None:
    fig = figures.throughput_figure(make_metrics("j", [3]))
    assert [t.name for t in fig.data] == ["rank 0"]


def test_heatmap_is_rank_by_step_with_gaps() -> None:
    metrics = make_metrics("job", [4, 2, 3], slow_ranks=frozenset({2}))
    fig = figures.step_time_heatmap(metrics)
    (hm,) = fig.data
    assert hm.type == "heatmap"
    assert list(hm.x) == [0, 1, 2, 3]
    assert list(hm.y) == ["rank 0", "rank 1", "rank 2"]
    z = [list(row) for row in hm.z]
    assert len(z) == 3 and all(len(row) == 4 for row in z)
    assert z[1][2:] == [None, None]  # rank 1 never reported steps 2 and 3
    assert z[2][3] is None
    assert z[0][0] == pytest.approx(0.1)
    assert z[2][0] == pytest.approx(0.5)  # the straggler's row is hot


def test_heatmap_keeps_latest_value_of_repeated_step() -> None:
    # Rank restarted from a checkpoint at step 1: steps 1 and 2 are reported twice.
    rs = RankSeries(
        rank=0,
        step=[0, 1, 2, 1, 2],
        ts=[0, 1, 2, 3, 4],
        loss=[1.0] * 5,
        step_time_s=[0.1, 0.1, 9.0, 0.2, 0.3],
        tokens_per_s=[1.0] * 5,
    )
    fig = figures.step_time_heatmap(JobMetrics(job_id="j", ranks=[rs]))
    assert list(fig.data[0].x) == [0, 1, 2]
    assert [list(r) for r in fig.data[0].z] == [[0.1, 0.2, 0.3]]
    # The line plot keeps every report, in order (the rollback stays visible).
    assert list(figures.step_time_figure(JobMetrics(job_id="j", ranks=[rs])).data[0].x) == [0, 1, 2, 1, 2]


def test_heatmap_window_keeps_latest_steps() -> None:
    fig = figures.step_time_heatmap(make_metrics("j", [50, 50]), max_steps=10)
    assert list(fig.data[0].x) == list(range(40, 50))
    assert all(len(row) == 10 for row in fig.data[0].z)
    with pytest.raises(ValueError, match="max_steps"):
        figures.step_time_heatmap(make_metrics("j", [1]), max_steps=0)


def test_figures_serialise_with_nan_free_json() -> None:
    for build in BUILDERS:
        fig = build(make_metrics("j", [3, 3]))
        text = fig.to_json()
        assert "NaN" not in text and "Infinity" not in text
        assert all(not (isinstance(v, float) and math.isnan(v)) for t in fig.data for v in (t.x or []))
