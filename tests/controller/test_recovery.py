"""Detection, recovery and fault injection, driven one monitor step at a time.

The database is real (SQLite); the agents and Ray are not: telemetry is posted as agents would post
it, the agents' command results are posted through the API, and a fake cluster control records
drains. The real thing (agents carrying out commands, Ray restarting ranks) is tests/e2e.
"""

from __future__ import annotations

import pytest

from controller.models import Job
from controller.recovery.monitor import Monitor
from tests.controller.recovery_env import API, Env
from tests.live_controller import checkpoint_path


def test_clean_run_has_no_incidents(env: Env) -> None:
    for chunk in range(10):
        env.steps(chunk * 10 + 1, chunk * 10 + 10)
        env.monitor.step()
    assert env.incidents() == []
    assert env.cluster.drained == []


def test_an_incident_settles_in_the_pass_that_sees_its_job_end(env: Env) -> None:
    """Ray says the job SUCCEEDED before any monitor pass saw it step again after the restart (fast steps):
    the supervisor's pass that stores the end also marks the recovery RECOVERED; no reader sees an ended job
    whose incident still says ACTING."""
    from controller.launcher import LaunchStatus
    from vigil.contract.schemas import JobStatus

    env.steps(1, 3)
    env.monitor.step()
    env.alive[1] = False
    env.heartbeats()
    env.monitor.step()
    assert [i["status"] for i in env.incidents()] == ["ACTING"]
    env.launcher.statuses[f"fake-{env.job_id}"] = LaunchStatus(JobStatus.SUCCEEDED)
    env.client.app.state.supervisor.step()  # no monitor pass in between
    assert env.client.get(f"{API}/jobs/{env.job_id}").json()["status"] == "SUCCEEDED"
    assert [i["status"] for i in env.incidents()] == ["RECOVERED"]


def test_node_lost_after_heartbeat_timeout(env: Env) -> None:
    env.steps(1, 5)
    env.monitor.step()
    env.clock.now += 2.5
    env.heartbeats(["vigil-node-1"])  # node 2 falls silent
    env.monitor.step()
    assert env.incidents() == []
    env.clock.now += 2.5
    env.heartbeats(["vigil-node-1"])
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["node_id"], i["rank"]) for i in inc] == [("node_lost", "vigil-node-2", 1)]
    assert inc[0]["evidence"]["heartbeat_age_s"] > 4 and inc[0]["status"] == "ACTING"
    nodes = {n["id"]: n["state"] for n in env.client.get(f"{API}/nodes").json()["data"]}
    assert nodes["vigil-node-2"] == "DEAD" and nodes["vigil-node-1"] == "ALIVE"


def test_a_restarted_controller_does_not_take_its_own_absence_for_lost_nodes_or_a_hang(env: Env) -> None:
    """The controller was down 30 s (no heartbeat, no step reached it); a new monitor starts: the nodes
    and ranks get a full timeout from its start to be heard again, and they are: no incident at all."""
    env.steps(1, 5)
    env.monitor.step()
    env.clock.now += 30.0  # the controller is down: nothing arrives
    restarted = Monitor(env.monitor.sessions, env.launcher, env.cluster, clock=env.clock)
    assert restarted.started_at == env.clock.now
    restarted.step()
    assert env.incidents() == []
    nodes = {n["id"]: n["state"] for n in env.client.get(f"{API}/nodes").json()["data"]}
    assert set(nodes.values()) == {"ALIVE"}
    env.clock.now += 2.0  # the agents reconnect and replay: steps and heartbeats resume
    env.steps(6, 8)
    restarted.step()
    assert env.incidents() == []
    # A node still silent a full timeout after the restart is lost, counted from the restart.
    env.clock.now += restarted.node_timeout_s + 0.5
    env.heartbeats(["vigil-node-1"])
    restarted.step()
    inc = [i for i in env.incidents() if i["kind"] == "node_lost"]
    assert [(i["node_id"], i["status"]) for i in inc] == [("vigil-node-2", "ACTING")]


def test_kill_rank_fault_fires_at_step_and_death_is_named(env: Env) -> None:
    env.steps(1, 3)
    r = env.client.post(f"{API}/jobs/{env.job_id}/faults",
                        json={"kind": "kill_rank", "rank": 1, "step": 5, "params": {"mode": "agent"}})
    assert r.status_code == 201
    env.monitor.step()
    assert env.commands("vigil-node-2") == []  # not yet at step 5
    env.steps(4, 5)
    env.monitor.step()
    cmds = env.commands("vigil-node-2")
    assert [(c["kind"], c["args"]["pid"]) for c in cmds] == [("kill_pid", 1001)]
    assert env.commands("vigil-node-1") == []
    assert env.client.get(f"{API}/jobs/{env.job_id}/faults").json()["data"][0]["status"] == "FIRED"
    # the agent carries it out; its next heartbeat shows the rank's process gone
    assert env.answer("vigil-node-2", cmds[0]["id"]) == {"stored": True}
    assert env.answer("vigil-node-2", cmds[0]["id"]) == {"stored": False}  # a repeat is ignored
    env.alive[1] = False
    env.heartbeats()
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["node_id"], i["rank"], i["evidence"]["pid"]) for i in inc] == [
        ("rank_died", "vigil-node-2", 1, 1001)]
    # Ray Train restarts the group: new pids, steps resume from the checkpoint at step 3
    env.pids = {0: 2000, 1: 2001}
    env.alive = {0: True, 1: True}
    env.clock.now += 8
    env.steps(4, 6)
    env.monitor.step()
    inc = env.incidents()[0]
    assert inc["status"] == "RECOVERED" and inc["recovered_at"] is not None
    job = env.client.get(f"{API}/jobs/{env.job_id}").json()
    assert job["status"] == "RUNNING"


def test_the_rank_that_died_first_is_named_not_the_ones_taken_down_after_it(env: Env) -> None:
    env.steps(1, 5)
    now = env.clock.now
    # rank 1 dies; Ray Train takes rank 0 down 2 s later; rank 0's node happens to report first
    body0 = {"agent_id": "agent-vigil-node-1", "node_id": "vigil-node-1", "seq": 900, "sent_at": now, "samples": [],
             "heartbeat": {"ts": now, "ranks": [{"job_id": env.job_id, "rank": 0, "pid": 1000, "alive": False,
                                                 "dead_since": now}]}}
    assert env.client.post(f"{API}/telemetry", json=body0).status_code == 200
    env.monitor.step()
    assert env.incidents() == []  # waits for the other agents' reports
    body1 = {"agent_id": "agent-vigil-node-2", "node_id": "vigil-node-2", "seq": 901, "sent_at": now, "samples": [],
             "heartbeat": {"ts": now, "ranks": [{"job_id": env.job_id, "rank": 1, "pid": 1001, "alive": False,
                                                 "dead_since": now - 2.0}]}}
    assert env.client.post(f"{API}/telemetry", json=body1).status_code == 200
    env.clock.now += 2.0
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["node_id"]) for i in inc] == [("rank_died", 1, "vigil-node-2")]
    assert inc[0]["evidence"]["also_dead"] == {"0": pytest.approx(now)}


def test_a_dead_pid_of_an_older_worker_group_is_never_named(env: Env) -> None:
    """After a restart, an agent may still list the old group's processes as dead (Vigil's own kill, a
    rollback, Ray Train's restart): those deaths predate the current group and open nothing; a death in
    the current group is named with its own pid."""
    env.steps(1, 5)
    old_death = env.clock.now
    env.clock.now += 3
    env.pids = {0: 2000, 1: 2001}  # the new group (the next run attempt) runs steps 4.. again
    env.steps(4, 8)
    assert env.attempt == 2

    def heartbeat(seq: int, new_alive: bool, dead_since: float) -> None:
        ranks = [{"job_id": env.job_id, "rank": 1, "pid": 1001, "alive": False, "dead_since": old_death},
                 {"job_id": env.job_id, "rank": 1, "pid": 2001, "alive": new_alive,
                  **({} if new_alive else {"dead_since": dead_since})}]
        body = {"agent_id": "agent-vigil-node-2", "node_id": "vigil-node-2", "seq": seq, "sent_at": env.clock.now,
                "samples": [], "heartbeat": {"ts": env.clock.now, "ranks": ranks}}
        assert env.client.post(f"{API}/telemetry", json=body).status_code == 200

    env.clock.now += 2  # longer than the death grace (1.5 s)
    env.heartbeats(["vigil-node-1"])
    heartbeat(950, True, 0.0)
    env.monitor.step()
    assert env.incidents() == []  # the stale pid 1001 is not a new death
    died = env.clock.now
    env.clock.now += 2
    env.heartbeats(["vigil-node-1"])
    heartbeat(951, False, died)
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["evidence"]["pid"]) for i in inc] == [("rank_died", 1, 2001)]


def test_a_restarted_controller_waits_for_agents_to_retry_before_judging_nodes_lost(env: Env) -> None:
    """An agent that found the controller down retries after its backoff (up to 10 s): after a
    (re)start the monitor gives silence ``reconnect_grace_s`` on top of the node timeout."""
    env.steps(1, 3)
    env.monitor.reconnect_grace_s = 11.0
    env.monitor.started_at = env.clock.now  # the controller (re)started now; the agents are silent since
    env.clock.now += 14.0  # 4 s node timeout + 11 s grace not over yet
    env.monitor.step()
    assert env.incidents() == []
    env.clock.now += 2.0
    env.monitor.step()
    assert sorted((i["kind"], i["node_id"]) for i in env.incidents()) == [
        ("node_lost", "vigil-node-1"), ("node_lost", "vigil-node-2")]


def test_an_action_whose_restart_never_comes_fails_and_detection_resumes(env: Env) -> None:
    """Vigil acted (rank 1 died: Ray Train restarts the group) but the group never comes back: after
    the acting timeout the incident is FAILED, not left ACTING for ever muting the detectors, and the
    job is judged afresh (no step for that long: a hang)."""
    env.steps(1, 5)
    env.alive[1] = False
    env.heartbeats()
    env.clock.now += 2
    env.heartbeats()
    env.monitor.step()
    (died,) = env.incidents()
    assert (died["kind"], died["status"]) == ("rank_died", "ACTING")
    for _ in range(19):  # 190 s of heartbeats and no step
        env.clock.now += 10
        env.heartbeats()
        env.monitor.step()
    inc = {i["kind"]: i for i in env.incidents()}
    assert inc["rank_died"]["status"] == "FAILED" and "no step within 180 s" in inc["rank_died"]["action"]
    assert "hang" in inc  # judged afresh
    events = env.client.get(f"{API}/events", params={"job_id": env.job_id, "limit": 200}).json()["data"]
    assert any(e["kind"] == "incident_failed" for e in events)


def test_stragglers_and_nan_are_judged_on_the_current_attempt_only(env: Env) -> None:
    """Samples of the old group that arrive after a restart (late, or replayed by an agent) are not
    compared with the new group's: no straggler from the mix, no second NaN rollback."""
    env.steps(1, 30)
    env.monitor.step()
    env.pids = {0: 2000, 1: 2001}
    env.steps(21, 40)  # attempt 2: steps 21.. again, healthy
    # The old attempt's steps 31-40, slow on rank 0 and with a NaN loss, arrive only now.
    now = env.clock.now
    env.post([{"kind": "step", "job_id": env.job_id, "rank": 0, "step": st, "attempt": 1, "ts": now - 1,
               "loss": None, "step_time_s": 0.9, "fwd_bwd_s": 0.8, "comm_s": 0.01} for st in range(31, 41)],
             "vigil-node-1")
    env.steps(41, 45)
    env.monitor.step()
    assert env.incidents() == []


def test_hang_collects_stacks_names_odd_rank_and_evicts(env: Env) -> None:
    env.steps(1, 20)
    env.monitor.step()
    env.clock.now += 16  # no progress for longer than the 15 s floor
    env.heartbeats()
    env.monitor.step()
    inc = env.incidents()
    assert [i["kind"] for i in inc] == ["hang"] and inc[0]["rank"] is None
    dumps = {n: env.commands(n) for n in ("vigil-node-1", "vigil-node-2")}
    assert all(len(c) == 1 and c[0]["kind"] == "pyspy_dump" for c in dumps.values())
    waiting = ('Thread 0x1 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2800)\n'
               "    all_reduce (vigil/comm.py:90)\n    step (vigil/optim/adamw.py:40)\n    train (vigil/loop.py:200)\n")
    stopped = ('Thread 0x1 (idle): "MainThread"\n    forward (vigil/model.py:120)\n    _call_impl (torch/nn/modules/'
               "module.py:1700)\n    train (vigil/loop.py:190)\n")
    env.answer("vigil-node-1", dumps["vigil-node-1"][0]["id"], output={"stacks": {"0": waiting}})
    env.answer("vigil-node-2", dumps["vigil-node-2"][0]["id"],
               output={"stacks": {"1": stopped}, "states": {"1": "stopped"}})
    env.monitor.step()
    inc = env.incidents()[0]
    assert inc["rank"] == 1 and inc["node_id"] == "vigil-node-2" and inc["evidence"]["odd_ranks"] == [1]
    assert inc["status"] == "ACTING"
    assert env.cluster.drained == [("vigil-node-2", 5.0)]
    kills = [c for c in env.commands("vigil-node-2") if c["kind"] == "kill_pid"]
    assert [c["args"]["pid"] for c in kills] == [1001]
    stacks = env.client.get(f"{API}/jobs/{env.job_id}/stacks").json()
    assert stacks["odd_ranks"] == [1] and set(stacks["stacks"]) == {"0", "1"}
    assert {n["id"]: n["state"] for n in env.client.get(f"{API}/nodes").json()["data"]}["vigil-node-2"] == "EVICTED"


def test_persistent_compute_straggler_is_named_and_evicted(env: Env) -> None:
    env.steps(1, 20)
    env.steps(21, 24, compute={1: 0.15})  # 4 slow steps: not persistent yet
    env.monitor.step()
    assert env.incidents() == []
    env.steps(25, 32, compute={1: 0.15})
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["node_id"], i["evidence"]["class"]) for i in inc] == [
        ("straggler", 1, "vigil-node-2", "compute-slow")]
    assert inc[0]["evidence"]["median_ratio_to_peers"] == pytest.approx(3.0)
    assert inc[0]["evidence"]["ratio_to_own_history"] == pytest.approx(3.0)
    assert env.cluster.drained == [("vigil-node-2", 5.0)]


@pytest.mark.parametrize("env", [{"checkpoint": {"interval_steps": 100}}], indirect=True)
def test_checkpoint_shadow_is_not_scored_until_the_checkpoint_completed(env: Env) -> None:
    env.steps(1, 100)
    at_100 = env.clock.now
    env.steps(101, 115, compute={1: 0.15})  # rank 1 busy right after the checkpoint at step 100
    env.monitor.step()
    assert env.incidents() == []  # in the shadow: the checkpoint is not known complete
    env.post([{"kind": "checkpoint", "job_id": env.job_id, "rank": 0, "step": 100, "ts": at_100 + 0.1,
               "path": checkpoint_path(env.client.app, env.job_id, 100), "world_size": 2}], "vigil-node-1")
    env.monitor.step()  # complete at step 100 + 0.1 s: steps from 0.35 s on are scored, the newest 10: 106..115
    inc = env.incidents()
    assert [(i["kind"], i["rank"]) for i in inc] == [("straggler", 1)]
    assert inc[0]["evidence"]["steps"] == [106, 115]


@pytest.mark.parametrize("env", [{"checkpoint": {"interval_steps": 100}}], indirect=True)
def test_the_steps_before_the_first_checkpoint_are_scored(env: Env) -> None:
    # No checkpoint is taken at step 0: steps 1-33 are no checkpoint's shadow (they once went unscored, so a
    # fault-free baseline before an early slowdown lost a third of its steps).
    env.steps(1, 10)
    env.steps(11, 25, compute={1: 0.15})
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"]) for i in inc] == [("straggler", 1)] and inc[0]["evidence"]["steps"][1] == 25


def test_an_invalid_checkpoint_stays_on_record_after_its_folder_is_written_again(env: Env) -> None:
    ck = {"kind": "checkpoint", "job_id": env.job_id, "rank": 0, "step": 30, "ts": env.clock.now,
          "path": checkpoint_path(env.client.app, env.job_id, 30), "world_size": 2}
    env.post([ck], "vigil-node-1")
    env.post([{**ck, "valid": False, "message": "checksum mismatch in __0_0.distcp"}], "vigil-node-1")
    env.post([{**ck, "ts": env.clock.now + 5}], "vigil-node-1")  # the replay saves step 30 again
    rows = env.client.get(f"{API}/jobs/{env.job_id}/checkpoints").json()["data"]
    assert [(c["step"], c["valid"]) for c in rows] == [(30, True)]
    events = [e for e in env.client.get(f"{API}/events").json()["data"] if e["kind"] == "checkpoint_invalid"]
    assert [(e["data"]["step"], e["data"]["reason"]) for e in events] == [(30, "checksum mismatch in __0_0.distcp")]


def test_a_rank_slowed_by_a_cotenant_on_its_cpu_is_no_straggler(env: Env) -> None:
    # Rank 1's forward+backward doubles, and it spent the extra time waiting for a CPU another process held
    # (its run-queue wait): its host's load, not the rank. Then the same slowdown with no such wait is named.
    env.steps(1, 20, cpu_wait={0: 0.001, 1: 0.001})
    for st in range(21, 41):
        env.steps(st, st, compute={1: 0.105}, cpu_wait={0: 0.001, 1: 0.055})
        env.monitor.step()
    assert env.incidents() == []
    for st in range(41, 61):
        env.steps(st, st, compute={1: 0.105}, cpu_wait={0: 0.001, 1: 0.001})
        env.monitor.step()
    assert [(i["kind"], i["rank"]) for i in env.incidents()] == [("straggler", 1)]


def test_a_2x_slower_rank_is_a_straggler_within_20_steps(env: Env) -> None:
    env.steps(1, 20)
    for st in range(21, 41):
        env.steps(st, st, compute={1: 0.105})  # 2.1x its peer and its own past
        env.monitor.step()
        if env.incidents():
            break
    inc = env.incidents()
    assert [(i["kind"], i["rank"]) for i in inc] == [("straggler", 1)]
    assert inc[0]["evidence"]["steps"][1] - 20 <= 20


def test_rank_always_behind_its_peers_is_an_imbalance_not_a_straggler(env: Env) -> None:
    for chunk in range(6):
        env.steps(chunk * 10 + 1, chunk * 10 + 10, compute={1: 0.09})  # 1.8x its peer from the start
        env.monitor.step()
    assert env.incidents() == []


def test_scheduling_noise_on_a_tiny_compute_is_not_a_straggler(env: Env) -> None:
    env.steps(1, 30, compute={0: 0.003, 1: 0.003})
    env.steps(31, 45, compute={0: 0.02, 1: 0.003})  # 7x, but 17 ms on a 200 ms step: a busy host
    env.monitor.step()
    assert env.incidents() == []


def test_noisy_but_not_persistent_rank_is_not_a_straggler(env: Env) -> None:
    for st in range(1, 60):
        env.steps(st, st, compute={st % 2: 0.12})  # each rank slow every other step
        env.monitor.step()
    assert env.incidents() == []


def test_nan_loss_rolls_back_every_rank(env: Env) -> None:
    env.steps(1, 10)
    env.steps(11, 11, loss=None)
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["evidence"]["step"]) for i in inc] == [("nan_loss", 11)]
    killed = sorted(c["args"]["pid"] for n in ("vigil-node-1", "vigil-node-2") for c in env.commands(n)
                    if c["kind"] == "kill_pid")
    assert killed == [1000, 1001]


def test_steps_of_code_that_reports_no_loss_are_not_a_nan(env: Env) -> None:
    """A torchrun script or a Ray Train function stepped by its optimizer reports no loss at all: no
    nan_loss (it was one before: a plain script was rolled back for ever); a rank that reported a loss
    and then none still is."""
    env.steps(1, 30, loss=None)
    env.monitor.step()
    assert [i["kind"] for i in env.incidents()] == []
    env.steps(31, 40)
    env.steps(41, 41, loss=None)
    env.monitor.step()
    assert [(i["kind"], i["evidence"]["step"]) for i in env.incidents()] == [("nan_loss", 41)]


def test_a_loss_reported_every_20th_step_leaves_the_steps_between_alone(env: Env) -> None:
    """A Ray Train function reports its loss (ray.train.report) at its checkpoint steps only: the steps
    between carry none, and that is not a NaN, neither in the window nor from the job's history."""
    for first in range(1, 120, 20):
        env.steps(first, first + 18, loss=None)
        env.steps(first + 19, first + 19)
        env.monitor.step()
    env.steps(121, 200, loss=None)  # a window with no loss at all, after the sparse ones
    env.monitor.step()
    assert [i["kind"] for i in env.incidents()] == []


def test_no_progress_across_restarts_fails_the_job(env: Env) -> None:
    env.steps(1, 10)
    for attempt in range(3):
        env.steps(11, 11, loss=None)  # NaN again at the same step, every time
        env.monitor.step()
        env.clock.now += 10
        env.steps(8, 10)  # restart from the checkpoint at step 7, no further
        env.monitor.step()
    job = env.client.get(f"{API}/jobs/{env.job_id}").json()
    assert job["status"] == "FAILED" and "no progress across 2 restarts" in job["message"]
    assert env.launcher.stopped == [f"fake-{env.job_id}"]


def test_restarts_after_which_a_newer_checkpoint_was_reported_are_progress(env: Env) -> None:
    """Progress is the point a restart resumes from moving forward (vigil/contract/restarts.py: for a Ray
    Train group, the newest valid checkpoint): a newer checkpoint before each NaN, and the job runs on
    after as many restarts as the test above failed it at."""
    env.steps(1, 10)
    for attempt in range(3):
        at = 10 * (attempt + 1)
        env.post([{"kind": "checkpoint", "job_id": env.job_id, "rank": 0, "step": at, "ts": env.clock.now,
                   "path": checkpoint_path(env.client.app, env.job_id, at), "world_size": 2}], "vigil-node-1")
        env.steps(at + 1, at + 1, loss=None)  # NaN right after the checkpoint
        env.monitor.step()
        env.clock.now += 10
        env.steps(at + 1, at + 10)  # restart from that checkpoint, on to the next one
        env.monitor.step()
    job = env.client.get(f"{API}/jobs/{env.job_id}").json()
    assert job["status"] == "RUNNING", job["message"]
    with env.monitor.sessions() as s:
        row = s.get(Job, env.job_id)
        assert row is not None and (row.restarts, row.stalled_restarts, row.progress_mark) == (3, 0, 30)
    assert [i["status"] for i in env.incidents()] == ["RECOVERED"] * 3
