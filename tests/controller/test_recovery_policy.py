"""The recovery policy (controller/recovery/policy.py) and the incident life cycle
(controller/recovery/incidents.py), without a database: ``decide()`` for each finding kind under each
``recovery.policy``, the cooldown, bounded restarts and the Ray head; incident status moves.
"""

from __future__ import annotations

import itertools

import pytest

from controller.models import Incident
from controller.recovery import incidents
from controller.recovery.detectors import Finding, Stage
from controller.recovery.policy import Action, Decision, History, decide, waits
from controller.schemas import IncidentKind, IncidentStatus, RecoveryPolicy, RecoverySpec

K = IncidentKind
OBSERVE, EVICT, ROLLBACK = "observe", "evict_restart", "rollback"
ALL_POLICIES = (OBSERVE, EVICT, ROLLBACK)


def spec(policy: str = EVICT, max_restarts: int = 3) -> RecoverySpec:
    return RecoverySpec(policy=RecoveryPolicy(policy), max_restarts=max_restarts)


def finding(kind: IncidentKind, node: str | None = "n2", rank: int | None = 1, stage: Stage = Stage.DETECTED,
            **evidence: object) -> Finding:
    return Finding(kind, "job_1", node, rank, dict(evidence), step=10, stage=stage,
                   incident_id=None if stage == Stage.DETECTED else 7,
                   suspects=(1,) if stage == Stage.DIAGNOSED else ())


# -- node lost, rank died: Ray Train restarts the group by itself ---------------------------------------------


@pytest.mark.parametrize(("kind", "what"), [
    (K.NODE_LOST, "Ray Train restarts the worker group without the node"),
    (K.RANK_DIED, "Ray Train restarts the worker group from the newest valid checkpoint"),
])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_node_lost_and_rank_died_are_restarted_by_ray_train(kind: IncidentKind, what: str, policy: str) -> None:
    d = decide(finding(kind), spec(policy), History())
    if policy == OBSERVE:
        assert d == Decision(Action.OBSERVE, f"observe: {what} (no action by Vigil)")
    else:
        assert d == Decision(Action.RESTART, what)  # Vigil kills nothing and evicts nothing
    assert d.kill == () and not d.kill_all and d.evict is None


def test_a_node_lost_without_a_job_is_only_recorded() -> None:
    assert decide(Finding(K.NODE_LOST, None, "n2", None, {}), None, History()) == Decision(Action.OBSERVE)


# -- loss ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_nan_loss_rolls_back_unless_observed(policy: str) -> None:
    d = decide(finding(K.NAN_LOSS, node=None), spec(policy), History())
    if policy == OBSERVE:
        assert d == Decision(Action.OBSERVE)
    else:
        assert d.action == Action.ROLLBACK and d.kill_all and d.evict is None
        assert d.reason == "rollback: restart every rank from the last checkpoint before the NaN"


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_loss_spike_is_only_observed(policy: str) -> None:
    assert decide(finding(K.LOSS_SPIKE, node=None), spec(policy), History()) == Decision(Action.OBSERVE)


# -- hang -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_new_hang_is_diagnosed_first(policy: str) -> None:
    d = decide(finding(K.HANG, node=None, rank=None), spec(policy), History())
    assert d == Decision(Action.DIAGNOSE, "collecting py-spy stacks of every rank")


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_diagnosed_hang_kills_the_suspects_and_evicts_under_evict_restart(policy: str) -> None:
    d = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(policy), History())
    if policy == OBSERVE:
        assert d == Decision(Action.OBSERVE, "observe: stacks collected, no action")
    elif policy == EVICT:
        assert d.action == Action.EVICT_AND_RESTART and d.evict == "n2" and d.kill == (1,)
        assert d.reason == "killed hung rank(s) [1], evicted n2; Ray Train restarts the group"
        assert d.evict_reason == "hang of job job_1 (rank 1)"
    else:
        assert d == Decision(Action.RESTART, "killed hung rank(s) [1]; Ray Train restarts the group", kill=(1,))


def test_a_hang_with_no_odd_rank_out_kills_every_rank_in_place() -> None:
    f = Finding(K.HANG, "job_1", None, None, {}, stage=Stage.DIAGNOSED, incident_id=7, suspects=(0, 1, 2))
    d = decide(f, spec(EVICT), History())
    assert d == Decision(Action.RESTART, "killed hung rank(s) [0, 1, 2]; Ray Train restarts the group", kill=(0, 1, 2))


# -- stragglers and sick NICs -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "evidence", "why"), [
    (K.STRAGGLER, {"class": "compute-slow"}, "straggler rank 1 of job job_1"),
    (K.STRAGGLER, {"class": "compute-slow", "basis": "collective-wait"},
     "straggler rank 1 of job job_1 (its peers wait for it)"),
    (K.STRAGGLER, {"class": "communication-slow"}, "communication-slow NIC of job job_1"),
    (K.NIC_DEGRADED, {"class": "capacity"}, "capacity NIC of job job_1"),
])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_slow_node_is_evicted_only_under_evict_restart(kind: IncidentKind, evidence: dict, why: str,
                                                         policy: str) -> None:
    d = decide(finding(kind, **evidence), spec(policy), History())
    if policy == EVICT:
        assert d.action == Action.EVICT_AND_RESTART and d.evict == "n2" and d.evict_reason == why
        assert d.reason == "evicted n2; Ray Train restarts the group on healthy nodes"
        assert d.kill == () and not d.kill_all  # the drain restarts the group
    else:
        assert d == Decision(Action.OBSERVE)


def test_a_straggler_whose_node_is_unknown_is_only_recorded() -> None:
    assert decide(finding(K.STRAGGLER, node=None, **{"class": "compute-slow"}), spec(EVICT), History()) == \
        Decision(Action.OBSERVE)


# -- manual recovery ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["n2", None])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_manual_recovery_restarts_every_rank_whatever_the_policy(node: str | None, policy: str) -> None:
    d = decide(finding(K.MANUAL, node=node, rank=None, manual=True, reason="op"), spec(policy), History())
    assert d.kill_all and d.evict == node
    if policy == OBSERVE:  # carried out, not followed as Vigil's recovery: CLOSED (an OPEN one mutes detection)
        assert d.action == Action.CLOSE and d.reason == "observe: manual: op (carried out; not followed by Vigil)"
    else:
        assert d.action == (Action.EVICT_AND_RESTART if node else Action.RESTART) and d.reason == "manual: op"
    if node:
        assert d.evict_reason == "manual recovery of job_1: op"


# -- the Ray head is never evicted --------------------------------------------------------------------------


def test_the_ray_head_is_never_evicted() -> None:
    head = History(head_nodes=frozenset({"n2"}))
    hang = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(EVICT), head)
    assert hang == Decision(Action.RESTART, "killed hung rank(s) [1], n2 is the Ray head: not evicted; Ray Train "
                            "restarts the group", kill=(1,))
    slow = decide(finding(K.STRAGGLER, **{"class": "compute-slow"}), spec(EVICT), head)
    assert slow == Decision(Action.CLOSE, "not evicted: n2 is the Ray head (GCS, job drivers); the job runs on there")
    nic = decide(finding(K.NIC_DEGRADED, **{"class": "capacity"}), spec(EVICT), head)
    assert nic.action == Action.CLOSE and nic.evict is None
    manual = decide(finding(K.MANUAL, rank=None, reason="op"), spec(EVICT), head)
    assert manual == Decision(Action.RESTART, "manual: op", kill_all=True, evict_reason="manual recovery of job_1: op")


@pytest.mark.parametrize("f", [
    finding(K.HANG, stage=Stage.DIAGNOSED), finding(K.STRAGGLER, **{"class": "compute-slow"}),
    finding(K.NIC_DEGRADED, **{"class": "capacity"}), finding(K.MANUAL, rank=None, reason="op"),
])
def test_every_eviction_comes_with_what_to_do_if_the_node_is_the_head(f: Finding) -> None:
    d = decide(f, spec(EVICT), History())
    assert d.evict == "n2" and d.if_refused is not None and d.if_refused.evict is None
    assert d.if_refused == decide(f, spec(EVICT), History(head_nodes=frozenset({"n2"})))


def test_an_eviction_needs_a_node() -> None:
    with pytest.raises(ValueError, match="node to evict"):
        Decision(Action.EVICT_AND_RESTART, "x")


# -- cooldown: a recovery under way ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(K))
def test_while_a_recovery_is_under_way_new_faults_of_the_group_wait(kind: IncidentKind) -> None:
    quiet = kind in (K.RANK_DIED, K.HANG, K.STRAGGLER, K.NIC_DEGRADED)
    recovering = History(recovering=True)
    assert waits(kind, recovering) is quiet and not waits(kind, History())
    d = decide(finding(kind, reason="op", **{"class": "capacity"}), spec(EVICT), recovering)
    assert (d.action == Action.IGNORE) is quiet


def test_a_diagnosis_of_the_hang_under_way_is_not_held_back() -> None:
    d = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(ROLLBACK), History(recovering=True))
    assert d.action == Action.RESTART


# -- bounded restarts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_restarts", "stalled", "fails"), [
    (2, 0, False), (2, 1, False), (2, 2, True), (2, 3, True), (3, 2, False), (0, 0, False), (0, 1, True),
])
def test_no_progress_across_max_restarts_fails_the_job(max_restarts: int, stalled: int, fails: bool) -> None:
    f = finding(K.NAN_LOSS, node=None, stage=Stage.RESUMED, restarted_at=1.0)
    d = decide(f, spec(ROLLBACK, max_restarts), History(stalled_restarts=stalled))
    if fails:
        assert d == Decision(Action.FAIL, f"no progress across {stalled} restarts")
    else:
        assert d == Decision(Action.OBSERVE)


# -- incident status moves ----------------------------------------------------------------------------------------

S = IncidentStatus
LEGAL = {(S.OPEN, S.ACTING), (S.OPEN, S.CLOSED), (S.OPEN, S.FAILED),
         (S.ACTING, S.RECOVERED), (S.ACTING, S.FAILED), (S.ACTING, S.CLOSED)}


@pytest.mark.parametrize(("old", "new"), [(a, b) for a, b in itertools.product(S, S) if a != b])
def test_incident_transitions_refuse_illegal_moves(old: IncidentStatus, new: IncidentStatus) -> None:
    inc = Incident(id=1, kind=K.HANG.value, status=old.value)
    if (old, new) in LEGAL:
        assert incidents.transition(inc, new) is True and inc.status == new.value
    else:
        with pytest.raises(incidents.IllegalIncidentTransition, match=f"{old.value} -> {new.value}"):
            incidents.transition(inc, new)
        assert inc.status == old.value


def test_a_move_to_the_same_status_changes_nothing_and_terminal_statuses_are_final() -> None:
    inc = Incident(id=1, kind=K.HANG.value, status=S.ACTING.value)
    assert incidents.transition(inc, S.ACTING) is False and inc.status == S.ACTING.value
    assert {s for s in S if incidents.is_terminal(s)} == {S.RECOVERED, S.FAILED, S.CLOSED}
    with pytest.raises(incidents.IllegalIncidentTransition):
        incidents.close(Incident(id=2, kind=K.STRAGGLER.value, status=S.RECOVERED.value), "late")


# -- live: a failed rank's replica is replaced while the others train on ---------------------------------------

LIVE = "live"


@pytest.mark.parametrize("kind", [K.NODE_LOST, K.RANK_DIED])
def test_live_lets_ray_restart_the_replica_and_kills_nothing(kind: IncidentKind) -> None:
    d = decide(finding(kind), spec(LIVE), History())
    assert d.action == Action.RESTART and d.kill == () and not d.kill_all and d.evict is None
    assert d.reason is not None and d.reason.startswith("live: ") and "heals from a live peer" in d.reason


def test_live_kills_only_the_diagnosed_hung_rank_and_evicts_nothing() -> None:
    assert decide(finding(K.HANG), spec(LIVE), History()).action == Action.DIAGNOSE
    d = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(LIVE), History())
    assert (d.action, d.kill, d.kill_all, d.evict) == (Action.RESTART, (1,), False, None)


@pytest.mark.parametrize("kind", [K.STRAGGLER, K.NIC_DEGRADED])
def test_live_replaces_a_slow_ranks_replica_away_from_its_node(kind: IncidentKind) -> None:
    d = decide(finding(kind), spec(LIVE), History())
    assert (d.action, d.kill, d.evict, d.kill_all) == (Action.EVICT_AND_RESTART, (1,), "n2", False)
    # Where the node cannot go (the head, or no room elsewhere), the replica alone is replaced.
    for history in (History(head_nodes=frozenset({"n2"})), History(no_room=frozenset({"n2"}))):
        d = decide(finding(kind), spec(LIVE), history)
        assert (d.action, d.kill, d.evict) == (Action.RESTART, (1,), None)
    # A finding without a rank on such a node stays on record.
    assert decide(finding(kind, rank=None), spec(LIVE), History(no_room=frozenset({"n2"}))).action == Action.CLOSE


def test_live_rolls_every_replica_back_from_disk_on_nan_loss() -> None:
    d = decide(finding(K.NAN_LOSS, node=None), spec(LIVE), History())
    assert d.action == Action.ROLLBACK and d.kill_all
