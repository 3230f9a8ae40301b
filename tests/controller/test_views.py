"""The derived read views over HTTP: job overview, binned step-time heatmap, goodput, node host history.

The real controller (:mod:`tests.live_controller`: ``create_app`` on SQLite, auth on, served by uvicorn)
gets its data the way production does: jobs through the API, steps, collectives, checkpoints and
heartbeats as agents' telemetry batches, recovery through ``POST /jobs/{id}/recover`` and the monitor;
the aggregator runs one flush at a time, so each view is checked both while its steps are still forming
(computed from raw samples) and once they are aggregated. Only what no API can set is written to the
database directly: a job's start and end times, and a past hang incident (goodput's constructed
timeline). Expected values come from the definitions (nearest-rank percentiles, bin edges, the
goodput rules), worked out here by hand. The goodput rules are also checked one cause at a time on
the pure function. One overview and heatmap case runs on PostgreSQL, and one reads aggregates written
before migration 0006.

Needs: loopback networking; PostgreSQL on 127.0.0.1:5432 for the postgresql cases (skipped without).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert

from controller import migrate, step_read
from controller.db import make_engine
from controller.models import Job, JobStepStat, RankStepStat
from tests.controller.views_rig import (
    API,
    flush,
    heartbeat,
    nearest_rank,
    post_steps,
    running_job,
    viewer,
)
from tests.live_controller import LiveController, checkpoint_path, step_sample
from vigil.contract.client import ApiError
from vigil.contract.schemas import (
    CheckpointSample,
    CollectiveSample,
    RecoverRequest,
    Role,
)

# --------------------------------------------------------------------------------------------------
# Overview
# --------------------------------------------------------------------------------------------------


def test_overview_figures_are_exact_forming_and_aggregated(any_lc: LiveController) -> None:
    lc = any_lc
    job = running_job(lc)
    t0 = time.time() - 100
    # Step 1: 10 ranks with step times 0.1 .. 1.0 (rank r: 0.1 * (10 - r)), the max twice (ranks 0 and 3),
    # losses with one missing (not finite), validation loss on two ranks, and one collective per rank.
    times = {r: round(0.1 * (10 - r), 3) for r in range(10)}
    times[3] = 1.0
    samples = []
    for r in range(10):
        samples.append(step_sample(job, r, 1, ts=t0 + 1 + r / 100, step_time_s=times[r], loss=None if r == 7 else 2.0 + r,
                                   tokens_per_s=100.0 + r, val_loss=3.0 + r if r in (2, 5) else None))
        samples.append(CollectiveSample(job_id=job, rank=r, step=1, seq=0, op="all_reduce", payload_bytes=100,
                                        wire_bytes=1000 + r, duration_s=0.01, ts=t0 + 1))
    # Step 2: no finite loss at all; 4 ranks only.
    samples += [step_sample(job, r, 2, ts=t0 + 2, step_time_s=0.2 + r / 10, loss=None) for r in range(4)]
    lc.post_batch("n1", samples)
    want_step1 = {
        "loss": sum(2.0 + r for r in range(10) if r != 7) / 9, "val_loss": (5.0 + 8.0) / 2,
        "tokens_per_s": sum(100.0 + r for r in range(10)),
        "step_time_p50_s": nearest_rank(list(times.values()), 50), "step_time_p90_s": nearest_rank(list(times.values()), 90),
        "step_time_max_s": 1.0, "slowest_rank": 0, "reporting": 10, "wire_bytes": sum(1000 + r for r in range(10)),
    }
    assert want_step1["step_time_p50_s"] == 0.5 and want_step1["step_time_p90_s"] == 1.0  # 9th of 10: 1.0 (twice)
    for aggregated in (False, True):
        if aggregated:
            flush(lc)
        with viewer(lc) as c:
            ov = c.job_overview(job)
        assert ov.step == [1, 2] and ov.final == [aggregated, aggregated] and ov.last_step == 2, aggregated
        for key, want in want_step1.items():
            assert getattr(ov, key)[0] == pytest.approx(want), (key, aggregated)
        assert ov.loss[1] is None and ov.val_loss[1] is None and ov.reporting[1] == 4 and ov.slowest_rank[1] == 3
        assert ov.step_time_p50_s[1] == pytest.approx(0.3) and ov.step_time_p90_s[1] == pytest.approx(0.5)
        assert ov.ts[0] == pytest.approx(t0 + 1.09) and ov.ranks == 10


def test_overview_since_step_and_decimation_keep_the_spike(live_controller: LiveController) -> None:
    lc = live_controller
    job = running_job(lc)
    t0 = time.time() - 1000
    rows = [(r, s, t0 + s, 5.0 if (s, r) == (137, 1) else 0.1 + r / 100) for s in range(300) for r in range(2)]
    post_steps(lc, job, rows)
    flush(lc)
    with viewer(lc) as c:
        full = c.job_overview(job)
        assert full.step == list(range(300)) and full.last_step == 299
        small = c.job_overview(job, max_points=20)
        assert len(small.step) <= 20 and small.step[0] == 0 and small.step[-1] == 299
        assert 137 in small.step and max(small.step_time_max_s) == 5.0
        assert small.slowest_rank[small.step.index(137)] == 1
        assert small.last_step == 299  # the last step survives decimation
        newer = c.job_overview(job, since_step=250)
        assert newer.step == list(range(250, 300)) and newer.last_step == 299
        none = c.job_overview(job, since_step=300)
        assert none.step == [] and none.last_step is None
        # since_step limits the steps, never the slowest ranks (the job's last rank_window steps).
        assert [r.rank for r in none.slowest_ranks] == [1, 0] and none.ranks == 2


def test_overview_stops_before_a_forming_step_it_cannot_show(live_controller: LiveController,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the newest forming steps are computed from raw samples: an older one without an aggregate
    ends the answer just before it, so a client asking from last_step + 1 gets it later, never skips it."""
    monkeypatch.setattr(step_read, "MAX_FORMING_STEPS", 4)
    lc = live_controller
    job = running_job(lc)
    t0 = time.time() - 100
    post_steps(lc, job, [(0, s, t0 + s, 0.1) for s in range(5)])
    flush(lc)
    post_steps(lc, job, [(0, s, t0 + s, 0.1) for s in range(5, 15)])  # 10 forming steps: 11..14 computed
    post_steps(lc, job, [(1, 2, t0 + 2, 0.7)], node="n2")  # a late sample: step 2 forming again, aggregated before
    with viewer(lc) as c:
        ov = c.job_overview(job)
        assert ov.step == [0, 1, 2, 3, 4] and ov.last_step == 4
        assert ov.final == [True, True, False, True, True] and ov.step_time_max_s[2] == 0.1  # its aggregate, for now
        assert c.job_overview(job, since_step=5).step == []
        flush(lc)
        ov = c.job_overview(job)
        assert ov.step == list(range(15)) and all(ov.final) and ov.step_time_max_s[2] == 0.7


def test_rerun_step_keeps_its_latest_attempt(live_controller: LiveController) -> None:
    lc = live_controller
    job = running_job(lc)
    t0 = time.time() - 100
    post_steps(lc, job, [(r, s, t0 + s, 0.5) for s in range(1, 7) for r in range(2)])
    flush(lc)
    # A restart from the checkpoint of step 3 (the ranks' next run attempt): steps 4..6 again, later and slower.
    post_steps(lc, job, [(r, s, t0 + 20 + s, 0.9 + r / 10) for s in range(4, 7) for r in range(2)], attempt=1)
    for aggregated in (False, True):
        if aggregated:
            flush(lc)
        with viewer(lc) as c:
            ov = c.job_overview(job)
        assert ov.step == [1, 2, 3, 4, 5, 6], aggregated
        assert ov.step_time_max_s == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0, 1.0]), aggregated
        assert ov.ts[3:] == pytest.approx([t0 + 24, t0 + 25, t0 + 26]) and ov.reporting == [2] * 6
        assert ov.final == [True, True, True, aggregated, aggregated, aggregated]
        restarts = [m for m in ov.markers if m.kind == "restart"]
        assert [(m.step, m.ts) for m in restarts] == [(4, pytest.approx(t0 + 24 - 1.0))], aggregated


def test_slowest_ranks_top_k_over_the_rank_window(live_controller: LiveController) -> None:
    lc = live_controller
    job = running_job(lc)
    t0 = time.time() - 1000
    # 8 ranks (0-3 on n1, 4-7 on n2); rank r takes 0.1 + r/100 s, except rank 5: 0.3 s in the last 10 steps.
    def st(r: int, s: int) -> float:
        return 0.3 if r == 5 and s >= 50 else 0.1 + r / 100
    for node, ranks in (("n1", range(4)), ("n2", range(4, 8))):
        samples: list[Any] = []
        for s in range(60):
            for r in ranks:
                samples.append(step_sample(job, r, s, ts=t0 + s, step_time_s=st(r, s)))
                samples.append(CollectiveSample(job_id=job, rank=r, step=s, seq=0, op="all_reduce", payload_bytes=8,
                                                wire_bytes=8, duration_s=0.01 * (r + 1), ts=t0 + s))
        lc.post_batch(node, samples)
    flush(lc)
    with viewer(lc) as c:
        ov = c.job_overview(job, top_k=3, rank_window=10)
        assert ov.ranks == 8
        means = {r: st(r, 55) for r in range(8)}
        median = sorted(means.values())[(8 - 1) // 2]  # the lower middle of 8 means: rank 3's
        assert [s.rank for s in ov.slowest_ranks] == [5, 7, 6]
        five = ov.slowest_ranks[0]
        assert (five.node_id, five.steps) == ("n2", 10)
        assert five.step_time_mean_s == pytest.approx(0.3) and five.step_time_max_s == pytest.approx(0.3)
        assert five.vs_median == pytest.approx(0.3 / median)
        assert five.comm_wait_mean_s == pytest.approx(0.05)  # its duration minus the fastest rank's (rank 0)
        wide = c.job_overview(job, top_k=1, rank_window=60)
        mean5 = (50 * 0.15 + 10 * 0.3) / 60
        assert [(s.rank, s.steps) for s in wide.slowest_ranks] == [(5, 60)]
        assert wide.slowest_ranks[0].step_time_mean_s == pytest.approx(mean5)
        assert wide.slowest_ranks[0].vs_median == pytest.approx(mean5 / 0.13)


def test_markers_at_their_steps(live_controller: LiveController) -> None:
    """A checkpoint, a fault, an eviction, a manual recovery (incident) and the restart the monitor saw."""
    lc = live_controller
    job = running_job(lc)
    t0 = time.time() - 11  # the last step just ended: no hang to detect
    lc.heartbeat("n1", ranks=[(job, 0, 4242)])
    post_steps(lc, job, [(0, s, t0 + s, 0.5) for s in range(1, 11)], node="n1")
    post_steps(lc, job, [(1, s, t0 + s, 0.5) for s in range(1, 11)], node="n2")  # n2: no heartbeat lists ranks
    lc.post_batch("n1", [CheckpointSample(job_id=job, step=5, ts=t0 + 5.2, path=checkpoint_path(lc.app, job, 5))])
    lc.post_batch("n9", [])  # a node that never ran the job
    flush(lc)
    fault = lc.inject_fault(job, "kill_rank", rank=0, step=3, params={"mode": "agent"})
    lc.monitor_pass()  # fires the fault (the job is at step 10)
    with lc.client() as admin:
        admin.evict_node("n2")
        admin.evict_node("n9")
        inc = admin.recover_job(job, RecoverRequest(reason="views test"))
    # The ranks come back from the checkpoint of step 5: step 6 again, then 7 and 8.
    t1 = time.time() + 1
    for node, rank in (("n1", 0), ("n2", 1)):
        post_steps(lc, job, [(rank, s, t1 + s - 6, 0.5) for s in range(6, 9)], node=node, attempt=1)
    lc.monitor_pass()  # sees the restart: the incident is recovered, a restart counted
    with viewer(lc) as c:
        checkpoint_id = c.job_checkpoints(job).data[0].id
        for aggregated in (False, True):
            if aggregated:
                flush(lc)
            markers = c.job_overview(job).markers
            got = sorted((m.kind, m.step, m.ref) for m in markers)
            assert got == sorted([
                ("checkpoint", 5, str(checkpoint_id)), ("fault", 10, str(fault.id)),
                ("eviction", 10, "n2"), ("incident", 10, str(inc.id)), ("restart", 6, str(inc.id)),
            ]), (aggregated, got)
            by_kind = {m.kind: m for m in markers}
            assert by_kind["checkpoint"].ts == pytest.approx(t0 + 5.2) and "step 5" in by_kind["checkpoint"].label
            assert "manual" in by_kind["incident"].label and "restart 1" in by_kind["restart"].label
            assert by_kind["restart"].ts == pytest.approx(t1)  # recovered_at: rank 0's first step after it
            assert [m.ts for m in markers] == sorted(m.ts for m in markers)


def test_a_fault_the_rank_fires_itself_is_marked_at_its_own_step(live_controller: LiveController) -> None:
    """nan_loss is armed at once (a fault file) and hits at its step: the marker goes there, not at the
    step the job had reached when it was armed."""
    lc = live_controller
    job = running_job(lc)
    t0 = time.time() - 11
    lc.heartbeat("n1", ranks=[(job, 0, 4242)])
    post_steps(lc, job, [(0, s, t0 + s, 0.5) for s in range(1, 11)], node="n1")
    fault = lc.inject_fault(job, "nan_loss", rank=0, step=40)
    lc.monitor_pass()  # arms it: the fault file goes to the rank's node now
    with viewer(lc) as c:
        faults = [(m.step, m.ref) for m in c.job_overview(job).markers if m.kind == "fault"]
    assert faults == [(40, str(fault.id))]


# --------------------------------------------------------------------------------------------------
# Heatmap
# --------------------------------------------------------------------------------------------------


def test_heatmap_bins_ten_ranks_into_four_rows(any_lc: LiveController) -> None:
    lc = any_lc
    job = running_job(lc)
    t0 = time.time() - 100
    def st(r: int, s: int) -> float:
        return 9.0 if (r, s) == (4, 12) else r / 100 + s / 1000
    # Ranks 0..9, steps 10..16; rank 9 reports no step of 13..15; step 16 is re-run by rank 0 (faster).
    rows = [(r, s, t0 + s, st(r, s)) for s in range(10, 17) for r in range(10) if not (r == 9 and 13 <= s <= 15)]
    post_steps(lc, job, rows)
    post_steps(lc, job, [(0, 16, t0 + 30, 0.001)], attempt=1)
    for aggregated in (False, True):
        if aggregated:
            flush(lc)
        with viewer(lc) as c:
            hm = c.job_heatmap(job, max_ranks=4, max_steps=3)
            assert (hm.rank_lo, hm.rank_hi) == ([0, 3, 6, 9], [2, 5, 8, 9]), aggregated
            assert (hm.step_lo, hm.step_hi) == ([10, 13, 16], [12, 15, 16])
            def cell(r_lo: int, r_hi: int, s_lo: int, s_hi: int) -> float | None:
                vals = [st(r, s) for r, s, *_ in ((r, s) for s in range(s_lo, s_hi + 1) for r in range(r_lo, r_hi + 1))
                        if not (r == 9 and 13 <= s <= 15) and not (r == 0 and s == 16)]
                if r_lo == 0 and s_hi == 16:
                    vals.append(0.001)  # rank 0's latest attempt of step 16
                return max(vals) if vals else None
            want = [[cell(rl, rh, sl, sh) for sl, sh in zip(hm.step_lo, hm.step_hi, strict=True)]
                    for rl, rh in zip(hm.rank_lo, hm.rank_hi, strict=True)]
            assert hm.z == [[pytest.approx(v) if v is not None else None for v in row] for row in want]
            assert hm.z[1][0] == 9.0 and hm.z[3][1] is None  # the straggler survives; no data is None
            assert hm.z[0][2] == pytest.approx(0.02 + 0.016)  # rank 0's re-run (0.001) replaced its 0.016
            full = c.job_heatmap(job)
            assert (full.rank_lo, full.rank_hi, full.step_lo) == (list(range(10)), list(range(10)), list(range(10, 17)))
            assert full.z[4][2] == 9.0 and full.z[9][3] is None and full.z[0][6] == pytest.approx(0.001)
            later = c.job_heatmap(job, since_step=14, max_ranks=4, max_steps=3)
            assert (later.step_lo, later.step_hi) == ([14, 15, 16], [14, 15, 16])
            assert c.job_heatmap(job, since_step=3).step_lo[0] == 10  # no empty columns before the first step
            assert c.job_heatmap(job, since_step=17).z == []


def test_heatmap_of_a_job_without_steps_is_empty(live_controller: LiveController) -> None:
    job = running_job(live_controller)
    with viewer(live_controller) as c:
        hm = c.job_heatmap(job)
        assert (hm.rank_lo, hm.step_lo, hm.z) == ([], [], [])
        ov = c.job_overview(job)
        assert (ov.step, ov.slowest_ranks, ov.last_step, ov.ranks) == ([], [], None, 0)

# --------------------------------------------------------------------------------------------------
# Bad input, unknown ids
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "params", "field"), [
    ("overview", {"top_k": 0}, "top_k"), ("overview", {"top_k": 101}, "top_k"),
    ("overview", {"rank_window": 10_001}, "rank_window"), ("overview", {"max_points": 9}, "max_points"),
    ("overview", {"since_step": -1}, "since_step"), ("heatmap", {"max_ranks": 1025}, "max_ranks"),
    ("heatmap", {"max_steps": 0}, "max_steps"), ("heatmap", {"max_steps": 2001}, "max_steps"),
])
def test_bad_parameters_are_422_naming_the_field(live_controller: LiveController, route: str,
                                                 params: dict[str, int], field: str) -> None:
    job = running_job(live_controller)
    r = httpx.get(f"{live_controller.url}{API}/jobs/{job}/{route}", params=params,
                  headers={"Authorization": f"Bearer {live_controller.token(Role.VIEWER)}"})
    assert r.status_code == 422 and [e["loc"] for e in r.json()["detail"]] == [["query", field]], r.text


def test_unknown_job_or_node_is_404_naming_it(live_controller: LiveController) -> None:
    lc = live_controller
    heartbeat(lc, "n1", time.time(), {})
    with viewer(lc) as c:
        for call in (lambda: c.job_overview("job_nope"), lambda: c.job_heatmap("job_nope"),
                     lambda: c.job_goodput("job_nope")):
            with pytest.raises(ApiError) as err:
                call()
            assert err.value.status_code == 404 and "job_nope" in str(err.value.detail)
        with pytest.raises(ApiError) as err:
            c.node_history("n-nope")
        assert err.value.status_code == 404 and "n-nope" in str(err.value.detail)
        for params, field in (({"since_ts": -1}, "since_ts"), ({"max_points": 5}, "max_points")):
            with pytest.raises(ApiError) as err:
                c.node_history("n1", **params)
            assert err.value.status_code == 422 and err.value.detail[0]["loc"] == ["query", field]


# --------------------------------------------------------------------------------------------------
# Aggregates written before migration 0006
# --------------------------------------------------------------------------------------------------


def test_overview_reads_aggregates_from_before_the_new_columns(db_url: str, tmp_path: Path) -> None:
    """A database at 0005 with aggregates is upgraded; its steps show, their figures from the rank rows."""
    migrate.upgrade(db_url, "0005_agent_token_node")
    engine = make_engine(db_url)
    t0 = time.time() - 100
    try:
        with engine.begin() as conn:
            conn.execute(insert(Job.__table__).values(id="job_old", name="old", status="SUCCEEDED", spec={"name": "old"},
                                                      created_at=datetime.now(UTC), restarts=0, stalled_restarts=0))
            for step in (1, 2):
                conn.execute(insert(JobStepStat.__table__).values(
                    job_id="job_old", step=step, ts=t0 + step, ranks=3, loss_mean=1.5, step_time_p50_s=0.2,
                    step_time_max_s=0.3, slowest_rank=2, collectives=0, payload_bytes=0, wire_bytes=7))
                for rank in range(3):
                    conn.execute(insert(RankStepStat.__table__).values(
                        job_id="job_old", step=step, rank=rank, node_id="n1", ts=t0 + step, loss=1.5,
                        tokens_per_s=10.0, step_time_s=0.1 * (rank + 1), collectives=0, payload_bytes=0, wire_bytes=0))
    finally:
        engine.dispose()
    with LiveController(tmp_path / "c", database_url=db_url) as lc, viewer(lc) as c:  # upgrades to head
        ov = c.job_overview("job_old")
        assert ov.step == [1, 2] and ov.reporting == [3, 3] and ov.tokens_per_s == [30.0, 30.0]
        assert ov.step_time_p50_s == pytest.approx([0.2, 0.2]) and ov.step_time_p90_s == pytest.approx([0.3, 0.3])
        assert ov.slowest_rank == [2, 2] and ov.wire_bytes == [7, 7] and ov.final == [True, True]
        hm = c.job_heatmap("job_old")
        assert hm.z == [[pytest.approx(0.1)] * 2, [pytest.approx(0.2)] * 2, [pytest.approx(0.3)] * 2]


def test_a_recorded_restart_inside_its_rerun_steps_is_one_restart_not_two() -> None:
    """The monitor's restart is placed by its time (recovered_at), which can fall one step into the
    re-run steps it caused; the re-run itself must then add no second restart marker."""
    from controller.view_markers import rerun_runs, snap_to_run, uncovered_runs

    assert uncovered_runs({21, 22, 23}, covered={22}) == []
    assert uncovered_runs({21, 22, 23}, covered={20}) == []  # placed on the step just before
    assert uncovered_runs({21, 22, 23}, covered=set()) == [21]
    assert uncovered_runs({21, 22, 23, 40, 41}, covered={22}) == [40]
    assert uncovered_runs({21, 22, 23}, covered={30}) == [21]
    # ... and the recorded restart is drawn at the first re-run step.
    runs = rerun_runs({21, 22, 23, 40, 41})
    assert runs == [[21, 22, 23], [40, 41]]
    assert [snap_to_run(s, runs) for s in (20, 22, 23, 30, 41)] == [21, 21, 21, 30, 40]
