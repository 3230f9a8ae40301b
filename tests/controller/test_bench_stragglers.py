"""``vigil bench stragglers``' arithmetic on made-up runs (no cluster: the runs are what ``run_job`` returns).

The figures of one case: steps to detection from the fault's step, the culprit, the seconds lost reported
(the per-step sums from the fault's step on, as a user reads them live), the fault-free run's own sum (its
jitter) and the true cost (the faulty run's step durations minus the fault-free run's, step by step, a trimmed
mean times the steps; and the plain wall-time difference). The real run is in docs/BENCHMARKS.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ops.bench import stragglers
from ops.bench.stragglers import AT, STEPS, Bench


def _run(step_s: float, lost_per_step: float, incident: dict[str, Any] | None) -> dict[str, Any]:
    return {"job_id": "j", "status": "SUCCEEDED", "ts": {st: st * step_s for st in range(1, STEPS + 1)},
            "lost": {st: lost_per_step for st in range(1, STEPS + 1)}, "stragglers": [incident] if incident else []}


class Fake(Bench):
    def __init__(self, run: dict[str, Any]) -> None:
        super().__init__(SimpleNamespace(controller_url="http://127.0.0.1:9", admin_token="t"))
        self.run = run
        self.asked: list[dict[str, Any] | None] = []

    def run_job(self, name: str, steps: int, fault: dict[str, Any] | None) -> dict[str, Any]:
        self.asked.append(fault)
        return self.run


def test_one_case_is_measured_against_its_fault_free_run() -> None:
    inc = {"rank": 1, "step_at_detect": AT + 12, "evidence": {"class": "fail-slow"}}
    b = Fake(_run(0.13, 0.03, inc))
    got = b.case(1.3, "compute", False, _run(0.10, 0.002, None))
    assert b.asked == [{"kind": "slow_rank", "rank": 1, "step": AT, "params": {"factor": 1.3, "mode": "compute"}}]
    assert got["detected_after_steps"] == 12 and got["culprit_correct"] and got["class"] == "fail-slow"
    # The clean run's pace is 0.10 s throughout, the faulty one's 0.13 s throughout (a slower machine before
    # the fault too): relative to their own pace before the fault, the fault cost nothing; side by side, 0.03 s a step.
    assert got["seconds_lost_true_relative"] == pytest.approx(0.0, abs=1e-9)
    assert got["seconds_lost_true"] == pytest.approx((STEPS - AT) * 0.03)
    assert got["seconds_lost_true_wall"] == pytest.approx((STEPS - AT) * 0.03)
    assert got["seconds_lost_reported"] == pytest.approx((STEPS - AT) * 0.03)
    assert got["noise_floor_s"] == pytest.approx((STEPS - AT) * 0.002)


def test_never_found_and_the_wrong_rank_are_said_so() -> None:
    assert Fake(_run(0.1, 0.0, None)).case(1.15, "compute", True, _run(0.1, 0.0, None))["detected_after_steps"] is None
    wrong = Fake(_run(0.1, 0.0, {"rank": 0, "step_at_detect": AT + 3, "evidence": {}}))
    assert wrong.case(2.0, "compute", True, _run(0.1, 0.0, None))["culprit_correct"] is False


def test_a_comm_case_asks_for_the_comm_mode_and_reports_where_the_rank_was_slow() -> None:
    inc = {"rank": 1, "step_at_detect": AT + 40, "evidence": {"class": "fail-slow", "basis": "step", "phase": "other"}}
    b = Fake(_run(0.12, 0.02, inc))
    got = b.case(1.15, "comm", True, _run(0.10, 0.0, None))
    assert b.asked == [{"kind": "slow_rank", "rank": 1, "step": AT, "params": {"factor": 1.15, "mode": "comm"}}]
    assert (got["mode"], got["basis"], got["phase"], got["detected_after_steps"]) == ("comm", "step", "other", 40)


def test_the_true_cost_leaves_out_a_pause_that_hit_one_run_only() -> None:
    clean = {st: st * 0.1 for st in range(AT, STEPS + 1)}
    run = {st: st * 0.12 + (5.0 if st >= 150 else 0.0) for st in range(AT, STEPS + 1)}  # a 5 s checkpoint pause
    assert stragglers.paired_cost(run, clean, AT, STEPS) == pytest.approx((STEPS - AT) * 0.02)
    assert stragglers.paired_cost(run, {AT: 0.0}, AT, STEPS) is None  # a step missing: no figure


def test_the_true_cost_is_each_runs_change_of_pace_at_the_fault() -> None:
    # The faulty run is 10% slower than the clean one from the start (the machine then), 0.025 s a step slower
    # still from the fault on, and pauses 5 s once; the clean run slows by 0.005 s a step at the same point
    # (drift both runs share). The fault's own cost: 0.02 s a step.
    clean = {st: st * 0.1 + max(0, st - AT) * 0.005 for st in range(1, STEPS + 1)}
    run = {st: st * 0.11 + max(0, st - AT) * 0.025 + (5.0 if st >= 150 else 0.0) for st in range(1, STEPS + 1)}
    assert stragglers.relative_cost(run, clean) == pytest.approx((STEPS - AT) * 0.02)
    assert stragglers.relative_cost(run, {st: 0.0 for st in range(AT, STEPS + 1)}) is None


def test_the_cotenant_burns_a_cpu_only_while_asked() -> None:
    with stragglers.Cotenant(True) as c:
        assert c.proc is not None and c.proc.poll() is None
    assert c.proc.poll() is not None
    with stragglers.Cotenant(False) as off:
        assert off.proc is None
