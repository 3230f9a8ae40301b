"""The recovery policy (controller/recovery/policy.py) and the incident life cycle
(controller/recovery/incidents.py), without a database: each ``recovery.policy`` mode's ``decide(finding,
facts)`` for each finding kind, the cooldown, bounded restarts (max_restarts and progress), the Ray head and
a node without which the job would not fit; incident status moves. Needs nothing but the package.
"""

from __future__ import annotations

import itertools

import pytest

from controller.models import Incident
from controller.recovery import incidents
from controller.recovery.detectors import Finding, Stage
from controller.recovery.facts import Facts, head_refusal
from controller.recovery.policy import (
    POLICIES,
    Action,
    AdaptPolicy,
    Decision,
    EvictRestartPolicy,
    LivePolicy,
    NoJobPolicy,
    ObservePolicy,
    RollbackPolicy,
    decide,
    policy_for,
    waits,
)
from vigil.contract.schemas import IncidentKind, IncidentStatus, RecoveryPolicy, RecoverySpec

K = IncidentKind
OBSERVE, EVICT, ROLLBACK = "observe", "evict_restart", "rollback"
ALL_POLICIES = (OBSERVE, EVICT, ROLLBACK)
NO_ROOM_WHY = "n2 not evicted: job job_1's 2 worker(s) would not fit on the other nodes"
HEAD = Facts(head=True, refusal=head_refusal("n2"))
"""The finding's node (n2) is the Ray head."""
NO_ROOM = Facts(room=False, refusal=NO_ROOM_WHY)
"""The job's workers would not fit on the other nodes without n2."""


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
    d = decide(finding(kind), spec(policy), Facts())
    if policy == OBSERVE:
        assert d == Decision(Action.OBSERVE, f"observe: {what} (no action by Vigil)")
    else:
        assert d == Decision(Action.RESTART, what)  # Vigil kills nothing and evicts nothing
    assert d.kill == () and not d.kill_all and d.evict is None


def test_a_node_lost_without_a_job_is_only_recorded() -> None:
    assert decide(Finding(K.NODE_LOST, None, "n2", None, {}), None, Facts()) == Decision(Action.OBSERVE)


# -- loss ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_nan_loss_rolls_back_unless_observed(policy: str) -> None:
    d = decide(finding(K.NAN_LOSS, node=None), spec(policy), Facts())
    if policy == OBSERVE:
        assert d == Decision(Action.OBSERVE)
    else:
        assert d.action == Action.ROLLBACK and d.kill_all and d.evict is None
        assert d.reason == "rollback: restart every rank from the last checkpoint before the NaN"


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_loss_spike_is_only_observed(policy: str) -> None:
    assert decide(finding(K.LOSS_SPIKE, node=None), spec(policy), Facts()) == Decision(Action.OBSERVE)


# -- hang -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_new_hang_is_diagnosed_first(policy: str) -> None:
    d = decide(finding(K.HANG, node=None, rank=None), spec(policy), Facts())
    assert d == Decision(Action.DIAGNOSE, "collecting py-spy stacks of every rank")


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_diagnosed_hang_kills_the_suspects_and_evicts_under_evict_restart(policy: str) -> None:
    d = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(policy), Facts())
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
    d = decide(f, spec(EVICT), Facts())
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
    d = decide(finding(kind, **evidence), spec(policy), Facts())
    if policy == EVICT:
        assert d.action == Action.EVICT_AND_RESTART and d.evict == "n2" and d.evict_reason == why
        assert d.reason == "evicted n2; Ray Train restarts the group on healthy nodes"
        assert d.kill == () and not d.kill_all  # the drain restarts the group
    else:
        assert d == Decision(Action.OBSERVE)


def test_a_straggler_whose_node_is_unknown_is_only_recorded() -> None:
    assert decide(finding(K.STRAGGLER, node=None, **{"class": "compute-slow"}), spec(EVICT), Facts()) == \
        Decision(Action.OBSERVE)


# -- manual recovery ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["n2", None])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_manual_recovery_restarts_every_rank_whatever_the_policy(node: str | None, policy: str) -> None:
    d = decide(finding(K.MANUAL, node=node, rank=None, manual=True, reason="op"), spec(policy), Facts())
    assert d.kill_all and d.evict == node
    if policy == OBSERVE:  # carried out, not followed as Vigil's recovery: CLOSED (an OPEN one mutes detection)
        assert d.action == Action.CLOSE and d.reason == "observe: manual: op (carried out; not followed by Vigil)"
    else:
        assert d.action == (Action.EVICT_AND_RESTART if node else Action.RESTART) and d.reason == "manual: op"
    if node:
        assert d.evict_reason == "manual recovery of job_1: op"


# -- the Ray head is never evicted --------------------------------------------------------------------------


def test_the_ray_head_is_never_evicted() -> None:
    hang = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(EVICT), HEAD)
    assert hang == Decision(Action.RESTART, "killed hung rank(s) [1], n2 is the Ray head: not evicted; Ray Train "
                            "restarts the group", kill=(1,), evict_reason="hang of job job_1 (rank 1)",
                            refused=HEAD.refusal)
    slow = decide(finding(K.STRAGGLER, **{"class": "compute-slow"}), spec(EVICT), HEAD)
    assert slow == Decision(Action.CLOSE, "not evicted: n2 is the Ray head (GCS, job drivers); the job runs on there",
                            evict_reason="straggler rank 1 of job job_1", refused=HEAD.refusal)
    nic = decide(finding(K.NIC_DEGRADED, **{"class": "capacity"}), spec(EVICT), HEAD)
    assert nic.action == Action.CLOSE and nic.evict is None
    manual = decide(finding(K.MANUAL, rank=None, reason="op"), spec(EVICT), HEAD)
    assert manual == Decision(Action.RESTART, "manual: op", kill_all=True, evict_reason="manual recovery of job_1: op",
                              refused=HEAD.refusal)
    assert "is the Ray head" in HEAD.refusal and "never evicted" in HEAD.refusal


def test_a_node_the_job_cannot_do_without_is_never_evicted() -> None:
    hang = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(EVICT), NO_ROOM)
    assert hang == Decision(Action.RESTART, "killed hung rank(s) [1], n2 not evicted: the job's workers would not "
                            "fit on the other nodes; Ray Train restarts the group", kill=(1,),
                            evict_reason="hang of job job_1 (rank 1)", refused=NO_ROOM_WHY)
    slow = decide(finding(K.STRAGGLER, **{"class": "compute-slow"}), spec(EVICT), NO_ROOM)
    assert slow == Decision(Action.CLOSE, "not evicted: the job's workers would not fit without n2; the job runs "
                            "on there", evict_reason="straggler rank 1 of job job_1", refused=NO_ROOM_WHY)
    # No room and the head at once: the room is the reason given (it is checked first).
    both = Facts(head=True, room=False, refusal=NO_ROOM_WHY)
    assert decide(finding(K.STRAGGLER, **{"class": "compute-slow"}), spec(EVICT), both) == slow


EVICTING = [finding(K.HANG, stage=Stage.DIAGNOSED), finding(K.STRAGGLER, **{"class": "compute-slow"}),
            finding(K.NIC_DEGRADED, **{"class": "capacity"}), finding(K.MANUAL, rank=None, reason="op")]
"""Findings on n2 after which a mode may evict n2 (live never evicts for a hang: it kills the replica)."""


@pytest.mark.parametrize("facts", [HEAD, NO_ROOM])
@pytest.mark.parametrize(("policy", "f"), [(EVICT, f) for f in EVICTING] + [("live", f) for f in EVICTING[1:]])
def test_an_eviction_the_facts_forbid_is_decided_without_it_and_the_refusal_said(f: Finding, facts: Facts,
                                                                                   policy: str) -> None:
    """Decided once: the policy that would evict a node that may not go decides without the eviction and
    hands the refusal to actions (an ``eviction_refused`` event), which carry the decision out as it is."""
    free = decide(f, spec(policy), Facts())
    held = decide(f, spec(policy), facts)
    assert free.evict == "n2" and free.refused is None
    assert held.evict is None and held.action != Action.EVICT_AND_RESTART
    assert held.refused == facts.refusal and held.evict_reason == free.evict_reason
    assert (held.kill, held.kill_all) == (free.kill, free.kill_all)


def test_an_eviction_needs_a_node() -> None:
    with pytest.raises(ValueError, match="node to evict"):
        Decision(Action.EVICT_AND_RESTART, "x")


# -- cooldown: a recovery under way ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(K))
def test_while_a_recovery_is_under_way_new_faults_of_the_group_wait(kind: IncidentKind) -> None:
    quiet = kind in (K.RANK_DIED, K.HANG, K.STRAGGLER, K.NIC_DEGRADED)
    recovering = Facts(recovering=True)
    assert waits(kind, True) is quiet and not waits(kind, False)
    d = decide(finding(kind, reason="op", **{"class": "capacity"}), spec(EVICT), recovering)
    assert (d.action == Action.IGNORE) is quiet


def test_a_diagnosis_of_the_hang_under_way_is_not_held_back() -> None:
    d = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(ROLLBACK), Facts(recovering=True))
    assert d.action == Action.RESTART


# -- bounded restarts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_restarts", "stalled", "fails"), [
    (2, 0, False), (2, 1, False), (2, 2, True), (2, 3, True), (3, 2, False), (0, 0, False), (0, 1, True),
])
def test_no_progress_across_max_restarts_fails_the_job(max_restarts: int, stalled: int, fails: bool) -> None:
    f = finding(K.NAN_LOSS, node=None, stage=Stage.RESUMED, restarted_at=1.0)
    d = decide(f, spec(ROLLBACK, max_restarts), Facts(stalled_restarts=stalled))
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
    d = decide(finding(kind), spec(LIVE), Facts())
    assert d.action == Action.RESTART and d.kill == () and not d.kill_all and d.evict is None
    assert d.reason is not None and d.reason.startswith("live: ") and "heals from a live peer" in d.reason


def test_live_kills_only_the_diagnosed_hung_rank_and_evicts_nothing() -> None:
    assert decide(finding(K.HANG), spec(LIVE), Facts()).action == Action.DIAGNOSE
    d = decide(finding(K.HANG, stage=Stage.DIAGNOSED), spec(LIVE), Facts())
    assert (d.action, d.kill, d.kill_all, d.evict) == (Action.RESTART, (1,), False, None)


@pytest.mark.parametrize("kind", [K.STRAGGLER, K.NIC_DEGRADED])
def test_live_replaces_a_slow_ranks_replica_away_from_its_node(kind: IncidentKind) -> None:
    d = decide(finding(kind), spec(LIVE), Facts())
    assert (d.action, d.kill, d.evict, d.kill_all) == (Action.EVICT_AND_RESTART, (1,), "n2", False)
    # Where the node cannot go (the head, or no room elsewhere), the replica alone is replaced.
    for facts in (HEAD, NO_ROOM):
        d = decide(finding(kind), spec(LIVE), facts)
        assert (d.action, d.kill, d.evict, d.refused) == (Action.RESTART, (1,), None, facts.refusal)
    # A finding without a rank on such a node stays on record.
    assert decide(finding(kind, rank=None), spec(LIVE), NO_ROOM).action == Action.CLOSE


def test_live_rolls_every_replica_back_from_disk_on_nan_loss() -> None:
    d = decide(finding(K.NAN_LOSS, node=None), spec(LIVE), Facts())
    assert d.action == Action.ROLLBACK and d.kill_all


# -- one policy class per recovery.policy mode: the same findings and facts, each mode's decision ------------------


def test_every_mode_has_its_own_policy_class() -> None:
    assert set(POLICIES) == set(RecoveryPolicy)
    for mode, cls in POLICIES.items():
        chosen = policy_for(RecoverySpec(policy=mode))
        assert type(chosen) is cls and chosen.mode == mode
    assert {POLICIES[m] for m in RecoveryPolicy} == {ObservePolicy, RollbackPolicy, EvictRestartPolicy, LivePolicy,
                                                     AdaptPolicy}
    assert isinstance(policy_for(None), NoJobPolicy)


MODES = (RecoveryPolicy.OBSERVE, RecoveryPolicy.ROLLBACK, RecoveryPolicy.EVICT_RESTART, RecoveryPolicy.LIVE)
FINDINGS = {
    "rank_died": finding(K.RANK_DIED),
    "nan": finding(K.NAN_LOSS, node=None),
    "spike": finding(K.LOSS_SPIKE, node=None),
    "hang": finding(K.HANG, stage=Stage.DIAGNOSED),
    "straggler": finding(K.STRAGGLER, **{"class": "compute-slow"}),
    "nic": finding(K.NIC_DEGRADED, **{"class": "capacity"}),
    "manual": finding(K.MANUAL, rank=None, reason="op"),
}
FACTS = {"free": Facts(), "head": HEAD, "no_room": NO_ROOM}
_O, _R, _E, _B, _C = Action.OBSERVE, Action.RESTART, Action.EVICT_AND_RESTART, Action.ROLLBACK, Action.CLOSE
ALL = "all"
# (finding, facts) -> per mode (observe, rollback, evict_restart, live): (action, node evicted, ranks killed)
TABLE: dict[tuple[str, str], tuple[tuple[Action, str | None, object], ...]] = {
    ("rank_died", "free"): ((_O, None, ()), (_R, None, ()), (_R, None, ()), (_R, None, ())),
    ("nan", "free"): ((_O, None, ()), (_B, None, ALL), (_B, None, ALL), (_B, None, ALL)),
    ("spike", "free"): ((_O, None, ()),) * 4,
    ("hang", "free"): ((_O, None, ()), (_R, None, (1,)), (_E, "n2", (1,)), (_R, None, (1,))),
    ("hang", "head"): ((_O, None, ()), (_R, None, (1,)), (_R, None, (1,)), (_R, None, (1,))),
    ("hang", "no_room"): ((_O, None, ()), (_R, None, (1,)), (_R, None, (1,)), (_R, None, (1,))),
    ("straggler", "free"): ((_O, None, ()), (_O, None, ()), (_E, "n2", ()), (_E, "n2", (1,))),
    ("straggler", "head"): ((_O, None, ()), (_O, None, ()), (_C, None, ()), (_R, None, (1,))),
    ("straggler", "no_room"): ((_O, None, ()), (_O, None, ()), (_C, None, ()), (_R, None, (1,))),
    ("nic", "free"): ((_O, None, ()), (_O, None, ()), (_E, "n2", ()), (_E, "n2", (1,))),
    ("nic", "no_room"): ((_O, None, ()), (_O, None, ()), (_C, None, ()), (_R, None, (1,))),
    ("manual", "free"): ((_C, "n2", ALL), (_E, "n2", ALL), (_E, "n2", ALL), (_E, "n2", ALL)),
    ("manual", "head"): ((_C, None, ALL), (_R, None, ALL), (_R, None, ALL), (_R, None, ALL)),
}


@pytest.mark.parametrize(("f", "facts"), list(TABLE))
def test_each_mode_decides_the_same_finding_and_facts_its_own_way(f: str, facts: str) -> None:
    for mode, (action, evict, kill) in zip(MODES, TABLE[f, facts], strict=True):
        d = POLICIES[mode](RecoverySpec(policy=mode)).decide(FINDINGS[f], FACTS[facts])
        assert (d.action, d.evict, ALL if d.kill_all else d.kill) == (action, evict, kill), mode
        # A refused eviction is said (an eviction_refused event) exactly where the mode would have evicted.
        would = POLICIES[mode](RecoverySpec(policy=mode)).decide(FINDINGS[f], Facts()).evict is not None
        assert (d.refused is not None) == (would and facts != "free"), mode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("max_restarts", "stalled", "fails"), [(2, 1, False), (2, 2, True), (0, 0, False),
                                                                 (0, 1, True)])
def test_every_mode_bounds_restarts_without_progress_alike(mode: RecoveryPolicy, max_restarts: int, stalled: int,
                                                           fails: bool) -> None:
    """One meaning of max_restarts (vigil/contract/restarts.py) in every mode: restarts in a row without
    progress, at least 1, counted by the facts; the policy only compares."""
    f = finding(K.RANK_DIED, stage=Stage.RESUMED, restarted_at=1.0)
    d = policy_for(RecoverySpec(policy=mode, max_restarts=max_restarts)).decide(f, Facts(stalled_restarts=stalled))
    assert d == (Decision(Action.FAIL, f"no progress across {stalled} restarts") if fails else Decision(Action.OBSERVE))


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_holds_new_faults_of_the_group_while_recovering(mode: RecoveryPolicy) -> None:
    policy = policy_for(RecoverySpec(policy=mode))
    for kind in (K.RANK_DIED, K.HANG, K.STRAGGLER, K.NIC_DEGRADED):
        assert policy.decide(finding(kind), Facts(recovering=True)).action == Action.IGNORE
    assert policy.decide(finding(K.NAN_LOSS, node=None), Facts(recovering=True)).action != Action.IGNORE
