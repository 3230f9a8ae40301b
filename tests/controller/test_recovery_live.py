"""Hang stacks, collective waits and live (torchft) recovery, driven one monitor step at a time (the rig:
tests/controller/recovery_env.py; detection itself: test_recovery.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

import pytest

from controller.launcher import LaunchStatus
from controller.models import Job
from controller.recovery import facts
from controller.recovery.detectors import Finding, Stage
from controller.recovery.stacks import group_stacks, signature
from tests.controller.recovery_env import Env
from vigil.contract.schemas import IncidentKind, JobCreate, JobStatus


def test_stack_signature_and_grouping() -> None:
    a = 'Thread 0x1 (idle): "MainThread"\n    wait (gloo.py:1)\n    all_reduce (comm.py:2)\nThread 0x2 (idle): "x"\n'
    b = 'Thread 0x1 (active): "MainThread"\n    forward (model.py:3)\n'
    assert signature(a) == "wait (gloo.py) < all_reduce (comm.py)"
    groups, odd = group_stacks({0: a, 1: a, 2: b, 3: a})
    assert odd == [2] and groups[0].ranks == [0, 1, 3]
    assert group_stacks({0: a, 1: b})[1] == [1]  # no majority: the rank outside a collective
    assert group_stacks({0: a, 1: a})[1] == []


def _synced_steps(env: Env, first: int, last: int, late: dict[int, float] | None = None) -> None:
    """Two ranks stepping together: 0.09 s of work and one 0.01 s all-reduce each; a rank ``late`` by
    L s (its data loading, say: compute unchanged) makes its peer wait L inside the all-reduce."""
    late = late or {}
    for st in range(first, last + 1):
        env.clock.now += 0.2
        lag = max(late.values(), default=0.0)
        for rank, node in env.nodes.items():
            own = late.get(rank, 0.0)
            wait = lag - own  # the last to arrive waits for no one
            env.post([
                {"kind": "step", "job_id": env.job_id, "rank": rank, "step": st, "ts": env.clock.now, "loss": 3.0,
                 "step_time_s": 0.1 + lag, "data_s": 0.02 + own, "fwd_bwd_s": 0.05, "optim_s": 0.02,
                 "comm_s": 0.01 + wait},
                {"kind": "collective", "job_id": env.job_id, "rank": rank, "step": st, "seq": 0, "op": "all_reduce",
                 "tag": "grads", "payload_bytes": 4000, "wire_bytes": 4000, "duration_s": 0.01 + wait,
                 "ts": env.clock.now}], node)


def test_a_rank_its_peers_wait_for_is_a_straggler_on_collective_wait(env: Env) -> None:
    _synced_steps(env, 1, 30)
    env.monitor.step()
    for st in range(31, 51):
        _synced_steps(env, st, st, late={1: 0.1})  # data loading 0.1 s slower: compute unchanged
        env.monitor.step()
        if env.incidents():
            break
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["node_id"]) for i in inc] == [("straggler", 1, "vigil-node-2")]
    ev = inc[0]["evidence"]
    assert ev["basis"] == "collective-wait" and ev["class"] == "compute-slow"
    assert ev["peers_wait_s"] == pytest.approx(0.1, abs=1e-3)
    assert ev["median_ratio_to_peers"] == pytest.approx(0.19 / 0.09, abs=1e-3)  # its work over its peer's
    assert ev["steps"][1] - 30 <= 20
    assert env.cluster.drained == [("vigil-node-2", 5.0)]


def test_waits_that_change_sides_are_not_a_straggler(env: Env) -> None:
    _synced_steps(env, 1, 30)
    for st in range(31, 71):
        _synced_steps(env, st, st, late={st % 2: 0.1})  # each rank late every other step
        env.monitor.step()
    _synced_steps(env, 71, 90, late={1: 0.02})  # late every step, but by 20 ms: scheduling noise
    env.monitor.step()
    assert env.incidents() == []


def _rank_steps(env: Env, rank: int, first: int, last: int, dt: float = 0.2) -> None:
    """Only ``rank`` reports steps first..last (live recovery: the survivors step without the others)."""
    for st in range(first, last + 1):
        env.clock.now += dt
        env.post([{"kind": "step", "job_id": env.job_id, "rank": rank, "step": st, "attempt": env.attempt,
                   "ts": env.clock.now, "loss": 3.0, "step_time_s": 0.2, "fwd_bwd_s": 0.05, "comm_s": 0.01}],
                 env.nodes[rank])
    env.heartbeats()


def _rank_1_dies(env: Env) -> None:
    """Rank 1's process is gone (its agent says so twice, 2 s apart); the monitor's pass finds it."""
    env.alive[1] = False
    env.heartbeats()
    env.clock.now += 2
    env.heartbeats()
    env.monitor.step()


def _replaced(env: Env, alone: range) -> None:
    """Rank 0 steps ``alone`` (the incident still ACTING after), then rank 1, in a new process, steps again
    after a pause of its own: RECOVERED."""
    _rank_steps(env, 0, alone.start, alone.stop - 1)
    env.monitor.step()
    assert env.incidents()[0]["status"] == "ACTING"
    env.pids[1], env.alive[1] = 2001, True
    env.clock.now += 4
    _rank_steps(env, 1, alone.stop, alone.stop)
    env.monitor.step()
    assert env.incidents()[0]["status"] == "RECOVERED"


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_live_a_rank_silent_while_its_peers_step_is_a_hang_its_replica_alone_is_replaced(env: Env) -> None:
    env.steps(1, 20)
    env.monitor.step()
    _rank_steps(env, 0, 21, 60)  # 8 s: rank 1 silent, rank 0 trains on (under the 15 s floor)
    env.monitor.step()
    assert env.incidents() == []
    _rank_steps(env, 0, 61, 100)  # 16 s
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["node_id"]) for i in inc] == [("hang", 1, "vigil-node-2")]
    dumps = {n: env.commands(n) for n in ("vigil-node-1", "vigil-node-2")}
    training = 'Thread 0x1 (idle): "MainThread"\n    forward (model.py:120)\n    train (train.py:190)\n'
    env.answer("vigil-node-1", dumps["vigil-node-1"][0]["id"], output={"stacks": {"0": training}})
    env.answer("vigil-node-2", dumps["vigil-node-2"][0]["id"], output={"stacks": {"1": training}})
    env.monitor.step()
    inc = env.incidents()[0]
    # Stacks alike (no odd rank out): the rank found silent on its own is the suspect, and only it is killed;
    # nothing is evicted, the survivors are not touched.
    assert inc["status"] == "ACTING" and inc["action"].startswith("live: killed hung rank(s) [1]")
    assert [c["args"]["pid"] for c in env.commands("vigil-node-2") if c["kind"] == "kill_pid"] == [1001]
    assert env.commands("vigil-node-1") == [] or all(c["kind"] != "kill_pid" for c in env.commands("vigil-node-1"))
    assert env.cluster.drained == []
    # Rank 0's quorum pause is not the replacement; rank 1 stepping again after its gap is.
    _replaced(env, range(101, 106))


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_live_a_dead_rank_is_left_to_ray_and_recovered_when_its_replacement_steps(env: Env) -> None:
    env.steps(1, 10)
    _rank_1_dies(env)
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["status"]) for i in inc] == [("rank_died", 1, "ACTING")]
    assert "heals from a live peer" in inc[0]["action"]
    assert not any(c["kind"] == "kill_pid" for n in ("vigil-node-1", "vigil-node-2") for c in env.commands(n))
    _replaced(env, range(11, 21))


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_live_a_straggler_is_replaced_away_from_its_node_and_its_old_steps_do_not_name_it_again(env: Env) -> None:
    env.steps(1, 20)
    env.steps(21, 32, compute={1: 0.15})
    env.monitor.step()
    inc = env.incidents()
    assert [(i["kind"], i["rank"], i["status"]) for i in inc] == [("straggler", 1, "ACTING")]
    assert env.cluster.drained == [("vigil-node-2", 5.0)]
    assert [c["args"]["pid"] for c in env.commands("vigil-node-2") if c["kind"] == "kill_pid"] == [1001]
    _rank_steps(env, 0, 33, 50)  # rank 0 trains on while Ray starts rank 1 again on another node
    env.nodes[1], env.pids[1] = "vigil-node-3", 2001
    env.steps(51, 53)  # back, at its peer's pace
    env.monitor.step()
    assert env.incidents()[0]["status"] == "RECOVERED"
    # Rank 1's slow steps of its old process share the run attempt with the new one's; they are not
    # scored again once it is back (before: a second straggler, and a second node evicted).
    env.monitor.step()
    assert len(env.incidents()) == 1 and len(env.cluster.drained) == 1


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live", "max_restarts": 2}}], indirect=True)
def test_the_facts_count_a_restart_from_where_it_resumed(env: Env) -> None:
    """controller/recovery/facts.py, on the database: a live replica's restart resumes from the job's newest
    step (it heals from its peers), a NaN rollback from the newest valid checkpoint; progress is that point
    moving past the job's mark (vigil/contract/restarts.py), and the restarts in a row without it count up."""
    env.steps(1, 20)
    with env.monitor.sessions() as s:
        job = s.get(Job, env.job_id)
        assert job is not None
        spec = JobCreate.model_validate(job.spec)
        died = Finding(IncidentKind.RANK_DIED, job.id, "vigil-node-2", 1, {}, stage=Stage.RESUMED, incident_id=1)
        first = facts.gather(s, env.cluster, job, spec, died)
        assert (first.resume_point, first.restarts, first.progressed, first.stalled_restarts) == (20, 1, True, 0)
        job.progress_mark, job.restarts = 20, 1
        again = facts.gather(s, env.cluster, job, spec, died)  # no step since: no progress
        assert (again.resume_point, again.restarts, again.progressed, again.stalled_restarts) == (20, 2, False, 1)
        rollback = facts.gather(s, env.cluster, job, spec, replace(died, kind=IncidentKind.NAN_LOSS))
        assert (rollback.resume_point, rollback.progressed) == (-1, False)  # no checkpoint yet
        # A finding on the Ray head: the fact, and the refusal the policy hands on.
        slow = Finding(IncidentKind.STRAGGLER, job.id, "vigil-node-0", None, {})
        head = facts.gather(s, env.cluster, job, spec, slow)
        assert head.head and head.room and "is the Ray head" in head.refusal
        assert facts.gather(s, env.cluster, job, spec, replace(slow, node_id="vigil-node-2")) == facts.Facts(
            recovering=False, head=False, room=True, refusal="", restarts=1, stalled_restarts=0)


def _collective(env: Env, rank: int, step: int, op: str, tag: str, payload: int, duration_s: float) -> None:
    env.post([{"kind": "collective", "job_id": env.job_id, "rank": rank, "step": step, "attempt": env.attempt,
               "seq": 10_000, "op": op, "tag": tag, "payload_bytes": payload, "wire_bytes": 0,
               "duration_s": duration_s, "ts": env.clock.now}], env.nodes[rank])


@pytest.mark.parametrize("heal_tag", ["live", "spare"])
@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_live_recovery_is_kept_as_a_timeline_of_its_phases(env: Env, heal_tag: str) -> None:
    """controller/recovery/heal_timeline.py: once RECOVERED, a live incident's evidence holds each phase with
    its time from the detection, read back from what the ranks reported: the survivor's quorum re-formed
    without the dead replica (before the detection: its failed all-reduce came first), the replacement's
    heal (bytes, seconds), the first step every rank reported, the recovery."""
    env.steps(1, 10)
    env.clock.now += 0.5
    _collective(env, 0, 11, "quorum", "reform", 0, 0.4)  # rank 0's all-reduce failed: a quorum without rank 1
    quorum_at = env.clock.now
    _rank_1_dies(env)
    (inc,) = env.incidents()
    detected = datetime.fromisoformat(inc["detected_at"]).timestamp()
    _rank_steps(env, 0, 11, 20)  # rank 0 trains on alone
    env.monitor.step()
    env.pids[1], env.alive[1] = 2001, True
    env.clock.now += 3
    _collective(env, 1, 21, "heal", heal_tag, 123_456, 1.5)  # healed at step 20, recorded under step 21
    healed_at = env.clock.now
    env.clock.now += 1
    env.steps(21, 22)
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["status"] == "RECOVERED"
    timeline = inc["evidence"]["timeline"]
    assert [p["phase"] for p in timeline] == ["quorum_without", "detected", "acted", "heal_started", "healed",
                                              "first_step_together", "recovered"]
    at = {p["phase"]: p for p in timeline}
    assert at["detected"]["after_s"] == 0 and at["quorum_without"]["after_s"] == pytest.approx(quorum_at - detected,
                                                                                                 abs=1e-3)
    assert at["quorum_without"]["after_s"] < 0 and "0.40 s" in at["quorum_without"]["detail"]
    assert at["healed"]["ts"] == pytest.approx(healed_at, abs=1e-3)
    assert at["healed"]["ts"] - at["heal_started"]["ts"] == pytest.approx(1.5, abs=1e-3)
    assert "123456 bytes" in at["healed"]["detail"] and "from step 20" in at["healed"]["detail"]
    assert "step 21: all 2 ranks" in at["first_step_together"]["detail"]
    assert ("a warm spare" in at["heal_started"]["detail"]) == (heal_tag == "spare")  # recovery.spares: who took over
    assert at["first_step_together"]["ts"] == pytest.approx(healed_at + 1.2, abs=1e-3)  # step 21, 0.2 s after


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_timeline_missing_the_survivors_step_is_read_again_when_it_arrives(env: Env) -> None:
    """Each rank's records come through its own node's agent: the pass that sees the replaced rank step may
    come before the survivor's rows of that step are stored (the e2e live-hang test, once in five runs). The
    timeline then lacks first_step_together; a later pass (heal_timeline.settle) adds it."""
    env.steps(1, 10)
    _rank_1_dies(env)
    _rank_steps(env, 0, 11, 20)
    env.monitor.step()
    env.pids[1], env.alive[1] = 2001, True
    env.clock.now += 3
    _collective(env, 1, 21, "heal", "live", 1000, 0.5)
    _rank_steps(env, 1, 21, 22)  # rank 1's rows are in; rank 0's steps 21-22 are still on their way
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["status"] == "RECOVERED"
    assert "first_step_together" not in {p["phase"] for p in inc["evidence"]["timeline"]}
    _rank_steps(env, 0, 21, 22)
    env.monitor.step()
    (inc,) = env.incidents()
    phases = {p["phase"]: p for p in inc["evidence"]["timeline"]}
    assert "step 21: all 2 ranks" in phases["first_step_together"]["detail"]


@pytest.mark.parametrize("env", [{"recovery": {"policy": "evict_restart"}}], indirect=True)
def test_a_restart_recovery_has_no_heal_timeline(env: Env) -> None:
    env.steps(1, 10)
    _rank_1_dies(env)
    env.alive[1], env.pids[1] = True, 2001
    env.clock.now += 5
    env.steps(5, 12)  # the group restarted from a checkpoint
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["status"] == "RECOVERED" and "timeline" not in inc["evidence"]


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_live_job_that_finishes_before_the_replacement_trains_is_not_a_recovery(env: Env) -> None:
    """Issue 27: a rank killed by hand whose replacement never rejoined before the survivor finished was
    marked RECOVERED because the job SUCCEEDED. Under live the survivors finish on their own: CLOSED, saying so."""
    env.steps(1, 10)
    _rank_1_dies(env)
    _rank_steps(env, 0, 11, 30)  # rank 0 trains on alone and runs the last step
    assert env.incidents()[0]["status"] == "ACTING"
    env.launcher.statuses[f"fake-{env.job_id}"] = LaunchStatus(JobStatus.SUCCEEDED)
    env.client.app.state.supervisor.step()
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["status"] == "CLOSED" and inc["recovered_at"] is None
    assert inc["action"].endswith("the job finished before rank 1's replacement trained with the others")


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_replacement_that_stepped_just_before_the_job_ended_is_a_recovery(env: Env) -> None:
    """The replacement trained with the survivor, but the job ended before a monitor pass saw it: RECOVERED
    at its first step back, as a pass in time would have found."""
    env.steps(1, 10)
    _rank_1_dies(env)
    _rank_steps(env, 0, 11, 20)
    env.pids[1], env.alive[1] = 2001, True
    env.clock.now += 4
    env.steps(21, 22)  # together again; then the job ends
    back = env.clock.now - 0.2
    env.launcher.statuses[f"fake-{env.job_id}"] = LaunchStatus(JobStatus.SUCCEEDED)
    env.client.app.state.supervisor.step()
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["status"] == "RECOVERED"
    assert datetime.fromisoformat(inc["recovered_at"]).timestamp() == pytest.approx(back, abs=1e-3)
    assert [p["phase"] for p in inc["evidence"]["timeline"]] == ["detected", "acted", "recovered"]  # no heal record


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_a_warm_spare_that_healed_before_the_detection_is_a_recovery(env: Env) -> None:
    """recovery.spares: the spare healed ~1 s after the kill, before the death was confirmed, and rank 1's
    steps never paused for LIVE_REJOIN_GAP_S: its heal record tells the replacement apart. A later death of
    the same rank is not answered by that earlier heal."""
    env.steps(1, 10)
    killed = env.clock.now
    _rank_1_dies(env)
    (inc,) = env.incidents()
    assert inc["status"] == "ACTING"
    now, env.clock.now = env.clock.now, killed + 1.0
    _collective(env, 1, 11, "heal", "spare", 1000, 0.3)  # before the detection
    env.clock.now = now
    env.pids[1], env.alive[1] = 2001, True
    env.steps(11, 12)  # both ranks, 0.2 s apart: rank 1's own gap from step 10 is ~2.2 s, under the 2.5 s rule
    env.monitor.step()
    (inc,) = env.incidents()
    assert inc["status"] == "RECOVERED"
    assert inc["evidence"]["timeline"][-1]["phase"] == "recovered"
    env.clock.now += 3
    env.steps(13, 14)
    _rank_1_dies(env)  # the spare's process dies too, within 10 s of its heal
    _rank_steps(env, 0, 15, 20)
    env.monitor.step()
    second = [i for i in env.incidents() if i["id"] != inc["id"]]
    assert [i["status"] for i in second] == ["ACTING"]  # no heal since: not recovered


def _processes(env: Env, node: str, procs: list[tuple[int, int, bool, float | None]]) -> None:
    """A heartbeat of ``node``'s agent listing ``procs``: (rank, pid, alive, dead_since)."""
    env.seq += 1
    ranks = [{"job_id": env.job_id, "rank": r, "pid": p, "alive": a, "dead_since": d} for r, p, a, d in procs]
    body = {"agent_id": f"agent-{node}", "node_id": node, "seq": env.seq, "sent_at": env.clock.now, "samples": [],
            "heartbeat": {"ts": env.clock.now, "hostname": node, "ranks": ranks}}
    assert env.client.post("/api/v1/telemetry", json=body).status_code == 200


@pytest.mark.parametrize("env", [{"recovery": {"policy": "live"}}], indirect=True)
def test_live_a_death_is_named_although_a_spare_on_its_node_already_runs_the_rank(env: Env) -> None:
    """A warm spare on the same node took rank 1 over before the death was named: its agent reports the rank's
    new process alive beside the former one, dead (agent/receiver.py). The death is an incident all the same
    (before, the live successor hid it: a kill with a fast spare left no incident), and a later death of
    rank 0, while rank 1's former process is still reported dead, is one of its own."""
    env.steps(1, 10)
    died = env.clock.now
    for _ in range(2):
        _processes(env, "vigil-node-2", [(1, 1001, False, died), (1, 2001, True, None)])
        env.clock.now += 1
    env.monitor.step()
    (inc,) = env.incidents()
    assert (inc["kind"], inc["rank"], inc["node_id"], inc["evidence"]["pid"]) == ("rank_died", 1, "vigil-node-2", 1001)
    _collective(env, 1, 11, "heal", "spare", 1000, 0.3)
    env.pids[1] = 2001
    env.steps(11, 12)
    env.monitor.step()
    assert env.incidents()[0]["status"] == "RECOVERED"
    env.clock.now += 5
    env.steps(13, 14)
    died = env.clock.now
    for _ in range(2):
        _processes(env, "vigil-node-1", [(0, 1000, False, died), (0, 3000, True, None)])
        _processes(env, "vigil-node-2", [(1, 1001, False, died - 7), (1, 2001, True, None)])
        env.clock.now += 1
    env.monitor.step()
    assert sorted((i["rank"], i["evidence"]["pid"]) for i in env.incidents()) == [(0, 1000), (1, 1001)]
