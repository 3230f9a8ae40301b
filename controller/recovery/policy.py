"""Recovery policy: what a finding calls for. One class per ``recovery.policy`` mode; no database, no Ray.

:func:`policy_for` picks the job's :class:`Policy` by its ``recovery.policy`` (the model is Ray Train v2's
controller, whose FailurePolicy turns each failure into a decision), and its one
``decide(finding, facts) -> Decision`` takes a detector's :class:`~controller.recovery.detectors.Finding`
and the :class:`~controller.recovery.facts.Facts` gathered for it (recovery under way, the Ray head, room
left, restarts so far and progress since the last one). The :class:`Decision` is an :class:`Action`, the
reason (the incident's ``action`` text), the node to evict, the ranks to kill, and the ``eviction_refused``
event's text when the policy chose not to evict. :mod:`controller.recovery.actions` carries it out as it is.

Rules every mode shares (:class:`Policy`; docs/RECOVERY.md):

* **cooldown**: while a recovery is under way (an incident OPEN or ACTING, loss spikes aside), new rank
  deaths, hangs, stragglers and sick NICs are its aftermath, not new faults: IGNORE.
* **bounded restarts**: when the job resumed after a restart (stage RESUMED) and its restarts in a row
  without progress reached ``max_restarts`` (at least 1), FAIL (:mod:`vigil.contract.restarts`).
* ``loss_spike``: OBSERVE. A new ``hang``: DIAGNOSE (py-spy stacks of every rank) first.
* **head node / no room**: a node that is the Ray head, or without which the job's workers would not fit,
  is never evicted; where the mode would evict it does what it would do without the eviction (a hang is
  restarted in place, a straggler / NIC finding is CLOSEd) and says why in the ``eviction_refused`` event.
* ``manual`` (``POST /jobs/{id}/recover``): restart every rank, evicting the node asked for.

What the modes add:

* :class:`ObservePolicy`: incidents only (OPEN); a manual restart is carried out and CLOSEd at once.
* :class:`RollbackPolicy`: Ray Train restarts the group after a node lost / rank died (RESTART, Vigil kills
  nothing); NaN: ROLLBACK (every rank restarts from the last checkpoint); a diagnosed hang: kill the suspects
  (the odd rank out, else every rank); stragglers / sick NICs: OBSERVE.
* :class:`EvictRestartPolicy`: as rollback, and the node of a diagnosed hang's odd rank, of a straggler or of
  a sick NIC is evicted (Ray Train restarts the group on healthy nodes).
* :class:`LivePolicy` (every rank a torchft replica, ``vigil.live``): a dead rank's replica is restarted by
  Ray and heals from a live peer (RESTART); a diagnosed hang kills the hung ranks only; a straggler or sick
  NIC kills the rank's replica and evicts its node, or only kills it where the node cannot go; NaN rolls
  every replica back from disk.
* :class:`AdaptPolicy`: as evict_restart, but a degraded link is first answered with ``recovery.adapt``'s
  setting (ADAPT, :mod:`controller.recovery.adapt`); eviction only if the adapted job stays slower than an
  eviction costs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controller.recovery.detectors import Finding, Stage
from controller.recovery.facts import Facts
from vigil.contract.restarts import RestartBudget
from vigil.contract.schemas import IncidentKind, RecoveryPolicy, RecoverySpec


class Action(str, enum.Enum):
    IGNORE = "ignore"  # not a new fault (a recovery is under way): no incident
    OBSERVE = "observe"  # the incident is recorded and stays OPEN; Vigil does not act
    DIAGNOSE = "diagnose"  # collect py-spy stacks of every rank, decide once they are in
    RESTART = "restart"  # the worker group restarts (Vigil kills `kill`, or nothing when Ray Train does it)
    EVICT_AND_RESTART = "evict_and_restart"  # drain `evict` first, then as RESTART
    ROLLBACK = "rollback"  # kill every rank: they restart from the last checkpoint before the fault
    ADAPT = "adapt"  # a degraded link: ask the ranks for recovery.adapt's setting (controller/recovery/adapt.py)
    CLOSE = "close"  # the finding stays on record, closed: nothing to do
    FAIL = "fail"  # stop the job FAILED


ACTING_ACTIONS = frozenset({Action.RESTART, Action.EVICT_AND_RESTART, Action.ROLLBACK})
"""Decisions after which the incident is ACTING (and followed until the job resumes)."""

QUIET_WHILE_RECOVERING = frozenset({IncidentKind.RANK_DIED, IncidentKind.HANG, IncidentKind.STRAGGLER,
                                    IncidentKind.NIC_DEGRADED})
"""Kinds whose new findings wait while a recovery is under way (a group being torn down loses every
rank, stops stepping, and runs slow): the cooldown."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str | None = None
    """Why: the incident's ``action`` text (None: none is recorded); for FAIL, the job's message."""
    evict: str | None = None
    """The node to drain first."""
    evict_reason: str = ""
    """What the drain and its ``node_evicted`` event say (or, with ``refused``, would have said)."""
    kill: tuple[int, ...] = ()
    """Ranks Vigil kills (SIGKILL by their agents), in order."""
    kill_all: bool = False
    """Kill every rank of the job (instead of ``kill``)."""
    refused: str | None = None
    """The policy would have evicted the finding's node but may not (the Ray head, no room without it): the
    ``eviction_refused`` event's text (:attr:`Facts.refusal`)."""

    def __post_init__(self) -> None:
        if self.action == Action.EVICT_AND_RESTART and not self.evict:
            raise ValueError("EVICT_AND_RESTART needs a node to evict")


def waits(kind: IncidentKind, recovering: bool) -> bool:
    """Whether new findings of ``kind`` wait (the cooldown): the monitor skips those detectors then."""
    return recovering and kind in QUIET_WHILE_RECOVERING


def _evictable(facts: Facts) -> bool:
    return facts.room and not facts.head


def _slow_why(f: Finding) -> str:
    """What a slow node's drain says: its NIC, or its straggler rank (one its peers wait for)."""
    cls = f.evidence.get("class")
    if f.kind == IncidentKind.NIC_DEGRADED or cls == "communication-slow":
        return f"{cls} NIC of job {f.job_id}"
    if f.evidence.get("basis") == "collective-wait":
        return f"straggler rank {f.rank} of job {f.job_id} (its peers wait for it)"
    return f"straggler rank {f.rank} of job {f.job_id}"


class Policy:
    """A ``recovery.policy`` mode: the rules every mode shares; the modes override the ``_kind`` hooks.

    The base's hooks are a job whose group Ray Train restarts and which Vigil never evicts: rollback's rules.
    """

    mode: RecoveryPolicy = RecoveryPolicy.ROLLBACK

    def __init__(self, spec: RecoverySpec) -> None:
        self.spec = spec
        self.budget = RestartBudget(spec.max_restarts)

    def decide(self, f: Finding, facts: Facts) -> Decision:
        """What ``f`` calls for, given ``facts`` (module docstring): the one decision, carried out as it is."""
        if f.stage == Stage.RESUMED:
            return self.resumed(facts)
        if f.stage == Stage.DETECTED and waits(f.kind, facts.recovering):
            return Decision(Action.IGNORE)
        if f.kind in (IncidentKind.NODE_LOST, IncidentKind.RANK_DIED):
            return self.lost(f)
        if f.kind == IncidentKind.NAN_LOSS:
            return self.nan(f)
        if f.kind == IncidentKind.HANG:
            if f.stage == Stage.DETECTED:
                return Decision(Action.DIAGNOSE, "collecting py-spy stacks of every rank")
            return self.hang(f, facts, list(f.suspects))
        if f.kind in (IncidentKind.STRAGGLER, IncidentKind.NIC_DEGRADED):
            if self.mode != RecoveryPolicy.OBSERVE and not_worth_evicting(f):
                e = f.evidence["eviction"]
                return Decision(Action.CLOSE, f"fail-slow rank {f.rank} kept: it would cost {e['projected_lost_s']} s "
                                f"over the {e['steps_left']} steps left, an eviction {e['cost_s']} s (restart "
                                f"{e['restart_s']} s + steps done again {e['rerun_s']} s)")
            return self.slow_node(f, facts) if f.node_id else Decision(Action.OBSERVE)
        if f.kind == IncidentKind.MANUAL:
            return self.manual(f, facts)
        return Decision(Action.OBSERVE)  # loss_spike, and any kind no mode acts on

    def resumed(self, facts: Facts) -> Decision:
        """Bounded restarts: FAIL once the restarts in a row without progress reach the budget."""
        if self.budget.exhausted(facts.stalled_restarts):
            return Decision(Action.FAIL, f"no progress across {facts.stalled_restarts} restarts")
        return Decision(Action.OBSERVE)

    def lost(self, f: Finding) -> Decision:
        return Decision(Action.RESTART, self._ray_train_restarts(f))  # Ray Train restarts the group: Vigil kills nothing

    @staticmethod
    def _ray_train_restarts(f: Finding) -> str:
        return ("Ray Train restarts the worker group without the node" if f.kind == IncidentKind.NODE_LOST
                else "Ray Train restarts the worker group from the newest valid checkpoint")

    def nan(self, f: Finding) -> Decision:
        return Decision(Action.ROLLBACK, "rollback: restart every rank from the last checkpoint before the NaN",
                        kill_all=True)

    def hang(self, f: Finding, facts: Facts, victims: list[int]) -> Decision:
        return Decision(Action.RESTART, f"killed hung rank(s) {victims}; Ray Train restarts the group",
                        kill=f.suspects)

    def slow_node(self, f: Finding, facts: Facts) -> Decision:
        return Decision(Action.OBSERVE)

    def manual(self, f: Finding, facts: Facts) -> Decision:
        reason = f.evidence.get("reason", "manual")
        evict, refused = self._manual_evict(f, facts)
        return Decision(Action.EVICT_AND_RESTART if evict else Action.RESTART, f"manual: {reason}", evict=evict,
                        evict_reason=f"manual recovery of {f.job_id}: {reason}", kill_all=True, refused=refused)

    @staticmethod
    def _manual_evict(f: Finding, facts: Facts) -> tuple[str | None, str | None]:
        """The node a manual recovery drains (the one asked for, unless it may not go) and the refusal if any."""
        if not f.node_id:
            return None, None
        return (f.node_id, None) if _evictable(facts) else (None, facts.refusal or None)


class ObservePolicy(Policy):
    """``observe``: incidents only; Vigil acts on nothing but a manual restart."""

    mode = RecoveryPolicy.OBSERVE

    def lost(self, f: Finding) -> Decision:
        return Decision(Action.OBSERVE, f"observe: {self._ray_train_restarts(f)} (no action by Vigil)")

    def nan(self, f: Finding) -> Decision:
        return Decision(Action.OBSERVE)

    def hang(self, f: Finding, facts: Facts, victims: list[int]) -> Decision:
        return Decision(Action.OBSERVE, "observe: stacks collected, no action")

    def manual(self, f: Finding, facts: Facts) -> Decision:
        # The user's restart is carried out, but not followed as Vigil's own recovery: the incident is
        # CLOSED at once (an OPEN one would quiet the job's detectors until the job ends).
        reason = f.evidence.get("reason", "manual")
        evict, refused = self._manual_evict(f, facts)
        return Decision(Action.CLOSE, f"observe: manual: {reason} (carried out; not followed by Vigil)", evict=evict,
                        evict_reason=f"manual recovery of {f.job_id}: {reason}", kill_all=True, refused=refused)


class RollbackPolicy(Policy):
    """``rollback``: the shared rules (:class:`Policy`); nothing is evicted."""

    mode = RecoveryPolicy.ROLLBACK


class EvictRestartPolicy(Policy):
    """``evict_restart``: as rollback, and the culprit's node is drained (unless it may not go)."""

    mode = RecoveryPolicy.EVICT_RESTART

    def hang(self, f: Finding, facts: Facts, victims: list[int]) -> Decision:
        if not f.node_id:
            return super().hang(f, facts, victims)
        why = f"hang of job {f.job_id} (rank {f.rank})"
        if not facts.room:
            return Decision(Action.RESTART, f"killed hung rank(s) {victims}, {f.node_id} not evicted: the job's workers "
                            "would not fit on the other nodes; Ray Train restarts the group", kill=f.suspects,
                            evict_reason=why, refused=facts.refusal)
        if facts.head:
            return Decision(Action.RESTART, f"killed hung rank(s) {victims}, {f.node_id} is the Ray head: not evicted; "
                            "Ray Train restarts the group", kill=f.suspects, evict_reason=why, refused=facts.refusal)
        return Decision(Action.EVICT_AND_RESTART,
                        f"killed hung rank(s) {victims}, evicted {f.node_id}; Ray Train restarts the group",
                        evict=f.node_id, evict_reason=why, kill=f.suspects)

    def slow_node(self, f: Finding, facts: Facts) -> Decision:
        why = _slow_why(f)
        if not facts.room:
            # Evicting it would leave the job nowhere to run: the finding stays on record, the job runs on.
            return Decision(Action.CLOSE, f"not evicted: the job's workers would not fit without {f.node_id}; the job "
                            "runs on there", evict_reason=why, refused=facts.refusal)
        if facts.head:
            # A restart would land on the same slow node: the finding stays on record, the job runs on.
            return Decision(Action.CLOSE, f"not evicted: {f.node_id} is the Ray head (GCS, job drivers); the job runs "
                            "on there", evict_reason=why, refused=facts.refusal)
        return Decision(Action.EVICT_AND_RESTART, f"evicted {f.node_id}; Ray Train restarts the group on healthy nodes",
                        evict=f.node_id, evict_reason=why)


class LivePolicy(Policy):
    """``live`` (torchft): the survivors train on while a failed or slow rank's replica is replaced."""

    mode = RecoveryPolicy.LIVE

    def lost(self, f: Finding) -> Decision:
        what = (f"Ray restarts the replicas of {f.node_id} on other nodes" if f.kind == IncidentKind.NODE_LOST
                else f"Ray restarts rank {f.rank}'s replica")
        return Decision(Action.RESTART, f"live: {what}; it heals from a live peer while the others train on")

    def hang(self, f: Finding, facts: Facts, victims: list[int]) -> Decision:
        # The survivors left the hung replica out of their quorum and train on; a replacement heals from them.
        return Decision(Action.RESTART, f"live: killed hung rank(s) {victims}; Ray restarts their replicas, which "
                        "heal from a live peer", kill=f.suspects)

    def slow_node(self, f: Finding, facts: Facts) -> Decision:
        """The slow rank's replica is killed and replaced (it heals from a live peer), on another node when
        its node can be evicted (a drain: Ray places nothing new there)."""
        kill = (f.rank,) if f.rank is not None else ()
        what = f"rank {f.rank}'s replica" if f.rank is not None else f"the replicas of {f.node_id}"
        why = (f"{f.evidence.get('class')} NIC of job {f.job_id}" if f.kind == IncidentKind.NIC_DEGRADED
               or f.evidence.get("class") == "communication-slow" else f"straggler rank {f.rank} of job {f.job_id}")
        if not _evictable(facts):
            where = "the Ray head" if facts.head else "needed: no room elsewhere"
            if not kill:
                return Decision(Action.CLOSE, f"live: not evicted: {f.node_id} is {where}; the job runs on there",
                                evict_reason=why, refused=facts.refusal)
            return Decision(Action.RESTART, f"live: killed {what} ({f.node_id} not evicted: {where}); Ray restarts it, "
                            "it heals from a live peer", kill=kill, evict_reason=why, refused=facts.refusal)
        return Decision(Action.EVICT_AND_RESTART, f"live: evicted {f.node_id}, killed {what}; Ray restarts it on a "
                        "healthy node, it heals from a live peer while the others train on", evict=f.node_id,
                        evict_reason=why, kill=kill)


def _communication(f: Finding) -> bool:
    return f.kind == IncidentKind.NIC_DEGRADED or f.evidence.get("class") == "communication-slow"


class AdaptPolicy(EvictRestartPolicy):
    """``adapt``: as evict_restart, but a degraded link (a NIC finding, a communication-slow straggler) is first
    answered with ``recovery.adapt``'s more compressed setting, taken by every rank at a checkpoint boundary
    without a restart; the node is evicted only once the adapted job is measured slower than an eviction costs
    (the finding comes back ``adapted``)."""

    mode = RecoveryPolicy.ADAPT

    def slow_node(self, f: Finding, facts: Facts) -> Decision:
        if not _communication(f) or f.evidence.get("adapted") or self.spec.adapt is None:
            return super().slow_node(f, facts)
        return Decision(Action.ADAPT, f"adapt: {_slow_why(f)}: every rank switches to {self.spec.adapt.params} at "
                        f"its next checkpoint boundary instead of evicting {f.node_id}; back when the link recovers")


def not_worth_evicting(f: Finding) -> bool:
    """A fail-slow finding whose rank costs less than evicting it would (its ``eviction`` evidence,
    :func:`controller.recovery.failslow.eviction_arithmetic`)."""
    eviction = f.evidence.get("eviction")
    return f.evidence.get("class") == "fail-slow" and isinstance(eviction, dict) and eviction.get("worth") is False


class NoJobPolicy(Policy):
    """A finding without a job (a node lost with no job on it): on record, nothing to restart."""

    def decide(self, f: Finding, facts: Facts) -> Decision:
        return Decision(Action.OBSERVE)


POLICIES: dict[RecoveryPolicy, type[Policy]] = {
    cls.mode: cls for cls in (ObservePolicy, RollbackPolicy, EvictRestartPolicy, LivePolicy, AdaptPolicy)}
"""One policy class per ``recovery.policy`` mode."""


def policy_for(spec: RecoverySpec | None) -> Policy:
    """The job's policy, by its ``recovery.policy`` (None: a finding without a job)."""
    if spec is None:
        return NoJobPolicy(RecoverySpec())
    return POLICIES[spec.policy](spec)


def decide(finding: Finding, spec: RecoverySpec | None, facts: Facts) -> Decision:
    """Shorthand: ``policy_for(spec).decide(finding, facts)``."""
    return policy_for(spec).decide(finding, facts)
