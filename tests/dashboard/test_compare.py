"""The compare page (``/compare``): loss against step, wall time and bits sent, one trace per job.

Unit tests of :mod:`dashboard.pages.compare.figures`' builders on :class:`JobOverviewPublic` objects (the
cumulative bits, the labels, the three figures), then the page in a real Chromium against the REAL
controller (``dashboard_site``), whose overview endpoint computes the per-step loss and wire bytes from
the steps and collective calls posted through ``POST /api/v1/telemetry``.

Needs: dash, plotly; for the browser test ``apt-get install -y chromium chromium-driver`` (skipped
without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

import time

from dashboard.pages.compare import figures as compare_views
from tests.dashboard.conftest import Site
from tests.dashboard.harness import Browser
from tests.dashboard.samples import make_job
from tests.live_controller import step_sample
from vigil.contract.schemas import CollectiveSample, JobOverviewPublic, JobStatus


def overview(job_id: str, steps: list[int], wire: list[int], loss: list[float | None] | None = None,
             t0: float = 1.7e9) -> JobOverviewPublic:
    n = len(steps)
    return JobOverviewPublic(
        job_id=job_id, ranks=2, step=steps, ts=[t0 + 2.0 * i for i in range(n)],
        loss=loss if loss is not None else [4.0 - 0.1 * i for i in range(n)], val_loss=[None] * n,
        tokens_per_s=[1000.0] * n, step_time_p50_s=[0.1] * n, step_time_p90_s=[0.1] * n,
        step_time_max_s=[0.1] * n, slowest_rank=[0] * n, reporting=[2] * n, wire_bytes=wire,
        slowest_ranks=[], markers=[], last_step=steps[-1] if steps else None,
    )


def test_cumulative_bits_and_elapsed_time() -> None:
    assert compare_views.cumulative_bits([0, 1, 2], [100, 100, 50]) == [800.0, 1600.0, 2000.0]
    # A thinned series: each point stands for the steps since the previous one.
    assert compare_views.cumulative_bits([0, 10, 20], [100, 100, 100]) == [800.0, 8800.0, 16800.0]
    assert compare_views.cumulative_bits([], []) == []
    assert compare_views.elapsed_s([100.0, 101.5, 104.0]) == [0.0, 1.5, 4.0]
    assert compare_views.elapsed_s([]) == []


def test_parse_job_ids() -> None:
    assert compare_views.parse_job_ids("a,b, a,,c ") == ["a", "b", "c"]
    assert compare_views.parse_job_ids(["x", "x", "y"]) == ["x", "y"]
    assert compare_views.parse_job_ids(None) == [] and compare_views.parse_job_ids("") == []
    assert len(compare_views.parse_job_ids(",".join(f"j{i}" for i in range(20)))) == compare_views.MAX_COMPARED_JOBS


def test_one_trace_per_job_in_each_figure_labelled_name_and_optimizer() -> None:
    dsm = make_job("job-1", "gpt-small", optimizer="dsm")
    adamw = make_job("job-2", "gpt-small", optimizer="adamw")
    pending = make_job("job-3", "later", JobStatus.PENDING, optimizer="adamw")
    traces = compare_views.compare_traces([
        (dsm, overview("job-1", [0, 1, 2], [1000, 1000, 1000], loss=[4.0, None, 3.0])),
        (adamw, overview("job-2", [0, 1], [8000, 8000], t0=1.8e9)),
        (pending, None),
    ])
    assert [t.label for t in traces] == ["gpt-small (dsm)", "gpt-small (adamw)", "later (adamw)"]
    step_fig, time_fig, bits_fig = compare_views.compare_figures(traces)
    for fig in (step_fig, time_fig, bits_fig):
        assert [t.name for t in fig.data] == ["gpt-small (dsm)", "gpt-small (adamw)"]  # no data, no trace
        assert list(fig.data[0].y) == [4.0, None, 3.0]  # a non-finite loss is a gap
        assert fig.data[0].line.color != fig.data[1].line.color
    assert [list(t.x) for t in step_fig.data] == [[0, 1, 2], [0, 1]]
    assert [list(t.x) for t in time_fig.data] == [[0.0, 2.0, 4.0], [0.0, 2.0]]  # each from its own start
    assert [list(t.x) for t in bits_fig.data] == [[8000.0, 16000.0, 24000.0], [64000.0, 128000.0]]
    assert [f.layout.title.text for f in (step_fig, time_fig, bits_fig)] == [
        "Loss vs step", "Loss vs wall time", "Loss vs bits sent"]
    assert bits_fig.layout.xaxis.tickformat == "~s"
    assert not bits_fig.layout.annotations


def test_clashing_labels_get_the_job_id_and_empty_states_say_why() -> None:
    a, b = make_job("job-a", "run", optimizer="dsm"), make_job("job-b", "run", optimizer="dsm")
    traces = compare_views.compare_traces([(a, overview("job-a", [0], [0])), (b, overview("job-b", [0], [0]))])
    assert [t.label for t in traces] == ["run (dsm) job-a", "run (dsm) job-b"]
    bits = compare_views.compare_figures(traces)[2]
    assert [a.text for a in bits.layout.annotations] == ["no collective traffic reported"]

    nothing = compare_views.compare_figures([])
    assert all(f.data == () for f in nothing)
    assert [a.text for a in nothing[0].layout.annotations] == ["pick jobs to compare"]
    waiting = compare_views.compare_figures(compare_views.compare_traces([(a, None)]))
    assert [a.text for a in waiting[1].layout.annotations] == ["waiting for data"]


# --------------------------------------------------------------------------------------------------
# In a real browser, against the real controller
# --------------------------------------------------------------------------------------------------

WIRE = 1000
"""Bytes each collective call below puts on the wire."""


def _collectives(job_id: str, rank: int, steps: range) -> list[CollectiveSample]:
    now = time.time()
    return [CollectiveSample(job_id=job_id, rank=rank, step=s, seq=0, op="all_reduce", payload_bytes=WIRE,
                             wire_bytes=WIRE, duration_s=0.01, ts=now - 60 + s) for s in steps]


def test_compare_page_from_the_url(page: Browser, dashboard_site: Site) -> None:
    ctl, abc = dashboard_site.controller, dashboard_site.demo.abc
    # The demo job's ranks 0 and 1 (node-1) each send 1000 wire bytes per step for its 20 steps.
    ctl.post_batch("node-1", [c for r in (0, 1) for c in _collectives(abc, r, range(20))])
    other = ctl.submit_job("cmp-adamw", steps=50, optimizer={"kind": "adamw"}).id
    t0 = time.time() - 30
    ctl.post_batch("node-1", [step_sample(other, 0, s, ts=t0 + 3 * s, loss=3.0 - 0.1 * s) for s in range(8)])
    ctl.settle()

    page.get(f"{dashboard_site.dashboard}compare?jobs={abc},{other}")

    def traces(graph_id: str) -> list[tuple[str, int]] | None:
        g = page.graph(graph_id)
        return [(t["name"], t["n"]) for t in g["traces"]] if g and len(g["traces"]) == 2 else None

    expected = [("pydoc-dsm (dsm)", 20), ("cmp-adamw (adamw)", 8)]
    page.wait_equal(lambda: traces("compare-loss-step"), expected, what="loss vs step traces")
    assert traces("compare-loss-time") == expected
    assert traces("compare-loss-bits") == expected
    bits = page.graph("compare-loss-bits")["traces"][0]["x"]
    assert bits[0] == 2 * WIRE * 8 and bits[-1] == 20 * 2 * WIRE * 8  # cumulative, both ranks
    times = page.graph("compare-loss-time")["traces"][1]["x"]
    assert times[0] == 0 and abs(times[-1] - 21.0) < 1e-6  # 3 s a step, from the job's first step
    link = page.css("#compare-link")[0].get_attribute("href")
    assert link == f"{dashboard_site.dashboard}compare?jobs={abc},{other}"

    # Unknown ids are named, the others still drawn (a fresh load: the page left first, its polling stopped).
    page.blank()
    page.get(f"{dashboard_site.dashboard}compare?jobs={abc},no-such-job")
    page.wait_for(lambda: "no-such-job: no such job" in (page.text("compare-error") or ""), what="unknown job")
    # ... and stay named over the next refreshes: the picker keeps the unknown id (disabled, saying why).
    # Dash's dropdown drops a value missing from its options, and the refresh that followed cleared the
    # error (seen in CI: named for a moment, gone by the time the test looked).
    refreshes = "return (window.__vigilDashRequests || []).filter(r => r.output.includes('compare-jobs.options')).length;"
    seen = page.js(refreshes)
    page.wait_for(lambda: page.js(refreshes) >= seen + 3, what="three more refreshes")
    assert "no-such-job: no such job" in (page.text("compare-error") or "")
    assert "no-such-job · no such job" in page.text("compare-jobs")
    page.wait_for(lambda: (g := page.graph("compare-loss-step")) and len(g["traces"]) == 1, what="one trace")
    assert page.console_errors() == []
