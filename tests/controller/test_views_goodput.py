"""Goodput (the pure rules one cause at a time, and the endpoint on a constructed timeline) and a node's host
history, over HTTP on the real controller (tests/live_controller.py), as test_views.py does for the overview."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, select, update

from controller.db import session_scope
from controller.goodput import StepRun, Timeline, goodput_from
from controller.host_history import HOST_FIELDS, extract
from controller.models import Incident, Job, NodeHostSample
from controller.step_stats import attempt_spans
from tests.controller.views_rig import flush, heartbeat, post_steps, running_job, set_job_times, viewer
from tests.live_controller import LiveController, checkpoint_path
from vigil.contract.schemas import (
    LOST_CAUSES,
    CheckpointSample,
    Heartbeat,
    JobStatus,
    Role,
    TelemetryBatch,
)

# --------------------------------------------------------------------------------------------------
# Goodput: the pure rules, one cause at a time
# --------------------------------------------------------------------------------------------------


def check_invariant(g: Any) -> None:
    assert set(g.lost_s) == set(LOST_CAUSES)
    assert g.productive_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s, abs=1e-9)
    assert all(v >= -1e-12 for v in g.lost_s.values()), g.lost_s


def runs(*spans: tuple[int, float, float]) -> list[StepRun]:
    return [StepRun(step, start, end) for step, start, end in spans]


def lost(g: Any) -> dict[str, float]:
    return {k: round(v, 9) for k, v in g.lost_s.items() if v}


def test_goodput_before_the_start_and_a_clean_run() -> None:
    g = goodput_from("j", Timeline(started=None, ended=100.0, steps=runs((1, 10.0, 11.0))))
    assert (g.wall_s, g.productive_s, g.ettr) == (0.0, 0.0, None) and set(g.lost_s.values()) == {0.0}
    # Start at 0, steps of 1 s from 2 s with 0.1 s between them, end at 12.
    steps = runs(*[(k, 2 + 1.1 * (k - 1), 3 + 1.1 * (k - 1)) for k in range(1, 10)])
    g = goodput_from("j", Timeline(started=0.0, ended=12.0, steps=steps))
    check_invariant(g)
    assert g.productive_s == pytest.approx(9.0) and g.ettr == pytest.approx(9.0 / 12.0)
    end = 3 + 1.1 * 8
    assert lost(g) == {"startup": 2.0, "other": pytest.approx(8 * 0.1 + (12 - end))}
    assert (g.restarts, g.steps_rerun) == (0, 0)


def test_goodput_checkpoint_gap_and_a_checkpoint_before_a_restart() -> None:
    steps = runs((1, 0.0, 1.0), (2, 1.0, 2.0), (3, 4.0, 5.0), (4, 5.0, 6.0), (5, 20.0, 21.0))
    # Checkpoint of step 2 (done at 3.5): the gap 2..4 is all checkpoint (no restart in it). Checkpoint of
    # step 4 done at 7, then Vigil acted at 9 and the job ran step 5 at 20: 6..7 checkpoint, 7..20 restart.
    tl = Timeline(started=0.0, ended=21.0, steps=steps, checkpoints={2: [3.5], 4: [7.0]}, acted=[9.0], restarts=1)
    g = goodput_from("j", tl)
    check_invariant(g)
    assert lost(g) == {"checkpoint": 3.0, "restart": 13.0} and g.productive_s == 5.0 and g.restarts == 1


def test_goodput_restart_after_a_drain_is_placed_by_recovered_at() -> None:
    # Vigil drained a node during step 3 (acted at 3.5); the ranks checkpointed step 3 (done at 4.5) and
    # resumed at step 4 (10..11) without re-running anything: the monitor saw the restart end at 11.
    steps = runs((1, 0.0, 2.0), (2, 2.0, 3.0), (3, 3.0, 4.0), (4, 10.0, 11.0))
    tl = Timeline(started=0.0, ended=11.0, steps=steps, checkpoints={3: [4.5]}, acted=[3.5], recovered=[11.0])
    g = goodput_from("j", tl)
    check_invariant(g)
    assert lost(g) == {"checkpoint": 0.5, "restart": 5.5} and g.restarts == 1


def test_goodput_hang_restart_and_lost_steps() -> None:
    # Steps 1-4 kept; 5-8 ran 7..11 and were thrown away: a hang was detected at 20, Vigil acted at 21,
    # the ranks re-ran 5-9 from 30 (the monitor saw step 5 end at 31).
    steps = runs((1, 2.0, 3.0), (2, 3.0, 4.0), (3, 4.0, 5.0), (4, 5.0, 6.0))
    steps += [StepRun(k, 25.0 + k, 26.0 + k, ((2.0 + k, 3.0 + k),)) for k in range(5, 9)] + runs((9, 34.0, 35.0))
    tl = Timeline(started=0.0, ended=40.0, steps=steps, checkpoints={4: [6.8]}, hangs=[20.0], acted=[21.0],
                  recovered=[31.0], restarts=1)
    g = goodput_from("j", tl)
    check_invariant(g)
    assert g.productive_s == pytest.approx(9.0) and g.ettr == pytest.approx(9.0 / 40.0)
    assert lost(g) == {"startup": 2.0, "checkpoint": 1.0, "lost_steps": 4.0, "hang": 9.0, "restart": 10.0,
                       "other": 5.0}
    assert (g.restarts, g.steps_rerun) == (1, 4)


def test_goodput_restart_seen_only_in_the_steps_and_one_under_way() -> None:
    # Ray restarted on its own (no incident): step 3 ran again after step 4 -> the gap is a restart.
    steps = [StepRun(1, 0.0, 1.0), StepRun(2, 1.0, 2.0), StepRun(3, 10.0, 11.0, ((2.0, 3.0),)), StepRun(4, 11.0, 12.0)]
    # ... but step 4's latest attempt is that of the first run (3..4): the run re-running step 3 has not
    # reached it yet, so it is rolled back (lost), and the restart is under way.
    steps[3] = StepRun(4, 3.0, 4.0)
    g = goodput_from("j", Timeline(started=0.0, ended=15.0, steps=steps))
    check_invariant(g)
    assert g.productive_s == pytest.approx(3.0)  # steps 1, 2 and step 3's second attempt
    assert lost(g) == {"lost_steps": 2.0, "restart": 6.0, "other": 4.0}
    assert (g.restarts, g.steps_rerun) == (1, 1)


def test_goodput_restart_before_the_first_step_and_gaps_inside_a_lost_run() -> None:
    # Vigil acted at 3 before any step; the ranks ran steps from 5. A lost run 10..12 with a 0.5 s pause.
    steps = [StepRun(1, 5.0, 6.0), StepRun(2, 20.0, 21.0, ((10.0, 11.0),)), StepRun(3, 21.0, 22.0, ((11.5, 12.0),))]
    g = goodput_from("j", Timeline(started=0.0, ended=22.0, steps=steps, acted=[3.0], restarts=1))
    check_invariant(g)
    assert lost(g) == {"startup": 3.0, "restart": 2.0 + 8.0, "lost_steps": 1.5 + 0.5, "other": 4.0}
    assert g.restarts == 2  # two gaps held a restart; the job's counter said 1
    assert goodput_from("j", Timeline(started=0.0, ended=22.0, steps=steps, acted=[3.0], restarts=5)).restarts == 5


def test_attempt_spans_split_kept_and_earlier_attempts() -> None:
    # Ranks 0, 1 ran a step at 10..11; rank 1 again at 20..21, rank 0 at 20.2..21.2; rank 2 (evicted) only first.
    start, reruns = attempt_spans([(0, 11.0, 1.0), (1, 11.0, 1.0), (2, 11.1, 1.0), (1, 21.0, 1.0), (0, 21.2, 1.0)])
    assert start == 20.0 and reruns == [[10.0, 11.1]]
    assert attempt_spans([(0, 5.0, 1.0)]) == (4.0, None)
    assert attempt_spans([]) == (None, None)


# --------------------------------------------------------------------------------------------------
# Goodput over HTTP: a constructed timeline, forming and aggregated
# --------------------------------------------------------------------------------------------------


def test_goodput_endpoint_on_a_constructed_timeline(live_controller: LiveController) -> None:
    lc = live_controller
    job = lc.submit_job("goodput", steps=100).id
    with viewer(lc) as c:
        g = c.job_goodput(job)
    assert g.ettr is None and g.wall_s == 0.0  # not started
    lc.set_job_status(job, JobStatus.RUNNING)
    T = time.time() - 100
    # The timeline of test_goodput_hang_restart_and_lost_steps, in real samples of two ranks.
    rows = [(r, k, T + 2 + k, 1.0) for k in range(1, 5) for r in range(2)]
    rows += [(r, k, T + 3 + k, 1.0) for k in range(5, 9) for r in range(2)]
    post_steps(lc, job, rows)
    lc.post_batch("n1", [CheckpointSample(job_id=job, step=4, ts=T + 6.8, path=checkpoint_path(lc.app, job, 4))])
    flush(lc)
    post_steps(lc, job, [(r, k, T + 26 + k, 1.0) for k in range(5, 10) for r in range(2)], attempt=1)
    set_job_times(lc, job, started=T, finished=T + 40)
    dt = lambda t: datetime.fromtimestamp(T + t, UTC)
    with session_scope(lc.app.state.sessions) as s:
        s.execute(insert(Incident).values(job_id=job, kind="hang", status="RECOVERED", evidence={}, step_at_detect=8,
                                          detected_at=dt(20), acted_at=dt(21), recovered_at=dt(31)))
        s.execute(update(Job).where(Job.id == job).values(restarts=1))
    for aggregated in (False, True):
        if aggregated:
            flush(lc)
        with viewer(lc) as c:
            g = c.job_goodput(job)
        check_invariant(g)
        assert g.wall_s == pytest.approx(40.0)
        assert g.productive_s == pytest.approx(9.0) and g.ettr == pytest.approx(9.0 / 40.0)
        assert {k: pytest.approx(v) for k, v in lost(g).items()} == {
            "startup": 2.0, "checkpoint": 1.0, "lost_steps": 4.0, "hang": 9.0, "restart": 10.0, "other": 5.0}
        assert (g.restarts, g.steps_rerun) == (1, 4), aggregated


def test_goodput_of_a_running_job_counts_until_now(live_controller: LiveController) -> None:
    lc = live_controller
    job = running_job(lc)
    now = time.time()
    set_job_times(lc, job, started=now - 10)
    post_steps(lc, job, [(0, 1, now - 5, 1.0)])
    with viewer(lc) as c:
        g = c.job_goodput(job)
    check_invariant(g)
    assert 10.0 <= g.wall_s < 30.0 and g.productive_s == pytest.approx(1.0)
    assert g.lost_s["startup"] == pytest.approx(4.0) and g.lost_s["other"] == pytest.approx(g.wall_s - 5.0)


# --------------------------------------------------------------------------------------------------
# Node host history
# --------------------------------------------------------------------------------------------------

FULL_HOST = {
    "system": {"available": True, "cpu": {"available": True, "percent": 37.5},
               "memory": {"available": True, "percent": 61.0},
               "disk": {"/": {"available": True, "percent": 40.0}, "/data": {"available": True, "percent": 91.5},
                        "/gone": {"available": False, "reason": "no such path"}},
               "load": {"available": True, "1m": 3.25}},
    "nics": {"available": True, "interfaces": {
        "eth0": {"rx_bytes_per_s": 1000.0, "tx_bytes_per_s": 10.0, "rx_errors_per_s": 1.0, "tx_errors_per_s": 0.5,
                 "rx_dropped_per_s": 0.25, "tx_dropped_per_s": 0.0},
        "eth1": {"rx_bytes_per_s": 3000.0, "tx_bytes_per_s": None, "rx_errors_per_s": 2.0, "tx_errors_per_s": None,
                 "rx_dropped_per_s": None, "tx_dropped_per_s": None}}},
    "gpus": {"available": True, "count": 3, "devices": [
        {"index": 0, "available": True, "util_percent": 90, "memory_used_bytes": 4, "memory_total_bytes": 8},
        {"index": 1, "available": True, "util_percent": 30, "memory_used_bytes": 2, "memory_total_bytes": 8},
        {"index": 2, "available": False, "reason": "lost"}]},
}


def test_node_history_extracts_numbers_and_degrades(live_controller: LiveController) -> None:
    lc = live_controller
    t = time.time() - 1000
    heartbeat(lc, "n1", t, FULL_HOST)
    heartbeat(lc, "n1", t + 10, {"system": {"available": False, "reason": "psutil missing"},
                                 "gpus": {"available": False, "reason": "no GPU on this node"}})
    heartbeat(lc, "n1", t + 20, {"system": {"available": True, "cpu": {"available": False, "reason": "x"},
                                            "memory": {"percent": "high"}, "disk": {}, "load": {"1m": None}},
                                 "nics": {"available": True, "interfaces": {"eth0": {"rx_bytes_per_s": None}}},
                                 "gpus": {"available": True, "devices": [{"util_percent": 50,
                                                                          "memory_used_bytes": 1,
                                                                          "memory_total_bytes": 0}]}})
    with viewer(lc) as c:
        h = c.node_history("n1")
    assert h.node_id == "n1" and h.ts == [t, t + 10, t + 20]
    assert h.cpu_percent == [37.5, None, None] and h.memory_percent == [61.0, None, None]
    assert h.disk_percent == [91.5, None, None] and h.load_1m == [3.25, None, None]
    assert h.rx_bytes_per_s == [4000.0, None, None] and h.tx_bytes_per_s == [10.0, None, None]
    assert h.nic_errors_per_s == [3.5, None, None] and h.nic_drops_per_s == [0.25, None, None]
    assert h.gpu_util_percent == [60.0, None, 50.0] and h.gpu_memory_percent == [pytest.approx(37.5), None, None]
    with viewer(lc) as c:
        assert c.node_history("n1", since_ts=t + 5).ts == [t + 10, t + 20]


def test_node_history_is_bounded_and_a_duplicate_batch_adds_nothing(tmp_path: Path) -> None:
    with LiveController(tmp_path / "c", host_history_interval_s=5.0, host_history_max_rows=10) as lc:
        t = time.time() - 1000
        heartbeat(lc, "n1", t, FULL_HOST)
        heartbeat(lc, "n1", t + 2, FULL_HOST)  # within 5 s of the last sample: not stored
        heartbeat(lc, "n1", t - 3, FULL_HOST)  # a replayed older heartbeat within 5 s: not stored either
        for i in range(1, 15):
            host = {"system": {"cpu": {"percent": 99.0 if i == 7 else float(i)}}}
            heartbeat(lc, "n1", t + 10 * i, host)
        heartbeat(lc, "n2", t, FULL_HOST)
        with session_scope(lc.app.state.sessions) as s:
            rows = s.scalars(select(NodeHostSample.ts).where(NodeHostSample.node_id == "n1")
                             .order_by(NodeHostSample.ts)).all()
            assert rows == [t + 10 * i for i in range(5, 15)]  # the newest 10 of 15
            assert s.scalar(select(func.count()).select_from(NodeHostSample)
                            .where(NodeHostSample.node_id == "n2")) == 1
        with viewer(lc) as c:
            h = c.node_history("n1", max_points=10)
            assert h.ts == rows
            # A replayed batch (same agent, same seq) is acknowledged and stores nothing.
            batch = TelemetryBatch(agent_id="agent-n1", node_id="n1", seq=0, sent_at=time.time(),
                                   heartbeat=Heartbeat(ts=t + 500, host=FULL_HOST))
        with lc.client(Role.AGENT) as agent:
            assert agent.post_telemetry(batch).duplicate is True
        with viewer(lc) as c:
            assert c.node_history("n1").ts == rows


def test_node_history_decimation_keeps_a_spike_in_any_measure(tmp_path: Path) -> None:
    with LiveController(tmp_path / "c", host_history_interval_s=0.0) as lc:
        t = time.time() - 1000
        for i in range(40):
            host = {"system": {"cpu": {"percent": 95.0 if i == 17 else 10.0}, "memory": {"percent": 20.0 + i}},
                    "nics": {"interfaces": {"eth0": {"rx_errors_per_s": 7.0 if i == 30 else 0.0}}}}
            heartbeat(lc, "n1", t + i, host)
        with viewer(lc) as c:
            h = c.node_history("n1", max_points=10)
        assert len(h.ts) <= 10 and h.ts[0] == t and h.ts[-1] == t + 39
        assert max(h.cpu_percent) == 95.0 and max(h.nic_errors_per_s) == 7.0  # type: ignore[type-var]
        assert h.memory_percent[-1] == 59.0 and h.ts == sorted(h.ts)


@pytest.mark.parametrize("host", [
    {}, {"system": [1, 2]}, {"system": {"cpu": 5, "disk": [{"percent": 10}], "load": {"1m": True}}},
    {"nics": {"interfaces": [{"rx_bytes_per_s": 1e308}, {"rx_bytes_per_s": 1e308}, "eth0"]}},
    {"gpus": {"devices": {"0": {"util_percent": 5}}}}, {"nics": "down", "gpus": None},
    {"system": {"memory": {"percent": 10**400}}},
])
def test_host_extraction_never_fails_on_odd_input(host: dict[str, Any]) -> None:
    """Whatever an agent sends, extraction gives numbers or None (a sum overflowing to inf is None)."""
    out = extract(host)
    assert set(out) == set(HOST_FIELDS)
    assert all(v is None or isinstance(v, float) and math.isfinite(v) for v in out.values()), out
    if "system" in host and isinstance(host["system"], dict) and "disk" in host["system"]:
        assert out["disk_percent"] == 10.0  # a list of disks is read like a mapping of them
