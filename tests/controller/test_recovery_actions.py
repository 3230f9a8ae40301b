"""Fault injection, manual recovery and eviction placement, driven one monitor step at a time (the rig:
tests/controller/recovery_env.py; detection itself: test_recovery.py)."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import event

from controller.db import session_scope
from controller.models import NodeCommandRow
from controller.recovery.monitor import ON_RECORD_S, Monitor
from tests.controller.recovery_env import API, Env


def test_nan_fault_writes_fault_file_on_the_ranks_node(env: Env) -> None:
    env.steps(1, 2)
    env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "nan_loss", "rank": 0, "step": 40})
    env.monitor.step()
    cmds = env.commands("vigil-node-1")
    assert [(c["kind"], c["args"]["rank"], c["args"]["fault"]["step"]) for c in cmds] == [("write_fault_file", 0, 40)]


def test_slow_fault_is_undone_when_cleared(env: Env) -> None:
    env.steps(1, 2)
    fid = env.client.post(f"{API}/jobs/{env.job_id}/faults",
                          json={"kind": "slow_rank", "rank": 1, "params": {"factor": 2}}).json()["id"]
    env.monitor.step()
    assert [c["kind"] for c in env.commands("vigil-node-2")] == ["throttle_pid"]
    r = env.client.post(f"{API}/jobs/{env.job_id}/faults/{fid}/clear")
    assert r.status_code == 200 and r.json()["status"] == "CLEARED"
    assert [c["kind"] for c in env.commands("vigil-node-2")] == ["throttle_pid", "unthrottle_pid"]


def test_compute_slow_fault_is_a_fault_file_armed_at_once_and_reset_when_cleared(env: Env) -> None:
    env.steps(1, 2)
    fid = env.client.post(f"{API}/jobs/{env.job_id}/faults", json={
        "kind": "slow_rank", "rank": 1, "step": 30, "params": {"factor": 2, "mode": "compute"}}).json()["id"]
    env.monitor.step()  # armed before step 30: the rank slows itself from step 30 on
    cmds = env.commands("vigil-node-2")
    assert [(c["kind"], c["args"]["fault"]) for c in cmds] == [
        ("write_fault_file", {"kind": "slow_rank", "step": 30, "factor": 2.0, "fault_id": fid})]
    env.client.post(f"{API}/jobs/{env.job_id}/faults/{fid}/clear")
    cmds = env.commands("vigil-node-2")
    assert [(c["kind"], c["args"]["fault"]["factor"]) for c in cmds] == [("write_fault_file", 2.0),
                                                                        ("write_fault_file", 1.0)]


def test_manual_evict_readmit_and_recover(env: Env) -> None:
    env.steps(1, 2)
    r = env.client.post(f"{API}/nodes/vigil-node-2/evict")
    assert r.status_code == 200 and env.cluster.drained == [("vigil-node-2", 5.0)]
    assert env.client.post(f"{API}/nodes/vigil-node-1/readmit").status_code == 409
    r = env.client.post(f"{API}/nodes/vigil-node-2/readmit")
    assert r.status_code == 200
    assert [c["kind"] for c in env.commands("vigil-node-2")] == ["stop_raylet", "start_raylet"]
    r = env.client.post(f"{API}/jobs/{env.job_id}/recover", json={"reason": "operator"})
    assert r.status_code == 202 and r.json()["kind"] == "manual"
    assert env.client.post(f"{API}/nodes/nope/evict").status_code == 404


def test_the_ray_head_is_never_evicted_by_hand(env: Env) -> None:
    env.cluster.head = "vigil-node-2"
    env.steps(1, 2)
    r = env.client.post(f"{API}/nodes/vigil-node-2/evict")
    assert r.status_code == 409 and "Ray head" in r.json()["detail"]
    r = env.client.post(f"{API}/jobs/{env.job_id}/recover", json={"reason": "op", "evict_node": "vigil-node-2"})
    assert r.status_code == 409 and "evict_node" in r.json()["detail"]
    assert env.cluster.drained == [] and env.incidents() == []  # nothing half done
    assert {n["id"]: n["state"] for n in env.client.get(f"{API}/nodes").json()["data"]}["vigil-node-2"] == "ALIVE"


def test_straggler_on_the_ray_head_is_recorded_but_not_evicted(env: Env) -> None:
    env.cluster.head = "vigil-node-2"
    env.steps(1, 20)
    env.steps(21, 32, compute={1: 0.15})
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["node_id"], i["status"]) for i in inc] == [
        ("straggler", 1, "vigil-node-2", "CLOSED")]
    assert "Ray head" in inc[0]["action"] and env.cluster.drained == []
    events = [e for e in env.client.get(f"{API}/events").json()["data"] if e["kind"] == "eviction_refused"]
    assert [e["node_id"] for e in events] == ["vigil-node-2"]


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_manual_recovery_under_observe_is_carried_out_and_closed_not_left_open(env: Env) -> None:
    """An OPEN incident quiets the job's detectors: the manual one under observe is CLOSED at once, and a
    straggler afterwards is still detected."""
    env.steps(1, 20)
    r = env.client.post(f"{API}/jobs/{env.job_id}/recover", json={"reason": "operator"})
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "CLOSED" and "not followed by Vigil" in r.json()["action"]
    kills = {n: [c["args"]["pid"] for c in env.commands(n) if c["kind"] == "kill_pid"]
             for n in ("vigil-node-1", "vigil-node-2")}
    assert kills == {"vigil-node-1": [1000], "vigil-node-2": [1001]}  # the restart was carried out
    env.steps(21, 40, compute={1: 0.15})
    env.monitor.step()
    kinds = [(i["kind"], i["status"]) for i in env.incidents()]
    assert ("straggler", "OPEN") in kinds and ("manual", "CLOSED") in kinds


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_under_observe_an_open_straggler_does_not_mute_a_hang_named_by_its_collective(env: Env) -> None:
    """Under observe an incident stays OPEN for good: it must not silence the other detectors (it did: a job
    with a straggler on record had its hang never detected). The hang's diagnosis lines up the ranks'
    progress reports: rank 0 waits in all_reduce #83, rank 1 never entered it."""
    env.steps(1, 20)
    env.steps(21, 32, compute={1: 0.15})
    env.monitor.step()
    assert [(i["kind"], i["status"]) for i in env.incidents()] == [("straggler", "OPEN")]
    env.clock.now += 16
    for rank, node in env.nodes.items():
        entered = 83 if rank == 0 else 82
        env.post([{"kind": "progress", "job_id": env.job_id, "rank": rank, "attempt": env.attempt, "ts": env.clock.now,
                   "step": 33, "idle_s": 16.0,
                   "groups": [{"group": "world", "last_enqueued": entered, "last_completed": 82}],
                   "in_flight": [{"group": "world", "seq": 83, "op": "all_reduce", "enqueued_ts": env.clock.now - 16}]
                   if rank == 0 else []}], node)
    env.monitor.step()
    hang = next(i for i in env.incidents() if i["kind"] == "hang")
    dumps = {n: env.commands(n) for n in ("vigil-node-1", "vigil-node-2")}
    same = 'Thread 0x1 (idle): "MainThread"\n    fit (trainer.py:10)\n'
    for rank, node in env.nodes.items():
        env.answer(node, dumps[node][0]["id"], output={"stacks": {str(rank): same}})
    env.monitor.step()
    hang = next(i for i in env.incidents() if i["kind"] == "hang")
    found = hang["evidence"]["collectives"]
    assert found["not_entered"] == [1] and found["waiting_in"] == {"group": "world", "seq": 83, "op": "all_reduce"}
    assert hang["rank"] == 1 and hang["node_id"] == "vigil-node-2" and hang["evidence"]["odd_ranks"] == []
    assert found["summary"] == "ranks 0 wait in all_reduce #83 of group world; rank 1 never entered it"
    assert env.cluster.drained == []  # observe: on record, no action


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_a_hangs_diagnosis_waits_for_every_ranks_collective_report(env: Env) -> None:
    """Every stack is in but rank 1's progress report is still on its way: the diagnosis waits for it (up to
    stack_wait_s) instead of lining up rank 0 alone, which said "every rank entered it" for good (seen in CI)."""
    env.steps(1, 20)
    env.clock.now += 16

    def report(rank: int) -> None:
        entered = 83 if rank == 0 else 82
        env.post([{"kind": "progress", "job_id": env.job_id, "rank": rank, "attempt": env.attempt,
                   "ts": env.clock.now, "step": 21, "idle_s": 16.0,
                   "groups": [{"group": "world", "last_enqueued": entered, "last_completed": 82}],
                   "in_flight": [{"group": "world", "seq": 83, "op": "all_reduce", "enqueued_ts": env.clock.now - 16}]
                   if rank == 0 else []}], env.nodes[rank])

    report(0)
    env.heartbeats()
    env.monitor.step()
    dumps = {n: env.commands(n) for n in ("vigil-node-1", "vigil-node-2")}
    same = 'Thread 0x1 (idle): "MainThread"\n    fit (trainer.py:10)\n'
    for rank, node in env.nodes.items():
        env.answer(node, dumps[node][0]["id"], output={"stacks": {str(rank): same}})
    env.monitor.step()
    hang = next(i for i in env.incidents() if i["kind"] == "hang")
    assert "collectives" not in hang["evidence"]  # not yet: rank 1's report is missing
    report(1)
    env.monitor.step()
    hang = next(i for i in env.incidents() if i["kind"] == "hang")
    assert hang["evidence"]["collectives"]["not_entered"] == [1] and hang["rank"] == 1


def test_a_node_the_job_cannot_do_without_is_not_evicted(env: Env) -> None:
    """Two 1-CPU workers on two 1-CPU nodes (the head has none): evicting either leaves the job nowhere to
    run, so a straggler is recorded and the job runs on; a hang restarts the ranks without evicting."""
    env.cluster.cpus = {"vigil-node-0": 0.0, "vigil-node-1": 1.0, "vigil-node-2": 1.0}
    env.steps(1, 20)
    env.steps(21, 32, compute={1: 0.15})
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["node_id"], i["status"]) for i in inc] == [
        ("straggler", 1, "vigil-node-2", "CLOSED")]
    assert "would not fit" in inc[0]["action"] and env.cluster.drained == []
    refused = [e for e in env.client.get(f"{API}/events").json()["data"] if e["kind"] == "eviction_refused"]
    assert [e["node_id"] for e in refused] == ["vigil-node-2"] and "would not fit" in refused[0]["message"]
    # Still slow on every later pass: that one incident stays the record, none opened per pass (a live
    # chaos run opened 300 in 4 minutes), also by a restarted monitor that only has the database.
    for first in (33, 45):
        env.steps(first, first + 11, compute={1: 0.15})
        env.monitor.step()
    restarted = Monitor(env.monitor.sessions, env.launcher, env.cluster, clock=env.clock)
    env.steps(57, 68, compute={1: 0.15})
    restarted.step()
    assert len(env.incidents()) == 1
    # Seen again after a minute without it (and the rank back to its own pace for a while): a new incident.
    env.steps(69, 130)
    env.monitor.step()
    env.clock.now += ON_RECORD_S
    env.steps(131, 142, compute={1: 0.15})
    env.monitor.step()
    assert [(i["kind"], i["status"]) for i in env.incidents()] == [("straggler", "CLOSED")] * 2


def test_a_straggler_node_is_evicted_when_the_others_have_room(env: Env) -> None:
    env.cluster.cpus = {"vigil-node-0": 1.0, "vigil-node-1": 1.0, "vigil-node-2": 1.0}
    env.steps(1, 20)
    env.steps(21, 32, compute={1: 0.15})
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["node_id"], i["status"]) for i in inc] == [("straggler", "vigil-node-2", "ACTING")]
    assert [d[0] for d in env.cluster.drained] == ["vigil-node-2"]


def test_a_hang_on_a_node_the_job_needs_restarts_without_eviction(env: Env) -> None:
    env.cluster.cpus = {"vigil-node-1": 1.0, "vigil-node-2": 1.0}
    env.steps(1, 20)
    env.monitor.step()
    env.clock.now += 16
    env.heartbeats()
    env.monitor.step()
    dumps = {n: env.commands(n) for n in ("vigil-node-1", "vigil-node-2")}
    env.answer("vigil-node-1", dumps["vigil-node-1"][0]["id"], output={"stacks": {"0": "Thread 1 (idle): \"a\"\n    "
                                                                                "all_reduce (comm.py:1)\n"}})
    env.answer("vigil-node-2", dumps["vigil-node-2"][0]["id"],
               output={"stacks": {"1": "Thread 1 (idle): \"a\"\n    forward (model.py:1)\n"},
                       "states": {"1": "stopped"}})
    env.monitor.step()
    inc = env.incidents()[0]
    assert (inc["rank"], inc["status"]) == (1, "ACTING") and "not evicted" in inc["action"]
    assert env.cluster.drained == []
    assert [c["args"]["pid"] for c in env.commands("vigil-node-2") if c["kind"] == "kill_pid"] == [1001]
    assert {n["id"]: n["state"] for n in env.client.get(f"{API}/nodes").json()["data"]}["vigil-node-2"] == "ALIVE"


@pytest.mark.parametrize(
    "body",
    [{"kind": "kill_rank"}, {"kind": "explode", "rank": 0}, {"kind": "kill_rank", "rank": -1},
     {"kind": "slow_rank", "rank": 0, "params": {f"k{i}": 1 for i in range(20)}},
     {"kind": "slow_rank", "rank": 0, "params": {"factor": 0.5}},
     {"kind": "slow_rank", "rank": 0, "params": {"factor": "2"}},
     {"kind": "slow_rank", "rank": 0, "params": {"factor": 2, "mode": "gpu"}}],
)
def test_bad_fault_is_422_and_stores_nothing(env: Env, body: dict) -> None:
    r = env.client.post(f"{API}/jobs/{env.job_id}/faults", json=body)
    assert r.status_code == 422
    assert env.client.get(f"{API}/jobs/{env.job_id}/faults").json()["count"] == 0


def test_a_fault_fires_although_another_writer_commits_while_its_pass_reads(env: Env, tmp_path) -> None:
    """SQLite: the fault's savepoint reads where the rank runs, then queues its command. Another connection
    that commits in between (the ingest, on a busy controller) used to leave the savepoint's snapshot stale:
    its write failed at once with "database is locked" and the fault was marked FAILED (stop 34's CI).
    Now the pass holds the write lock first: the other writer waits, and the fault fires."""
    env.steps(1, 2)
    env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "nan_loss", "rank": 0, "step": 40})
    engine = env.monitor.sessions.kw["bind"]
    intruder: list[str] = []

    def commit_from_another_connection(conn, cursor, statement, *_args) -> None:
        if not statement.startswith("INSERT INTO node_commands") or intruder:
            return
        other = sqlite3.connect(engine.url.database, timeout=0.2)
        try:
            other.execute("CREATE TABLE intruder (x INTEGER)")
            other.commit()
            intruder.append("committed")
        except sqlite3.OperationalError as e:
            intruder.append(str(e))
        finally:
            other.close()

    event.listen(engine, "before_cursor_execute", commit_from_another_connection)
    try:
        env.monitor.step()
    finally:
        event.remove(engine, "before_cursor_execute", commit_from_another_connection)
    assert intruder == ["database is locked"]  # it waited for the pass's write lock, and gave up first
    assert [c["kind"] for c in env.commands("vigil-node-1")] == ["write_fault_file"]
    (fault,) = env.client.get(f"{API}/jobs/{env.job_id}/faults").json()["data"]
    assert fault["status"] == "FIRED", fault


def test_an_agents_answer_wakes_the_monitor_once_it_is_stored(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored answer (a hang's stacks, say) brings the monitor's next pass at once, not at its interval, and
    only after the commit: a pass woken before it would not see the answer."""
    env.steps(1, 2)
    env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "nan_loss", "rank": 0, "step": 40})
    env.monitor.step()
    (cmd,) = env.commands("vigil-node-1")
    seen: list[str] = []

    def status_when_woken() -> None:
        with session_scope(env.monitor.sessions) as s:
            seen.append(s.get(NodeCommandRow, cmd["id"]).status)

    monkeypatch.setattr(env.monitor, "wake", status_when_woken)
    env.answer("vigil-node-1", cmd["id"])
    assert seen == ["DONE"]
    env.answer("vigil-node-1", cmd["id"])  # a repeated answer changes nothing: no pass for it
    assert seen == ["DONE"]
