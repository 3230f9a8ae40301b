"""``recovery.policy: adapt`` on the controller (issue 26, point 3): a degraded link is answered by asking every
rank for ``recovery.adapt``'s setting (no restart), the switch the ranks report is recorded, the adapted pace
measured, the spec's own setting asked for again once the link is healthy, and the node evicted only when the
adapted job still costs more than an eviction would.

The real controller (SQLite) with its real monitor pieces; the ranks are played by posting what their agents
post (heartbeats naming them, their steps, their ``adapt`` reports)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controller.db import session_scope
from controller.models import Incident, Job
from controller.recovery import actions, adapt, policy
from controller.recovery.detectors import Finding
from controller.recovery.facts import Facts
from controller.recovery.nic import NicFinding
from tests.live_controller import LiveController, step_sample
from vigil.contract.schemas import (
    FaultSample,
    IncidentKind,
    IncidentStatus,
    JobCreate,
    JobStatus,
    RecoverySpec,
)

SPEC = {"optimizer": {"kind": "dsm", "params": {"tau": 12}},
        "recovery": {"policy": "adapt", "adapt": {"params": {"tau": 48}}}}


@pytest.fixture
def lc(tmp_path: Path) -> LiveController:
    with LiveController(tmp_path / "controller") as c:
        yield c


def _job(lc: LiveController, steps: int = 1000) -> str:
    job = lc.submit_job("adapt", steps=steps, **SPEC).id
    lc.set_job_status(job, JobStatus.RUNNING)
    lc.heartbeat("n1", [(job, 0, 100)])
    lc.heartbeat("n2", [(job, 1, 200)])
    return job


def _steps(lc: LiveController, job: str, steps: range, step_s: float, t0: float | None = None) -> None:
    """Each step ending ``step_s`` after the one before, from ``t0`` (default: 100 s ago; one call's steps)."""
    t0 = time.time() - 100 if t0 is None else t0
    for node, rank in (("n1", 0), ("n2", 1)):
        lc.post_batch(node, [step_sample(job, rank, st, ts=t0 + st * step_s, step_time_s=step_s, world_size=2)
                             for st in steps])
    lc.settle()
    lc.app.state.telemetry.flush()


def _switched(lc: LiveController, job: str, version: int, step: int) -> None:
    for node, rank in (("n1", 0), ("n2", 1)):
        lc.post_batch(node, [FaultSample(job_id=job, rank=rank, step=step, ts=time.time(), fault_id=version,
                                         fault_kind="adapt")])
    lc.settle()


def _degraded(lc: LiveController, job: str) -> int:
    """A NIC finding on n2 decided by the job's policy and carried out: the incident's id."""
    finding = Finding(IncidentKind.NIC_DEGRADED, job, "n2", None, {"class": "capacity"}, step=40)
    decision = policy.decide(finding, JobCreate.model_validate({"name": "x", **SPEC}).recovery, Facts())
    assert decision.action == policy.Action.ADAPT and "{'tau': 48}" in decision.reason
    with session_scope(lc.app.state.sessions) as s:
        inc = actions.carry_out(s, decision, finding, s.get(Job, job), cluster=None, launcher=None, deadline_s=1.0,
                                clock=time.time)
        assert inc is not None
        return inc.id


def _incident(lc: LiveController, inc_id: int) -> tuple[str, dict]:
    with session_scope(lc.app.state.sessions) as s:
        inc = s.get(Incident, inc_id)
        return inc.status, dict(inc.evidence["adapt"])


def _follow(lc: LiveController, job: str, flagged: bool, now: float, escalated: list[Finding]) -> list[NicFinding]:
    found = [NicFinding(IncidentKind.NIC_DEGRADED, "n2", None, "capacity")] if flagged else []
    with session_scope(lc.app.state.sessions) as s:
        j = s.get(Job, job)
        return adapt.follow(s, j, JobCreate.model_validate(j.spec), found, now, escalated.append)


def _adapt_writes(lc: LiveController) -> list[tuple[str, int, list[dict]]]:
    return [(r.node_id, r.args["rank"], r.args["fault"]["versions"]) for r in lc.command_rows().values()
            if r.kind == "write_fault_file" and r.args.get("file") == "adapt"]


def test_a_degraded_link_is_answered_with_the_adapted_setting_and_the_spec_comes_back_when_it_heals(
        lc: LiveController) -> None:
    job = _job(lc)
    _steps(lc, job, range(1, 41), 0.30)
    inc_id = _degraded(lc, job)
    status, a = _incident(lc, inc_id)
    assert status == IncidentStatus.OPEN.value and a["version"] == 1 and a["params"] == {"tau": 48}
    assert a["step_s_before"] == pytest.approx(0.30) and a["switched_step"] is None
    v1 = [{"version": 1, "params": {"tau": 48}}]
    assert sorted(_adapt_writes(lc)) == [("n1", 0, v1), ("n2", 1, v1)]  # every rank, on its own node
    # The ranks switch together at their checkpoint boundary and say so; the first report wins.
    _switched(lc, job, 1, 50)
    assert _incident(lc, inc_id)[1]["switched_step"] == 50
    assert [e.data["step"] for e in lc.events(job, "adapt_switched")] == [50]
    _steps(lc, job, range(41, 51), 0.30)
    _steps(lc, job, range(51, 71), 0.12)
    escalated: list[Finding] = []
    now = time.time()
    with session_scope(lc.app.state.sessions) as s:
        s.get(Job, job).last_step = 70
    left = _follow(lc, job, True, now, escalated)
    assert left == []  # the node's adaptation is followed, not found again
    status, a = _incident(lc, inc_id)
    assert a["step_s_after"] == pytest.approx(0.12) and a["eviction"]["worth"] is False and not escalated
    assert status == IncidentStatus.OPEN.value and a["revert"] is None
    # The link heals: after CLEAR_S without a NIC finding the spec's own setting is asked for.
    _follow(lc, job, False, now + 1, escalated)
    assert _incident(lc, inc_id)[1]["revert"] is None
    _follow(lc, job, False, now + 2 + adapt.CLEAR_S, escalated)
    a = _incident(lc, inc_id)[1]
    assert a["revert"]["version"] == 2 and a["revert"]["switched_step"] is None
    v2 = [*v1, {"version": 2, "params": {}}]
    assert sorted(w for w in _adapt_writes(lc) if len(w[2]) == 2) == [("n1", 0, v2), ("n2", 1, v2)]
    _switched(lc, job, 2, 80)
    status, a = _incident(lc, inc_id)
    assert status == IncidentStatus.CLOSED.value and a["revert"]["switched_step"] == 80


def test_a_link_flagged_again_before_the_clear_time_keeps_the_adapted_setting(lc: LiveController) -> None:
    job = _job(lc)
    _steps(lc, job, range(1, 41), 0.3)
    inc_id = _degraded(lc, job)
    now = time.time()
    _follow(lc, job, False, now, [])
    _follow(lc, job, True, now + adapt.CLEAR_S - 1, [])  # flagged again: the clock starts over
    _follow(lc, job, False, now + adapt.CLEAR_S + 1, [])
    assert _incident(lc, inc_id)[1]["revert"] is None


def test_still_slower_than_an_eviction_costs_the_node_is_evicted(lc: LiveController) -> None:
    """Healthy 0.1 s steps, 0.3 s on the sick link, 0.25 s adapted: 0.15 s x 900 steps left > 60 s restart."""
    job = _job(lc)
    _steps(lc, job, range(1, 51), 0.10)
    _steps(lc, job, range(51, 71), 0.30)  # the detector's window: the 20 steps before the finding
    with session_scope(lc.app.state.sessions) as s:
        s.get(Job, job).last_step = 70
    inc_id = _degraded(lc, job)
    assert _incident(lc, inc_id)[1]["step_s_healthy"] == pytest.approx(0.10)
    _switched(lc, job, 1, 80)
    _steps(lc, job, range(71, 101), 0.25)
    with session_scope(lc.app.state.sessions) as s:
        s.get(Job, job).last_step = 100
    escalated: list[Finding] = []
    _follow(lc, job, True, time.time(), escalated)
    a = _incident(lc, inc_id)[1]
    assert a["eviction"]["worth"] is True and a["eviction"]["projected_lost_s"] == pytest.approx(0.15 * 900)
    assert a["revert"]["version"] == 2  # the restarted group runs the spec's setting
    (f,) = escalated
    assert f.incident_id == inc_id and f.evidence["adapted"] is True
    decision = policy.decide(f, RecoverySpec.model_validate(SPEC["recovery"]), Facts(room=True))
    assert decision.action == policy.Action.EVICT_AND_RESTART and decision.evict == "n2"


def test_the_pace_on_the_sick_link_is_read_once_its_steps_are_aggregated(lc: LiveController) -> None:
    """As in ``vigil bench adapt``: the link is found 7 steps after the cut, while the aggregator is still
    behind, so at the request no aggregate shows a sick step (none is passed off as the sick pace). The steps
    from the request to the switch ran the spec's setting on the sick link: once aggregated they are the
    ``before`` figure; the adapted pace waits for its 20 steps' aggregates too."""
    job = _job(lc)
    _steps(lc, job, range(1, 61), 0.10)  # healthy; the link is cut at step 60
    with session_scope(lc.app.state.sessions) as s:
        s.get(Job, job).last_step = 67  # steps 61..67 still forming: no aggregate yet
    inc_id = _degraded(lc, job)
    a = _incident(lc, inc_id)[1]
    assert a["step_s_before"] is None and a["step_s_healthy"] == pytest.approx(0.10) and a["requested_step"] == 67
    _steps(lc, job, range(61, 81), 0.50)  # the spec's setting on the sick link, up to the switch at step 80
    _switched(lc, job, 1, 80)
    t0 = time.time() - 50
    _steps(lc, job, range(81, 91), 0.12, t0)
    with session_scope(lc.app.state.sessions) as s:
        s.get(Job, job).last_step = 100  # 91..100 not aggregated yet: nothing is measured
    _follow(lc, job, True, time.time(), [])
    assert _incident(lc, inc_id)[1]["step_s_after"] is None
    _steps(lc, job, range(91, 101), 0.12, t0)
    _follow(lc, job, True, time.time(), [])
    a = _incident(lc, inc_id)[1]
    assert (a["step_s_healthy"], a["step_s_before"], a["step_s_after"]) == pytest.approx((0.10, 0.50, 0.12))
    assert a["eviction"]["worth"] is False and a["eviction"]["excess_per_step_s"] == pytest.approx(0.02)


def test_compute_stragglers_and_other_policies_are_not_adapted() -> None:
    spec = RecoverySpec.model_validate(SPEC["recovery"])
    compute = Finding(IncidentKind.STRAGGLER, "j", "n2", 1, {"class": "compute-slow"})
    assert policy.decide(compute, spec, Facts(room=True)).action == policy.Action.EVICT_AND_RESTART
    comm = Finding(IncidentKind.STRAGGLER, "j", "n2", 1, {"class": "communication-slow"})
    assert policy.decide(comm, spec, Facts(room=True)).action == policy.Action.ADAPT
    nic = Finding(IncidentKind.NIC_DEGRADED, "j", "n2", None, {"class": "capacity"})
    assert policy.decide(nic, RecoverySpec(policy="evict_restart"), Facts(room=True)).action == \
        policy.Action.EVICT_AND_RESTART


def test_a_job_running_adapted_still_has_its_other_faults_found(lc: LiveController) -> None:
    """The adaptation's OPEN incident restarts nothing: it must not mute the job's detectors (the cooldown)."""
    from controller.recovery import facts

    job = _job(lc)
    _steps(lc, job, range(1, 41), 0.3)
    _degraded(lc, job)
    with session_scope(lc.app.state.sessions) as s:
        assert facts.recovering(s, s.get(Job, job)) is False
