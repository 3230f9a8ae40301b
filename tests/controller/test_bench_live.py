"""``vigil bench recovery --policy live``'s readings of a job's steps (ops/bench/live_recovery.py),
on made-up step rows: ETTR at the job's own steady pace, a replaced rank's rejoin, a survivor's lost steps."""

from __future__ import annotations

import pytest

from ops.bench.live_recovery import Series


def _series(by_rank: dict[int, list[tuple[float, int]]], heals: list[tuple[float, int]] | None = None) -> Series:
    s = Series.__new__(Series)
    s.by_rank = {r: [(ts, st, 0.08) for ts, st in rows] for r, rows in by_rank.items()}
    s.heals = heals or []
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


def test_steady_step_ratio_is_the_live_pace_over_the_restart_policys() -> None:
    from ops.bench.recovery import _ratio

    # 0.108 s a step under live (a quorum round trip each step) against 0.1 s: 1.08.
    live = _series({0: [(st * 0.108, st) for st in range(1, 101)]}).job_ettr()["pace_s"]
    base = _series({0: [(st * 0.1, st) for st in range(1, 101)]}).job_ettr()["pace_s"]
    assert _ratio({"live": {"pace_s": live}, "evict_restart": {"pace_s": base}}) == pytest.approx(1.08)
    assert _ratio({"live": {"pace_s": live}}) is None and _ratio({}) is None  # a run missing: no figure


def test_steady_jobs_run_in_turn_and_each_keeps_its_fastest_run() -> None:
    from ops.bench.recovery import _ratio, _steady

    paces = {("live", None): iter([0.105, 0.101]), ("live", 1): iter([0.110, 0.112]),
             ("evict_restart", None): iter([0.100, 0.104])}
    order: list[tuple[str, int | None]] = []

    class Runner:
        def steady(self, policy: str, steps: int, quorum_every: int | None = None) -> dict[str, object]:
            order.append((policy, quorum_every))
            return {"policy": policy, "steps": steps, "pace_s": next(paces[(policy, quorum_every)])}

    steady = _steady(Runner(), 400, 2)
    assert order == [("live", None), ("live", 1), ("evict_restart", None)] * 2  # in turn, not one policy's runs together
    assert steady["live"]["pace_s"] == 0.101 and steady["live"]["paces_s"] == [0.105, 0.101]
    assert steady["live_every_step"]["pace_s"] == 0.110 and steady["evict_restart"]["pace_s"] == 0.100
    assert _ratio(steady) == pytest.approx(1.01) and _ratio(steady, "live_every_step") == pytest.approx(1.10)


def test_a_warm_spare_rejoins_from_its_heal_without_a_pause_of_its_own() -> None:
    """recovery.spares: rank 1's steps pause 0.9 s (under REJOIN_GAP_S): only its heal says it is back."""
    victim = [(st * 0.1, st) for st in range(1, 41)] + [(5.0 + (st - 41) * 0.1, st) for st in range(41, 101)]
    assert _series({1: victim}).rejoin(1, since=4.05) is None  # no heal record: no pause long enough either
    s = _series({1: victim}, heals=[(1.0, 1), (4.9, 0), (4.95, 1)])  # rank 1's earlier heal, rank 0's: not it
    assert s.rejoin(1, since=4.05) == pytest.approx(5.0)

