"""A hang found from the collective (controller/recovery/collective_hang.py, issue 27 point 2): a rank waiting
inside a collective far beyond the group's longest on record, confirmed by its peers' reports, is a hang in
seconds; the 15 s floor stays for everything else. The controller rig (tests/controller/recovery_env.py):
the real API and monitor on SQLite, the ranks played by posting what their agents post."""

from __future__ import annotations

import pytest

from tests.controller.recovery_env import Env


def _history(env: Env, first: int, last: int, duration_s: float = 0.01, at: dict[int, float] | None = None) -> float:
    """Steps first..last with one all-reduce each of ``duration_s`` (``at``: step -> a longer one); when the last
    one ended (the next all-reduce's rank 0 entered then)."""
    for st in range(first, last + 1):
        env.steps(st, st)
        for rank, node in env.nodes.items():
            env.post([{"kind": "collective", "job_id": env.job_id, "rank": rank, "step": st, "attempt": env.attempt,
                       "seq": st, "op": "all_reduce", "group": "world", "tag": "grads", "payload_bytes": 4096,
                       "wire_bytes": 4096, "duration_s": (at or {}).get(st, duration_s), "ts": env.clock.now}], node)
    return env.clock.now


def _waits(env: Env, seq: int, began: float, later_s: float, inside: tuple[int, ...] = (0,),
           silent: tuple[int, ...] = (), starting: tuple[int, ...] = ()) -> None:
    """``later_s`` on, the ranks' watchers report: the ranks ``inside`` all-reduce ``seq`` wait there since
    ``began``, the others never entered it; the ``silent`` ones send nothing (stopped); the ``starting`` ones
    ran no step in their process yet (step 0, nothing entered)."""
    env.clock.now += later_s
    waited_s = env.clock.now - began
    for rank, node in env.nodes.items():
        if rank in silent:
            continue
        entered = seq if rank in inside else -1 if rank in starting else seq - 1
        env.post([{"kind": "progress", "job_id": env.job_id, "rank": rank, "attempt": env.attempt,
                   "ts": env.clock.now, "step": 0 if rank in starting else seq, "idle_s": waited_s,
                   "groups": [{"group": "world", "last_enqueued": entered, "last_completed": seq - 1}],
                   "in_flight": [{"group": "world", "seq": seq, "op": "all_reduce", "enqueued_ts": began}]
                   if rank in inside else []}], node)
    env.heartbeats()


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_a_rank_that_never_entered_the_collective_its_peer_waits_in_is_a_hang_within_seconds(env: Env) -> None:
    began = _history(env, 1, 40)
    _waits(env, 41, began, 4.0)  # under collective_hang_floor_s (5 s): not yet
    env.monitor.step()
    assert env.incidents() == []
    _waits(env, 41, began, 2.0)  # 6 s in all-reduce #41, which never took over 10 ms: far beyond; rank 1 never entered it
    env.monitor.step()
    (inc,) = env.incidents()
    ev = inc["evidence"]
    assert (inc["kind"], inc["rank"], inc["node_id"]) == ("hang", 1, "vigil-node-2")
    assert ev["found_by"] == "collective" and ev["limit_s"] == 5.0 and ev["longest_collective_s"] == 0.01
    assert ev["waited_s"] == pytest.approx(6.0, abs=0.05) and ev["suspects"] == [1]
    assert ev["at_detection"] == "ranks 0 wait in all_reduce #41 of group world; rank 1 never entered it"


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_long_waits_on_record_raise_the_limit(env: Env) -> None:
    """Rank 0 works alone every 20 steps (an evaluation) while rank 1 waits 3 s in the next all-reduce: such a
    wait is this job's normal, so 6 s is not a hang by the collective (4 x 3 s = 12 s is the limit)."""
    began = _history(env, 1, 40, at={20: 3.0, 40: 3.0})
    _waits(env, 41, began, 6.0)
    env.monitor.step()
    assert env.incidents() == []
    _waits(env, 41, began, 6.5)  # 12.5 s: beyond it, and still under the time-based 15 s
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["evidence"]["found_by"] == "collective" and inc["evidence"]["limit_s"] == 12.0


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_every_rank_inside_the_collective_is_left_to_the_time_based_detector(env: Env) -> None:
    """A transport stall (every rank entered it) names no one: judged by time, after the 15 s floor."""
    began = _history(env, 1, 40)
    _waits(env, 41, began, 8.0, inside=(0, 1))
    env.monitor.step()
    assert env.incidents() == []
    _waits(env, 41, began, 9.0, inside=(0, 1))
    env.monitor.step()
    (inc,) = env.incidents()
    assert "found_by" not in inc["evidence"] and inc["evidence"]["idle_s"] > 15


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_a_rank_that_sends_no_report_while_its_peer_waits_is_a_suspect(env: Env) -> None:
    """Rank 1 stopped (SIGSTOP: its watcher is stopped too) before its report: its peer's wait is confirmed by
    the silence; the finding names no rank yet (the report may only be late): the diagnosis will."""
    began = _history(env, 1, 40)
    _waits(env, 41, began, 6.0, silent=(1,))
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["kind"] == "hang" and inc["rank"] is None
    assert inc["evidence"]["suspects"] == [1] and inc["evidence"]["silent_ranks"] == [1]


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_stopped_silent_rank_is_diagnosed_without_waiting_for_its_report(env: Env) -> None:
    """Live recovery, rank 1 SIGSTOPped: it will never report. Once the stacks are in and its own says stopped,
    the diagnosis decides at once (not after stack_wait_s, 10 s), names it, says it sent no report, and the live
    policy kills it alone."""
    began = _history(env, 1, 40)
    _waits(env, 41, began, 6.0, silent=(1,))
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["evidence"]["found_by"] == "collective" and inc["status"] == "OPEN"
    dumps = {n: [c for c in env.commands(n) if c["kind"] == "pyspy_dump"] for n in ("vigil-node-1", "vigil-node-2")}
    env.answer("vigil-node-1", dumps["vigil-node-1"][0]["id"], output={"stacks": {"0": _WAITING}})
    env.clock.now += 1.0
    env.monitor.step()
    assert env.incidents()[0]["status"] == "OPEN"  # rank 1's stack is not in yet: its state unknown
    env.answer("vigil-node-2", dumps["vigil-node-2"][0]["id"],
               output={"stacks": {"1": _ASLEEP}, "states": {"1": "stopped"}})
    env.clock.now += 0.5  # 1.5 s after the detection: well under stack_wait_s
    env.monitor.step()
    (inc,) = env.incidents()
    assert (inc["rank"], inc["node_id"], inc["status"]) == (1, "vigil-node-2", "ACTING")
    assert inc["evidence"]["collectives"]["silent"] == [1]
    assert inc["evidence"]["collectives"]["summary"] == (
        "ranks 0 wait in all_reduce #41 of group world; rank 1 sent no report (stopped, or cannot speak)")
    kills = [c for c in env.commands("vigil-node-2") if c["kind"] == "kill_pid"]
    assert [c["args"]["pid"] for c in kills] == [1001] and env.cluster.drained == []


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_rank_still_starting_is_not_taken_for_a_hang(env: Env) -> None:
    """A live replacement healing from rank 0 (step 0: no step in its process yet) while rank 0 waits for it
    inside the all-reduce: a heal of a large state takes seconds; that wait is judged by time, not named."""
    began = _history(env, 1, 40)
    _waits(env, 41, began, 6.0, starting=(1,))
    env.monitor.step()
    assert env.incidents() == []


_WAITING = ('Thread 0x1 (idle): "MainThread"\n    all_reduce (vigil/live.py:140)\n    step (vigil/optim/adamw.py:40)\n'
            "    train (user/train.py:20)\n")
_ASLEEP = 'Thread 0x1 (idle): "MainThread"\n    train (user/train.py:18)\n'


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe", "thresholds": {"collective_hang_floor_s": 30}}}],
                         indirect=True)
def test_the_floor_is_the_jobs_to_set(env: Env) -> None:
    """A job whose rank 0 saves alone for long (never on record before its first save) sets a higher floor."""
    began = _history(env, 1, 40)
    _waits(env, 41, began, 12.0)
    env.monitor.step()
    assert env.incidents() == []


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_the_first_steps_of_a_restarted_group_are_judged_by_time(env: Env) -> None:
    """After a restart the ranks reach their first collectives apart (one restores from object storage while
    its peer waits: 5.3 s in the multi-host e2e test): not a hang until each ran a few steps."""
    _history(env, 1, 40)
    env.steps(31, 31)  # the group restarted from step 30: one step of the new attempt so far
    _waits(env, 32, env.clock.now, 6.0)
    env.monitor.step()
    assert env.incidents() == []
    env.steps(31, 33)  # (restarted again) three steps in: judged again
    _waits(env, 34, env.clock.now, 6.0)
    env.monitor.step()
    assert [i["evidence"].get("found_by") for i in env.incidents()] == ["collective"]


@pytest.mark.parametrize("env", [{"recovery": {"policy": "observe"}}], indirect=True)
def test_a_report_left_from_a_stall_that_ended_is_not_judged(env: Env) -> None:
    """A stored report outlives its stall (the watcher stops sending once steps flow again): read minutes
    later it said "waited 367 s" in the multi-host e2e test. Only reports since the newest step count."""
    began = _history(env, 1, 40)
    _waits(env, 41, began, 3.0)  # a 3 s stall, reported
    env.monitor.step()
    _history(env, 41, 60)  # then the steps flow again: no new report
    env.clock.now += 30
    env.heartbeats()
    env.monitor.step()
    assert [i["evidence"].get("found_by") for i in env.incidents()] == [None]  # the time-based hang (30 s), only
