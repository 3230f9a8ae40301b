"""`vigil bench chaos`, its pure parts: the schedule drawn from a seed, the scoring of faults against
incidents and rank 0's steps, and the samples lost / duplicated read from a real SQLite database.

Needs: nothing but SQLite (no cluster); fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controller import migrate
from controller.db import make_engine
from controller.models import Job
from ops.bench.chaos_db import final_loss, sample_counts
from ops.bench.chaos_plan import (
    BASE_KINDS,
    EXPECT,
    NET_KINDS,
    FaultRecord,
    IncidentView,
    draw_schedule,
    eligible_kinds,
    score,
)

# -- the schedule -------------------------------------------------------------------------------------------


def test_schedule_is_reproducible_and_covers_every_kind() -> None:
    kinds = eligible_kinds(netns=False)
    a = draw_schedule(7, minutes=10, gap_s=50, kinds=kinds)
    assert a == draw_schedule(7, minutes=10, gap_s=50, kinds=kinds)
    assert a != draw_schedule(8, minutes=10, gap_s=50, kinds=kinds)
    assert 8 <= len(a) <= 16  # about 10 in 10 minutes
    assert {p.kind for p in a} == set(BASE_KINDS)
    assert [p.kind for p in a[:len(kinds)]] != list(kinds) or len(kinds) < 3  # shuffled, not in table order
    times = [p.at_s for p in a]
    assert times == sorted(times) and times[-1] < 600
    assert all(p.rank in (0, 1) and 10 <= p.ahead <= 25 for p in a)
    slow = [p for p in a if p.kind == "slow_rank"]
    assert slow and all(p.params["mode"] == "compute" and 3.0 <= p.params["factor"] <= 4.0 for p in slow)


def test_network_kinds_only_with_netns() -> None:
    assert set(eligible_kinds(netns=True)) == set(BASE_KINDS) | set(NET_KINDS)
    plans = draw_schedule(1, minutes=30, gap_s=50, kinds=eligible_kinds(netns=True))
    assert {p.kind for p in plans} == set(BASE_KINDS) | set(NET_KINDS)
    assert eligible_kinds(False, ["kill_9", "nan_loss"]) == ["kill_9", "nan_loss"]
    with pytest.raises(ValueError, match="needs --netns"):
        eligible_kinds(False, ["degrade_nic"])
    with pytest.raises(ValueError, match="unknown fault kind"):
        eligible_kinds(False, ["kill_everything"])
    assert set(EXPECT) == set(BASE_KINDS) | set(NET_KINDS)


# -- scoring ----------------------------------------------------------------------------------------------


def _steps(*spans: tuple[float, int, int]) -> list[tuple[float, int]]:
    """Rank 0's rows: each span (start time, first step, last step) at 10 steps a second."""
    return [(t0 + 0.1 * (s - first), s) for t0, first, last in spans for s in range(first, last + 1)]


def _inc(id_: int, kind: str, at: float, *, node: str | None = "vigil-node-1", rank: int | None = 1,
         status: str = "RECOVERED", step: int | None = None, evidence: dict | None = None,
         acted: bool = True) -> IncidentView:
    return IncidentView(id_, kind, "job", node, rank, status, at, acted_at=at if acted else None, recovered_at=None,
                        step_at_detect=step, evidence=evidence or {})


def test_score_counts_detection_culprit_recovery_and_false_positives() -> None:
    # Rank 0: steps 1-300 from t=1000; a kill at step 300 (t=1030), restart from the checkpoint at 250 at
    # t=1060, steps 251-700; a controller kill at step 500 (t=1085): nothing happens to the ranks; a slow rank
    # at step 550 found, but the incident names the wrong rank.
    rank0 = _steps((1000.0, 1, 300), (1060.0, 251, 700))
    faults = [
        FaultRecord("kill_rank", 1, "vigil-node-1", step_asked=300, step_hit=300, injected_at=1029.0, fired_at=1030.0,
                    resolved_at=1070.0),
        FaultRecord("controller_kill_9", None, None, step_asked=500, step_hit=500, injected_at=1080.0, fired_at=1085.0,
                    resolved_at=1090.0, signal_seen=True),
        FaultRecord("slow_rank", 0, "vigil-node-2", step_asked=550, step_hit=550, injected_at=1091.0, fired_at=1095.0,
                    resolved_at=1100.0),
    ]
    incidents = [
        _inc(1, "rank_died", 1032.0, step=300),
        # wrong culprit; not evicted (no room): nothing to restart
        _inc(2, "straggler", 1097.0, node="vigil-node-1", rank=1, status="CLOSED", step=560, acted=False),
        _inc(3, "hang", 1200.0, step=600),  # long after every fault: a false positive
    ]
    out = score(faults, incidents, rank0)
    assert out["faults_injected"] == 3
    kill, ctl, slow = out["faults"]
    assert kill["detected"] and kill["culprit_correct"] and kill["recovered"]
    assert kill["incident_id"] == 1 and kill["seconds_to_detect"] == 2.0 and kill["seconds_to_recover"] == 30.0
    assert ctl["detected"] and ctl["culprit_correct"] and ctl["recovered"]  # no incident, the job stepped on
    assert slow["detected"] and not slow["culprit_correct"] and slow["incident_id"] == 2
    assert slow["recovered"]  # CLOSED, and the job went on past the step it had (no restart)
    assert (out["detected"], out["culprit_correct"], out["recovered"], out["false_positives"]) == (3, 2, 3, 1)
    assert [i["id"] for i in out["false_positive_incidents"]] == [3]


def test_an_incident_during_a_no_incident_fault_is_a_false_positive_and_unexpected_kinds_too() -> None:
    rank0 = _steps((1000.0, 1, 400))
    faults = [
        FaultRecord("agent_kill_9", 0, "vigil-node-2", step_asked=100, step_hit=100, injected_at=1009.0,
                    fired_at=1010.0, resolved_at=1025.0, signal_seen=True),
        FaultRecord("nan_loss", 0, "vigil-node-2", step_asked=300, step_hit=300, injected_at=1031.0, fired_at=1031.5,
                    resolved_at=1039.0),
    ]
    incidents = [
        _inc(1, "node_lost", 1015.0, node="vigil-node-2", rank=0, step=150),  # the agent was slow to come back
        _inc(2, "rank_died", 1032.0, node="vigil-node-2", rank=0, step=320),  # not what a NaN causes
    ]
    out = score(faults, incidents, rank0)
    agent, nan = out["faults"]
    assert agent["detected"] and not agent["culprit_correct"] and agent["recovered"]
    assert [i["id"] for i in agent["other_incidents"]] == [1]
    assert not nan["detected"] and not nan["culprit_correct"] and not nan["recovered"]  # no rollback either
    assert out["false_positives"] == 2


def test_a_restart_during_a_no_incident_fault_is_not_a_recovery_and_nan_culprit_needs_the_step() -> None:
    rank0 = _steps((1000.0, 1, 200), (1020.5, 151, 400))  # the ranks restarted (step went back) at 1020.5
    faults = [
        FaultRecord("controller_kill_9", None, None, step_asked=190, step_hit=190, injected_at=1018.0,
                    fired_at=1019.0, resolved_at=1035.0, signal_seen=True),
        FaultRecord("nan_loss", 1, "vigil-node-1", step_asked=380, step_hit=380, injected_at=1040.0,
                    fired_at=1043.0, resolved_at=1060.0),
    ]
    incidents = [_inc(1, "nan_loss", 1044.0, rank=1, node=None, step=385, evidence={"step": 370})]  # before the NaN
    out = score(faults, incidents, rank0)
    ctl, nan = out["faults"]
    assert ctl["detected"] and not ctl["recovered"]
    assert nan["detected"] and not nan["culprit_correct"]


def test_a_repeat_blaming_another_node_is_a_false_positive_a_repeat_of_the_same_is_not() -> None:
    rank0 = _steps((1000.0, 1, 300), (1040.0, 251, 600))
    faults = [FaultRecord("slow_rank", 1, "vigil-node-2", step_asked=280, step_hit=280, injected_at=1020.0,
                          fired_at=1028.0, resolved_at=1060.0),
              FaultRecord("nan_loss", 0, "vigil-node-1", step_asked=520, step_hit=520, injected_at=1062.0,
                          fired_at=1067.0, resolved_at=1090.0)]
    incidents = [
        _inc(1, "straggler", 1030.0, node="vigil-node-2", rank=1, step=300),
        # after the restart, rank 1 (now on node 1) blamed again from the old attempt's slow steps
        _inc(2, "straggler", 1042.0, node="vigil-node-1", rank=1, status="CLOSED", step=300),
        _inc(3, "nan_loss", 1068.0, node=None, rank=0, step=525, evidence={"step": 520}),
        _inc(4, "nan_loss", 1075.0, node=None, rank=0, step=530, evidence={"step": 522}),  # the same NaN again
    ]
    out = score(faults, incidents, rank0)
    slow, nan = out["faults"]
    assert slow["incident_id"] == 1 and slow["culprit_correct"] and [i["id"] for i in slow["other_incidents"]] == [2]
    assert nan["incident_id"] == 3 and nan["culprit_correct"] and [i["id"] for i in nan["other_incidents"]] == [4]
    assert [i["id"] for i in out["false_positive_incidents"]] == [2]


def test_an_action_never_followed_by_a_restart_is_not_a_recovery() -> None:
    # A NIC fault: the node evicted (acted), then the group never came back (the job stuck, then cancelled:
    # its incident CLOSED). The steps it ran between the detection and the eviction are no recovery.
    rank0 = _steps((1000.0, 1, 500))
    f = FaultRecord("degrade_nic", 1, "vigil-node-3", step_asked=400, step_hit=400, injected_at=1038.0,
                    fired_at=1039.0, resolved_at=1300.0)
    (out,) = score([f], [_inc(1, "nic_degraded", 1041.0, node="vigil-node-3", status="CLOSED", step=420)],
                   rank0)["faults"]
    assert out["detected"] and out["culprit_correct"] and not out["recovered"]


def test_what_the_job_does_after_the_bench_gave_up_is_no_recovery() -> None:
    # A hang nobody detected: the bench gave up at 1300 and cleared the fault; the job then stepped on.
    rank0 = _steps((1000.0, 1, 400), (1301.0, 401, 600))
    f = FaultRecord("hang_rank", 0, "vigil-node-2", step_asked=400, step_hit=400, injected_at=1035.0,
                    fired_at=1039.9, resolved_at=1310.0, gave_up_at=1300.0)
    (out,) = score([f], [], rank0)["faults"]
    assert not out["detected"] and not out["recovered"]


def test_corrupt_checkpoint_is_judged_by_the_restore() -> None:
    rank0 = _steps((1000.0, 1, 320), (1050.0, 201, 500))  # frozen at 320, restored 200 (skipping 250 and 300)
    good = FaultRecord("corrupt_checkpoint", 1, "vigil-node-1", step_asked=310, step_hit=320, injected_at=1030.0,
                       fired_at=1040.0, resolved_at=1070.0, corrupted_step=300, invalid_steps=[300],
                       invalid_at=1045.0, restored_step=250)
    out = score([good], [_inc(1, "rank_died", 1042.0, step=320)], rank0)
    (f,) = out["faults"]
    assert f["detected"] and f["culprit_correct"] and f["recovered"] and out["false_positives"] == 0
    assert f["seconds_to_detect"] == 5.0
    bad = FaultRecord("corrupt_checkpoint", 1, "vigil-node-1", step_asked=310, step_hit=320, injected_at=1030.0,
                      fired_at=1040.0, resolved_at=1070.0, corrupted_step=300, invalid_steps=[],
                      restored_step=300)  # restored the corrupt one: not found out
    (f,) = score([bad], [], rank0)["faults"]
    assert not f["detected"] and not f["culprit_correct"]


# -- the database ------------------------------------------------------------------------------------------


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'vigil.db'}"
    migrate.upgrade(url)
    e = make_engine(url)
    with Session(e) as session:
        session.add(Job(id="job", name="chaos", status="SUCCEEDED", spec={}))
        session.commit()
    yield e
    e.dispose()


def _rows(e: Engine, rows: list[tuple[int, int, float, float | None]]) -> int:
    """(rank, step, ts, loss) rows of job 'job'; a second run of a step gets a later ts (and attempt). Returns
    how many the database refused (a unique (job, rank, step, attempt) key refuses a stored-twice sample)."""
    cols = {c["name"] for c in inspect(e).get_columns("step_metrics")}
    extra = (", attempt", ", :a") if "attempt" in cols else ("", "")
    refused = 0
    for rank, step, ts, loss in rows:
        values = {"j": "job", "n": "vigil-node-1", "r": rank, "s": step, "t": ts, "l": loss, "a": 1 + int(ts // 1000)}
        try:
            with e.begin() as c:
                c.execute(text("INSERT INTO step_metrics (job_id, node_id, rank, step, ts, loss, tokens, step_time_s, "
                               f"tokens_per_s, dropped{extra[0]}) VALUES (:j, :n, :r, :s, :t, :l, 0, 0.1, 0, 0"
                               f"{extra[1]})"), values)
        except IntegrityError:
            refused += 1
    return refused


def test_samples_lost_and_duplicated_from_the_step_rows(engine: Engine) -> None:
    rows = [(r, s, 10.0 + s, 3.0 - 0.01 * s) for r in (0, 1) for s in range(1, 11)]
    rows = [x for x in rows if (x[0], x[1]) not in {(1, 4), (1, 5)}]  # rank 1's steps 4 and 5 never arrived
    rows += [(0, s, 1000.0 + s, 2.0) for s in (7, 8)]  # re-run after a restart (a later attempt): not duplicates
    rows += [(0, 3, 13.0, 2.97)]  # the same sample stored twice (a replayed batch): a duplicate
    refused = _rows(engine, rows)
    got = sample_counts(engine, "job", final_step=10, world_size=2)
    assert got["samples_lost"] == 2 and got["samples_duplicated"] == 1 - refused
    assert sample_counts(engine, "job", final_step=12, world_size=2)["samples_lost"] == 6  # steps 11, 12 too
    assert sample_counts(engine, "job", final_step=10, world_size=3)["samples_lost"] == 12  # rank 2: none
    # final loss: each rank's newest loss at the step, averaged
    assert final_loss(engine, "job", 8) == pytest.approx((2.0 + (3.0 - 0.08)) / 2)
    assert final_loss(engine, "job", 99) is None
