"""``vigil bench recovery --policy live``'s readings of a job's steps (ops/bench/live_recovery.py),
on made-up step rows: ETTR at the job's own steady pace, a replaced rank's rejoin, a survivor's lost steps."""

from __future__ import annotations

import pytest

from ops.bench.live_recovery import Series


def _series(by_rank: dict[int, list[tuple[float, int]]]) -> Series:
    s = Series.__new__(Series)
    s.by_rank = {r: [(ts, st, 0.08) for ts, st in rows] for r, rows in by_rank.items()}
    return s


def test_ettr_counts_outages_not_the_steady_pace() -> None:
    # 200 steps 0.1 s apart with one 2.1 s outage after step 100: 2 s lost of 22.
    rows = [(st * 0.1 + (2.0 if st > 100 else 0.0), st) for st in range(1, 201)]
    e = _series({0: rows, 1: rows}).job_ettr()
    assert e["pace_s"] == pytest.approx(0.1)
    assert e["ettr"] == pytest.approx(200 * 0.1 / (19.9 + 2.0 + 0.1), abs=1e-3)
    assert e["replica_step_ratio"] == 1.0


def test_a_replaced_rank_rejoins_after_its_own_pause_and_the_survivor_lost_nothing() -> None:
    survivor = [(st * 0.1, st) for st in range(1, 101)]
    victim = [(st * 0.1, st) for st in range(1, 41)] + [(st * 0.1, st) for st in range(90, 101)]
    s = _series({0: survivor, 1: victim})
    assert s.rejoin(1, since=4.0) == pytest.approx(9.0)
    assert s.rejoin(0, since=4.0) is None  # the survivor never paused
    lost, pause = s.lost_and_pause(0, fired=4.05, until=9.0, before=None)
    assert lost == 0 and pause == pytest.approx(0.1)
    # After a restart from a checkpoint of step 30, the survivor's steps go back: 40 - 31 + 1 run again.
    restarted = [(st * 0.1, st) for st in range(1, 41)] + [(6.0 + i * 0.1, st) for i, st in enumerate(range(31, 101))]
    lost, pause = _series({0: restarted}).lost_and_pause(0, fired=4.05, until=None, before=40)
    assert lost == 10 and pause == pytest.approx(2.0, abs=0.01)
