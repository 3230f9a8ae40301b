"""Attacks through the fault-injection API: a fault must never hurt the cluster beyond its own job.

Findings (issue 23): ``{"kind": "slow_rank", "params": {"factor": 2, "period_s": "x"}}`` was accepted and then
raised in every monitor pass, for every job (a rank killed afterwards was restarted by Ray but its incident
stayed ACTING for good); ``kill_node`` naming the Ray head was carried out (the head holds the GCS and every
job's driver); a fault could name any node, one running none of the job's ranks. Each test here failed on the
code before the fix. The controller is the real app and database; agents and Ray are played by the test.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from controller.db import session_scope
from controller.models import Fault
from tests.controller.recovery_env import API, Env


def _faults(env: Env) -> list[dict]:
    return env.client.get(f"{API}/jobs/{env.job_id}/faults").json()["data"]


@pytest.mark.parametrize(
    ("params", "kind", "field", "rule"),
    [
        ({"factor": 2, "period_s": "x"}, "slow_rank", "params.period_s", "valid number"),
        ({"factor": 2, "period_s": 0}, "slow_rank", "params.period_s", "greater than or equal to 0.005"),
        ({"factor": True}, "slow_rank", "params.factor", "valid number"),
        ({"factor": 1e9}, "slow_rank", "params.factor", "less than or equal to 100"),
        ({"factor": 2, "sleep": 5}, "slow_rank", "params.sleep", "takes no parameter 'sleep'"),
        ({"mode": "agent; rm -rf /"}, "kill_rank", "params.mode", "'rank' or 'agent'"),
        ({"pid": 1}, "hang_rank", "params.pid", "takes no parameter 'pid'"),
        ({"pid": 1}, "nan_loss", "params.pid", "its parameters: none"),
        ({"fraction": 0}, "degrade_nic", "params.fraction", "greater than 0"),
        ({"percent": 101}, "nic_loss", "params.percent", "less than or equal to 100"),
        ({"delay_ms": "10ms"}, "nic_latency", "params.delay_ms", "valid number"),
        ({"times": 10_000}, "flap_nic", "params.times", "less than or equal to 100"),
        ({"seconds": -1}, "partition_node", "params.seconds", "greater than 0"),
        ({"dev": "lo"}, "partition_node", "params.dev", "takes no parameter 'dev'"),
    ],
)
def test_a_fault_parameter_of_the_wrong_type_or_range_is_422_naming_it_and_stores_nothing(
    env: Env, params: dict, kind: str, field: str, rule: str
) -> None:
    target = {"rank": 0} if kind in ("slow_rank", "kill_rank", "hang_rank", "nan_loss") else {"node_id": "vigil-node-1"}
    r = env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": kind, **target, "params": params})
    assert r.status_code == 422, r.text
    assert field in r.text and rule in r.text, r.text
    assert _faults(env) == []


def test_a_stored_fault_that_cannot_be_carried_out_fails_alone_and_the_monitor_goes_on(env: Env) -> None:
    """A fault row the API would refuse today (stored by an older controller, or written around the API) is
    marked FAILED with the reason; the fault beside it fires and detection goes on in the same pass."""
    env.steps(1, 5)
    with session_scope(env.monitor.sessions) as s:
        s.add(Fault(job_id=env.job_id, kind="slow_rank", rank=1, step=0, status="PENDING",
                    params={"factor": 2, "period_s": "x"}))
    ok = env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "hang_rank", "rank": 1, "step": 0,
                                                                  "params": {"mode": "agent"}})
    assert ok.status_code == 201, ok.text
    env.alive[0] = False  # and rank 0 dies: its incident must still be opened by this pass
    env.heartbeats()
    env.monitor.step()
    by_kind = {f["kind"]: f for f in _faults(env)}
    assert by_kind["slow_rank"]["status"] == "FAILED" and "cannot be carried out" in by_kind["slow_rank"]["message"]
    assert by_kind["hang_rank"]["status"] == "FIRED"
    assert [c["kind"] for c in env.commands("vigil-node-2")] == ["stop_pid"]
    assert [i["kind"] for i in env.incidents()] == ["rank_died"]
    env.monitor.step()  # and the next pass runs as well
    with session_scope(env.monitor.sessions) as s:
        assert s.scalar(select(Fault.status).where(Fault.kind == "slow_rank")) == "FAILED"


def test_kill_node_never_targets_the_ray_head(env: Env) -> None:
    env.steps(1, 3)
    r = env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "kill_node", "node_id": "vigil-node-0"})
    assert r.status_code == 409 and "node_id" in r.text, r.text
    # Named by a rank that runs on the head: refused when it fires, nothing sent to the head's agent.
    env.cluster.head = "vigil-node-1"
    r = env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "kill_node", "rank": 0})
    assert r.status_code == 201, r.text
    env.monitor.step()
    (f,) = _faults(env)
    assert f["status"] == "FAILED" and "Ray head" in f["message"], f
    assert [c for c in env.commands("vigil-node-1") if c["kind"] == "kill_node"] == []


def test_a_fault_acts_only_on_a_node_that_runs_the_job(env: Env) -> None:
    env.steps(1, 3)  # ranks on vigil-node-1 and vigil-node-2
    for kind in ("kill_node", "partition_node", "degrade_nic"):
        r = env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": kind, "node_id": "vigil-node-0"})
        assert r.status_code == 409 and "holds no rank of job" in r.text, r.text
    assert _faults(env) == []
    # Created before the ranks were placed (nothing to check then): refused when it fires.
    env.nodes = {0: "vigil-node-1", 1: "vigil-node-1"}
    env.client.post(f"{API}/jobs/{env.job_id}/faults", json={"kind": "nic_loss", "node_id": "vigil-node-2",
                                                            "step": 4})
    env.steps(4, 5)
    with session_scope(env.monitor.sessions) as s:  # the node's stale heartbeat listed the job's ranks: gone now
        from controller.models import Node

        s.get(Node, "vigil-node-2").ranks = []
    env.monitor.step()
    (f,) = _faults(env)
    assert f["status"] == "FAILED" and "holds no rank of job" in f["message"], f
    assert [c for c in env.commands("vigil-node-2") if c["kind"] == "shape_nic"] == []
