"""Unit tests of the job page's figures (dashboard/pages/job/figures/, one module per tab, on
dashboard/figures/): pure functions from wire schemas to Plotly figures.

Needs: plotly and the wire schemas only (no server, no browser).
"""

from __future__ import annotations

from datetime import timedelta

import plotly.graph_objects as go
import pytest

from dashboard.pages.job.figures import breakdown as breakdown_figures
from dashboard.pages.job.figures import collectives as collective_figures
from dashboard.pages.job.figures import ranks as rank_figures
from dashboard.pages.job.figures import recovery as recovery_figures
from dashboard.pages.job.figures import training as training_figures
from tests.dashboard import job_samples as js
from vigil.contract.schemas import MARKER_KINDS


def _annotations(fig: go.Figure) -> list[str]:
    return [a.text for a in fig.layout.annotations]


# ==================================================================================================
# The job page's diagnosis figures (from the derived views; see tests/dashboard/job_samples.py)
# ==================================================================================================

DIAGNOSIS_EMPTY = [
    lambda: training_figures.overview_loss_figure(None),
    lambda: training_figures.overview_loss_figure(js.overview(steps=range(0))),
    lambda: training_figures.overview_throughput_figure(None),
    lambda: rank_figures.step_time_bands_figure(js.overview(steps=range(0))),
    lambda: rank_figures.rank_lines_figure(None),
    lambda: rank_figures.binned_heatmap_figure(None),
    lambda: breakdown_figures.breakdown_step_figure(None),
    lambda: breakdown_figures.breakdown_rank_figure(js.job_steps(steps=range(0))),
    lambda: collective_figures.collective_time_figure([]),
    lambda: collective_figures.collective_wait_figure([]),
    lambda: collective_figures.collective_bandwidth_figure([]),
    lambda: collective_figures.bits_per_element_figure(None),
    lambda: recovery_figures.incident_timeline_figure([]),
    lambda: recovery_figures.checkpoint_figure([], []),
    lambda: recovery_figures.goodput_figure(None),
]


@pytest.mark.parametrize("build", DIAGNOSIS_EMPTY)
def test_diagnosis_figures_without_data_say_so(build) -> None:
    fig = build()
    assert len(fig.data) == 0 and len(_annotations(fig)) == 1
    fig.to_json()


def test_loss_figure_train_and_validation_then_one_marker_trace_per_kind() -> None:
    markers = [js.marker("restart", 30, "restart 1: resumed at step 21"), js.marker("checkpoint", 20, ref="7"),
               js.marker("checkpoint", 40), js.marker("incident", 28, ref="3"), js.marker("fault", None)]
    fig = training_figures.overview_loss_figure(js.overview(steps=range(50), markers=markers, val_every=10))
    assert [t.name for t in fig.data] == ["train loss", "validation loss", *MARKER_KINDS]
    train, val = fig.data[0], fig.data[1]
    assert list(train.x) == list(range(50)) and train.y[10] == pytest.approx(2.5)
    assert list(val.x) == [0, 10, 20, 30, 40] and val.y[1] == pytest.approx(2.0)
    by_kind = {t.name: t for t in fig.data[training_figures.MARKER_TRACE0:]}
    assert list(by_kind["restart"].x) == [30]
    assert list(by_kind["checkpoint"].x) == [20, 40]
    assert list(by_kind["incident"].x) == [28]
    assert list(by_kind["fault"].x) == []  # no step: not placed
    assert by_kind["fault"].showlegend is False and by_kind["restart"].showlegend is True
    # On the hidden axis over the plot, just above the x axis; a click carries the marker.
    assert all(t.yaxis == "y2" for t in by_kind.values())
    assert fig.layout.yaxis2.range == (0, 1) and fig.layout.yaxis2.visible is False
    assert list(by_kind["restart"].y) == [training_figures.MARKER_STYLE["restart"]["level"]]
    assert list(by_kind["checkpoint"].customdata[0])[:4] == ["checkpoint", 20, "checkpoint 20", "7"]


def test_throughput_is_the_sum_over_ranks_with_ranks_reporting() -> None:
    fig = training_figures.overview_throughput_figure(js.overview(steps=range(3), ranks=12))
    assert [t.name for t in fig.data] == ["tokens / s (all ranks)", "ranks reporting"]
    assert list(fig.data[0].y) == [12000.0] * 3 and list(fig.data[1].y) == [12] * 3


def test_bands_title_names_the_stragglers_else_the_slowest_rank() -> None:
    ov = js.overview(steps=range(2), slow=None)
    assert rank_figures.slowest_title(ov) == "Step time over 12 ranks · slowest: rank 0 (1.0x median)"
    assert rank_figures.slowest_title(js.overview(steps=range(2), slow=5)) == (
        "Step time over 12 ranks · slowest: rank 5 (5.0x median)")


def test_bands_are_p50_p90_max_with_the_slowest_rank_named() -> None:
    fig = rank_figures.step_time_bands_figure(js.overview(steps=range(4), ranks=1024, slow=517))
    assert [t.name for t in fig.data] == ["p50", "p90", "max (slowest rank)"]
    p50, p90, mx = fig.data
    assert list(p50.y) == [0.1] * 4 and list(p90.y) == [0.12] * 4 and list(mx.y) == [0.5] * 4
    assert p90.fill == "tonexty"  # the p50..p90 band
    assert list(mx.customdata) == [517] * 4
    assert "1024 ranks" in fig.layout.title.text and "rank 517 (5.0x median)" in fig.layout.title.text


def test_rank_lines_for_a_few_ranks_only_with_the_straggler_highlighted() -> None:
    fig = rank_figures.rank_lines_figure(js.job_steps(ranks=4, slow=2), highlight=[2])
    assert [t.name for t in fig.data] == ["rank 0", "rank 1", "rank 2 (slow)", "rank 3"]
    assert fig.data[2].line.color == "#d62728" and fig.data[2].line.width == 3
    assert fig.data[2].y[0] == pytest.approx(0.5) and fig.data[0].y[0] == pytest.approx(0.1)
    assert list(fig.data[1].customdata) == [1] * 5
    with pytest.raises(ValueError, match="at most 8"):
        rank_figures.rank_lines_figure(js.job_steps(ranks=9))


def test_binned_heatmap_labels_bins_and_highlights_the_straggler_row() -> None:
    hm = js.heatmap(ranks=16, steps=6, per_bin=4, slow=5)
    fig = rank_figures.binned_heatmap_figure(hm, highlight=[5])
    (trace,) = fig.data
    assert list(trace.y) == ["ranks 0-3", "ranks 4-7", "ranks 8-11", "ranks 12-15"]
    assert [row[0] for row in trace.z] == [0.1, 0.5, 0.1, 0.1]  # the bin's max: the straggler survives
    assert list(trace.x) == [0, 1, 2, 3, 4, 5]
    ticks = list(fig.layout.yaxis.ticktext)
    assert "▶ ranks 4-7" in ticks[1] and "▶" not in ticks[0]
    single = rank_figures.binned_heatmap_figure(js.heatmap(ranks=3, steps=2))
    assert list(single.data[0].y) == ["rank 0", "rank 1", "rank 2"]


def test_step_parts_split_communication_into_transfer_and_wait() -> None:
    parts = breakdown_figures.step_parts(1.0, 0.1, 0.5, 0.1, 0.2, 0.05)
    assert parts == pytest.approx({"data": 0.1, "fwd_bwd": 0.5, "optim": 0.1, "transfer": 0.15, "wait": 0.05,
                                   "other": 0.1})
    assert breakdown_figures.step_parts(None, None, None, None, None, None) == dict.fromkeys(parts, 0.0)
    assert breakdown_figures.step_parts(0.1, 0.2, None, None, None, None)["other"] == 0.0  # never negative


def test_breakdown_stacked_per_step_mean_or_one_rank() -> None:
    steps = js.job_steps(ranks=4, steps=range(3), slow=1)
    fig = breakdown_figures.breakdown_step_figure(steps)
    assert [t.name for t in fig.data] == [name for _, name, _ in breakdown_figures.BREAKDOWN_PARTS]
    assert fig.layout.barmode == "stack"
    by = {t.name: list(t.y) for t in fig.data}
    assert list(fig.data[0].x) == [0, 1, 2]
    assert by["forward+backward"] == pytest.approx([(0.45 + 3 * 0.05) / 4] * 3)
    assert by["communication"] == pytest.approx([0.02] * 3) and by["waiting in collectives"] == pytest.approx([0.01] * 3)
    one = {t.name: list(t.y) for t in breakdown_figures.breakdown_step_figure(steps, rank=1).data}
    assert one["forward+backward"] == pytest.approx([0.45] * 3)
    assert "rank 1" in breakdown_figures.breakdown_step_figure(steps, rank=1).layout.title.text
    assert "32 ranks sampled" in breakdown_figures.breakdown_step_figure(steps, sampled=32).layout.title.text


def test_breakdown_per_rank_shows_where_the_straggler_time_goes() -> None:
    fig = breakdown_figures.breakdown_rank_figure(js.job_steps(ranks=3, steps=range(4), slow=2), highlight=[2])
    assert list(fig.data[0].x) == ["rank 0", "rank 1", "▶ rank 2"]
    fb = next(t for t in fig.data if t.name == "forward+backward")
    assert list(fb.y) == pytest.approx([0.05, 0.05, 0.45])
    assert list(fb.customdata) == [0, 1, 2]


def test_collective_stats_bandwidth_wait_and_bits_per_parameter() -> None:
    coll = js.collectives(
        "job",
        js.collective("all_reduce", "grads", range(5), wire_per_rank=4_000_000, elements_per_rank=1_000_000,
                      transfer=0.002),
        js.collective("all_gather", "weights", range(5), wire_per_rank=500_000, elements_per_rank=1_000_000,
                      p50=0.001, transfer=0.001),
    )
    stats = collective_figures.collective_stats(coll)
    assert [k.label for k in stats] == ["all_reduce/grads", "all_gather/weights"]  # most time first
    grads, weights = stats
    assert grads.bits_per_element == pytest.approx(32.0)
    assert weights.bits_per_element == pytest.approx(4.0)  # what the compressed optimizer saves
    assert grads.bandwidth_bytes_per_s == pytest.approx(4_000_000 / 0.002)  # wire bytes per rank / transfer
    assert grads.wire_bytes_per_rank == 4_000_000 and grads.slowest_rank == 3
    assert (grads.p50_s, grads.max_s, grads.wait_p50_s, grads.wait_max_s) == pytest.approx((0.02, 0.05, 0.005, 0.03))

    time_fig = collective_figures.collective_time_figure(stats)
    assert [t.name for t in time_fig.data] == ["p50 per step", "max (slowest rank)"]
    assert list(time_fig.data[1].y) == [0.05, 0.05]
    wait_fig = collective_figures.collective_wait_figure(stats)
    assert [t.name for t in wait_fig.data] == ["transfer", "wait (p50 rank)", "transfer + wait (max rank)"]
    assert list(wait_fig.data[0].y) == [0.002, 0.001] and wait_fig.layout.barmode == "stack"
    assert list(wait_fig.data[2].y) == pytest.approx([0.032, 0.031])
    bw = collective_figures.collective_bandwidth_figure(stats)
    assert list(bw.data[0].y) == pytest.approx([2.0, 0.5])  # GB/s per rank

    bits = collective_figures.bits_per_element_figure(coll)
    assert {t.name: list(t.y) for t in bits.data} == {"grads": [32.0] * 5, "weights": [4.0] * 5}


def test_bits_per_parameter_sum_the_ops_of_a_tag_and_skip_steps_without_elements() -> None:
    coll = js.collectives(
        "job",
        js.collective("reduce_scatter", "grads", range(2), wire_per_rank=1000, elements_per_rank=1000),
        js.collective("all_gather", "grads", range(2), wire_per_rank=3000, elements_per_rank=0),
        js.collective("broadcast", "meta", range(2), wire_per_rank=8, elements_per_rank=0),
    )
    assert collective_figures.bits_per_element_by_tag(coll) == {"grads": ([0, 1], [32.0, 32.0])}


def test_incident_timeline_puts_each_phase_at_its_time() -> None:
    inc = js.incident(3)
    phases = {"fault": js.T0, "detected": js.T0 + timedelta(seconds=16), "acted": js.T0 + timedelta(seconds=18)}
    fig = recovery_figures.incident_timeline_figure([(inc, phases)])
    by = {t.name: t for t in fig.data if t.name}
    assert list(by) == ["fault", "detected", "acted", "recovered"]
    assert list(by["detected"].x) == [phases["detected"]] and list(by["detected"].y) == ["#3 hang"]
    assert list(by["recovered"].x) == []  # not reached


def test_checkpoint_figure_valid_invalid_and_restores() -> None:
    ckpts = [js.checkpoint(1, 20), js.checkpoint(2, 40, valid=False, size=1_000_000)]
    fig = recovery_figures.checkpoint_figure(ckpts, [(js.marker("restart", 45), ckpts[0])])
    valid, invalid = fig.data
    assert (valid.name, list(valid.x), list(valid.y)) == ("valid", [20], [2.5])
    assert (invalid.name, list(invalid.x), list(invalid.y)) == ("invalid", [40], [1.0])
    assert [s.x0 for s in fig.layout.shapes] == [45]
    assert "restart: restored step 20" in _annotations(fig)


def test_goodput_bars_and_ettr() -> None:
    fig = recovery_figures.goodput_figure(js.goodput())
    (bars,) = fig.data
    assert list(bars.x)[:3] == ["productive", "lost: startup", "lost: restart"]
    assert list(bars.y)[:3] == [150.0, 10.0, 20.0]
    assert "ETTR 0.750" in fig.layout.title.text


def test_a_10000_rank_job_stays_small_and_readable() -> None:
    """Aggregates and top-k only: a handful of traces and well under 1 MB whatever the number of ranks."""
    ov = js.overview(steps=range(200), ranks=10_000, slow=9_999,
                     markers=[js.marker("checkpoint", s) for s in range(0, 200, 20)])
    hm = js.heatmap(ranks=10_000, steps=200, per_bin=79, slow=9_999)
    built = [training_figures.overview_loss_figure(ov), training_figures.overview_throughput_figure(ov),
             rank_figures.step_time_bands_figure(ov), rank_figures.binned_heatmap_figure(hm, [9_999])]
    assert [len(f.data) for f in built] == [2 + len(MARKER_KINDS), 2, 3, 1]
    assert len(built[3].data[0].y) == 127
    size = sum(len(f.to_json()) for f in built)
    assert size < 1_000_000, size
