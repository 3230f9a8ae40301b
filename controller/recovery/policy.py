"""Recovery policy: what a finding calls for. One pure function, :func:`decide`; no database, no Ray.

``decide(finding, spec, history)`` takes a detector's :class:`~controller.recovery.detectors.Finding`,
the job's ``recovery`` spec (``policy``: observe | evict_restart | rollback, ``max_restarts``) and what
the monitor knows of the job's recent past (:class:`History`), and returns a :class:`Decision`: an
:class:`Action`, the reason (which becomes the incident's ``action`` text), the node to evict, the
ranks to kill. :mod:`controller.recovery.actions` carries it out; the model is Ray Train v2's
controller, whose FailurePolicy turns each failure into a decision. The rules (docs/RECOVERY.md):

* **cooldown**: while a recovery is under way (an incident OPEN or ACTING, loss spikes aside), new
  rank deaths, hangs, stragglers and sick NICs are its aftermath, not new faults: IGNORE.
* ``node_lost`` / ``rank_died``: Ray Train restarts the worker group by itself: RESTART (Vigil kills
  nothing) or, under ``observe``, OBSERVE with what Ray Train does.
* ``hang``: first DIAGNOSE (py-spy stacks of every rank); once diagnosed, kill the suspects (the odd
  rank out, else every rank), evicting the odd rank's node first under ``evict_restart``.
* ``straggler`` / ``nic_degraded``: under ``evict_restart`` evict the node (Ray Train restarts the
  group on healthy nodes); otherwise OBSERVE.
* ``nan_loss``: ROLLBACK (every rank restarts from the last checkpoint) under ``rollback`` and
  ``evict_restart``; ``loss_spike``: OBSERVE.
* ``live`` (every rank a torchft replica, :mod:`vigil.live`): a dead rank's replica is restarted by Ray
  and heals from a live peer (RESTART, Vigil kills nothing); a diagnosed hang kills the hung ranks only;
  a straggler or sick NIC kills the rank's replica and evicts its node (so Ray places the replacement
  elsewhere), or only kills it where the node cannot go; NaN loss rolls every replica back from disk.
* ``manual`` (``POST /jobs/{id}/recover``): restart every rank, evicting the node asked for; under
  ``observe`` the restart still happens but the incident is left OPEN (as before this module existed).
* **head node**: the Ray head is never evicted; a decision whose node turns out to be the head falls back
  to :attr:`Decision.if_refused` (a hang is restarted in place, a straggler / NIC finding is CLOSEd).
* **bounded restarts**: when the job resumed after a restart (stage RESUMED) without progress across
  ``max_restarts`` restarts (at least 1): FAIL.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from controller.recovery.detectors import Finding, Stage
from controller.schemas import IncidentKind, RecoveryPolicy, RecoverySpec


class Action(str, enum.Enum):
    IGNORE = "ignore"  # not a new fault (a recovery is under way): no incident
    OBSERVE = "observe"  # the incident is recorded and stays OPEN; Vigil does not act
    DIAGNOSE = "diagnose"  # collect py-spy stacks of every rank, decide once they are in
    RESTART = "restart"  # the worker group restarts (Vigil kills `kill`, or nothing when Ray Train does it)
    EVICT_AND_RESTART = "evict_and_restart"  # drain `evict` first, then as RESTART
    ROLLBACK = "rollback"  # kill every rank: they restart from the last checkpoint before the fault
    CLOSE = "close"  # the finding stays on record, closed: nothing to do
    FAIL = "fail"  # stop the job FAILED


ACTING_ACTIONS = frozenset({Action.RESTART, Action.EVICT_AND_RESTART, Action.ROLLBACK})
"""Decisions after which the incident is ACTING (and followed until the job resumes)."""

QUIET_WHILE_RECOVERING = frozenset({IncidentKind.RANK_DIED, IncidentKind.HANG, IncidentKind.STRAGGLER,
                                    IncidentKind.NIC_DEGRADED})
"""Kinds whose new findings wait while a recovery is under way (a group being torn down loses every
rank, stops stepping, and runs slow): the cooldown."""


@dataclass(frozen=True)
class History:
    """What the policy knows of the job's recent past (built by the monitor from the database)."""

    recovering: bool = False
    """An incident of the job is under way (OPEN or ACTING; loss spikes aside)."""
    stalled_restarts: int = 0
    """Restarts in a row after which the job made no progress."""
    head_nodes: frozenset[str] = frozenset()
    """Nodes known to be the Ray head (never evicted)."""
    no_room: frozenset[str] = frozenset()
    """Nodes the job cannot do without: evicting one would leave too few CPUs for its workers."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str | None = None
    """Why: the incident's ``action`` text (None: none is recorded); for FAIL, the job's message."""
    evict: str | None = None
    """The node to drain first."""
    evict_reason: str = ""
    """What the drain and its ``node_evicted`` event say."""
    kill: tuple[int, ...] = ()
    """Ranks Vigil kills (SIGKILL by their agents), in order."""
    kill_all: bool = False
    """Kill every rank of the job (instead of ``kill``)."""
    if_refused: Decision | None = field(default=None, compare=False)
    """What to do instead when ``evict`` turns out to be the Ray head (set by :func:`decide`)."""

    def __post_init__(self) -> None:
        if self.action == Action.EVICT_AND_RESTART and not self.evict:
            raise ValueError("EVICT_AND_RESTART needs a node to evict")


def waits(kind: IncidentKind, history: History) -> bool:
    """Whether new findings of ``kind`` wait (the cooldown): the monitor skips those detectors then."""
    return history.recovering and kind in QUIET_WHILE_RECOVERING


def decide(finding: Finding, spec: RecoverySpec | None, history: History) -> Decision:
    """What ``finding`` calls for under the job's recovery ``spec`` (None: a finding without a job)."""
    decision = _decide(finding, spec, history)
    if decision.evict is not None:
        head = replace(history, head_nodes=history.head_nodes | {decision.evict})
        decision = replace(decision, if_refused=_decide(finding, spec, head))
    return decision


def _decide(f: Finding, spec: RecoverySpec | None, history: History) -> Decision:
    if f.stage == Stage.RESUMED:
        return _resumed(spec, history)
    if f.stage == Stage.DETECTED and waits(f.kind, history):
        return Decision(Action.IGNORE)
    if spec is None:
        return Decision(Action.OBSERVE)  # a node lost with no job on it: on record, nothing to restart
    policy = spec.policy
    kind = f.kind
    if kind in (IncidentKind.NODE_LOST, IncidentKind.RANK_DIED):
        if policy == RecoveryPolicy.LIVE:
            what = (f"Ray restarts the replicas of {f.node_id} on other nodes" if kind == IncidentKind.NODE_LOST
                    else f"Ray restarts rank {f.rank}'s replica")
            return Decision(Action.RESTART, f"live: {what}; it heals from a live peer while the others train on")
        what = ("Ray Train restarts the worker group without the node" if kind == IncidentKind.NODE_LOST
                else "Ray Train restarts the worker group from the newest valid checkpoint")
        if policy == RecoveryPolicy.OBSERVE:
            return Decision(Action.OBSERVE, f"observe: {what} (no action by Vigil)")
        return Decision(Action.RESTART, what)  # Ray Train restarts the group: Vigil kills nothing
    if kind == IncidentKind.NAN_LOSS:
        if policy in (RecoveryPolicy.ROLLBACK, RecoveryPolicy.EVICT_RESTART, RecoveryPolicy.LIVE):
            return Decision(Action.ROLLBACK, "rollback: restart every rank from the last checkpoint before the NaN",
                            kill_all=True)
        return Decision(Action.OBSERVE)
    if kind == IncidentKind.LOSS_SPIKE:
        return Decision(Action.OBSERVE)
    if kind == IncidentKind.HANG:
        return _hang(f, policy, history)
    if kind in (IncidentKind.STRAGGLER, IncidentKind.NIC_DEGRADED):
        return _slow_node(f, policy, history)
    if kind == IncidentKind.MANUAL:
        return _manual(f, policy, history)
    return Decision(Action.OBSERVE)


def _hang(f: Finding, policy: RecoveryPolicy, history: History) -> Decision:
    if f.stage == Stage.DETECTED:
        return Decision(Action.DIAGNOSE, "collecting py-spy stacks of every rank")
    if policy == RecoveryPolicy.OBSERVE:
        return Decision(Action.OBSERVE, "observe: stacks collected, no action")
    victims = list(f.suspects)
    if policy == RecoveryPolicy.LIVE:
        # The survivors left the hung replica out of their quorum and train on; a replacement heals from them.
        return Decision(Action.RESTART, f"live: killed hung rank(s) {victims}; Ray restarts their replicas, which "
                        "heal from a live peer", kill=f.suspects)
    if f.node_id and policy == RecoveryPolicy.EVICT_RESTART:
        if f.node_id in history.no_room:
            return Decision(Action.RESTART, f"killed hung rank(s) {victims}, {f.node_id} not evicted: the job's workers "
                            "would not fit on the other nodes; Ray Train restarts the group", kill=f.suspects)
        if f.node_id in history.head_nodes:
            return Decision(Action.RESTART, f"killed hung rank(s) {victims}, {f.node_id} is the Ray head: not evicted; "
                            "Ray Train restarts the group", kill=f.suspects)
        return Decision(Action.EVICT_AND_RESTART,
                        f"killed hung rank(s) {victims}, evicted {f.node_id}; Ray Train restarts the group",
                        evict=f.node_id, evict_reason=f"hang of job {f.job_id} (rank {f.rank})", kill=f.suspects)
    return Decision(Action.RESTART, f"killed hung rank(s) {victims}; Ray Train restarts the group", kill=f.suspects)


def _slow_node(f: Finding, policy: RecoveryPolicy, history: History) -> Decision:
    if policy not in (RecoveryPolicy.EVICT_RESTART, RecoveryPolicy.LIVE) or not f.node_id:
        return Decision(Action.OBSERVE)
    if policy == RecoveryPolicy.LIVE:
        return _slow_node_live(f, history)
    if f.node_id in history.no_room:
        # Evicting it would leave the job nowhere to run: the finding stays on record, the job runs on.
        return Decision(Action.CLOSE, f"not evicted: the job's workers would not fit without {f.node_id}; the job "
                        "runs on there")
    if f.node_id in history.head_nodes:
        # A restart would land on the same slow node: the finding stays on record, the job runs on.
        return Decision(Action.CLOSE,
                        f"not evicted: {f.node_id} is the Ray head (GCS, job drivers); the job runs on there")
    cls = f.evidence.get("class")
    if f.kind == IncidentKind.NIC_DEGRADED or cls == "communication-slow":
        why = f"{cls} NIC of job {f.job_id}"
    elif f.evidence.get("basis") == "collective-wait":
        why = f"straggler rank {f.rank} of job {f.job_id} (its peers wait for it)"
    else:
        why = f"straggler rank {f.rank} of job {f.job_id}"
    return Decision(Action.EVICT_AND_RESTART, f"evicted {f.node_id}; Ray Train restarts the group on healthy nodes",
                    evict=f.node_id, evict_reason=why)


def _slow_node_live(f: Finding, history: History) -> Decision:
    """Under ``live``: the slow rank's replica is killed and replaced (it heals from a live peer), on
    another node when its node can be evicted (a drain: Ray places nothing new there)."""
    assert f.node_id is not None
    kill = (f.rank,) if f.rank is not None else ()
    what = f"rank {f.rank}'s replica" if f.rank is not None else f"the replicas of {f.node_id}"
    if f.node_id in history.no_room or f.node_id in history.head_nodes:
        where = "the Ray head" if f.node_id in history.head_nodes else "needed: no room elsewhere"
        if not kill:
            return Decision(Action.CLOSE, f"live: not evicted: {f.node_id} is {where}; the job runs on there")
        return Decision(Action.RESTART, f"live: killed {what} ({f.node_id} not evicted: {where}); Ray restarts it, "
                        "it heals from a live peer", kill=kill)
    why = (f"{f.evidence.get('class')} NIC of job {f.job_id}" if f.kind == IncidentKind.NIC_DEGRADED
           or f.evidence.get("class") == "communication-slow" else f"straggler rank {f.rank} of job {f.job_id}")
    return Decision(Action.EVICT_AND_RESTART, f"live: evicted {f.node_id}, killed {what}; Ray restarts it on a healthy "
                    "node, it heals from a live peer while the others train on", evict=f.node_id, evict_reason=why,
                    kill=kill)


def _manual(f: Finding, policy: RecoveryPolicy, history: History) -> Decision:
    reason = f.evidence.get("reason", "manual")
    evict = f.node_id if f.node_id and f.node_id not in history.head_nodes | history.no_room else None
    why = f"manual recovery of {f.job_id}: {reason}"
    if policy == RecoveryPolicy.OBSERVE:
        # The user's restart is carried out, but not followed as Vigil's own recovery: the incident is
        # CLOSED at once (an OPEN one would quiet the job's detectors until the job ends).
        return Decision(Action.CLOSE, f"observe: manual: {reason} (carried out; not followed by Vigil)", evict=evict,
                        evict_reason=why, kill_all=True)
    return Decision(Action.EVICT_AND_RESTART if evict else Action.RESTART, f"manual: {reason}", evict=evict,
                    evict_reason=why, kill_all=True)


def _resumed(spec: RecoverySpec | None, history: History) -> Decision:
    limit = max(1, spec.max_restarts) if spec is not None else 1
    if history.stalled_restarts >= limit:
        return Decision(Action.FAIL, f"no progress across {history.stalled_restarts} restarts")
    return Decision(Action.OBSERVE)
