"""The plan and the verdicts of ``vigil bench chaos`` (:mod:`ops.bench.chaos`): pure code, no cluster.

What each kind of fault must cause (:data:`EXPECT`), the seeded schedule (:func:`draw_schedule`), the
records of what happened (:class:`FaultRecord`, :class:`IncidentView`) and the scoring
(:func:`judge`, :func:`score`): which incident belongs to which fault, culprit, recovery, false
positives. Kept apart from the run so that it is tested on its own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

CKPT_INTERVAL = 50
"""Steps between checkpoints. A straggler is scored only outside a checkpoint's shadow (a third of the
interval after it, docs/RECOVERY.md), so not much shorter; a restart replays up to an interval."""
CALIBRATION_STEPS = 150
SETTLE_STEPS = 60
"""Steps the job runs between the resolution of a fault and the next one: the straggler detector
compares a rank with its own recent past (the 50 steps before)."""
END_MARGIN_STEPS = 3 * CKPT_INTERVAL + 50
"""No fault is injected this close to the job's last step: its detection and restart must fit."""
GRACE_S = 5.0
"""An incident detected this long after a fault was resolved still belongs to it."""
RESTART_GAP_S = 5.0
"""A pause in rank 0's steps this long is a restart (as the monitor's ``restart_gap_s``)."""
AWAIT_S = {"hang_rank": 300.0, "corrupt_checkpoint": 300.0, "partition_node": 300.0}
"""How long a fault may take to be resolved (default :data:`AWAIT_DEFAULT_S`)."""
AWAIT_DEFAULT_S = 240.0
QUIET_S = 20.0
"""A no-incident fault is watched at least this long (a lost node shows after 4 s, a dead rank 1.5 s later)."""
STUCK_S = 300.0
"""A job that has not stepped for this long is stuck: the bench cancels it and says so (``status``)."""

FINAL_STATUSES = frozenset({"RECOVERED", "CLOSED", "FAILED"})


@dataclass(frozen=True)
class Expect:
    """What a kind of fault must produce."""

    kinds: frozenset[str]
    """Incident kinds that are its expected signal (empty: no incident is expected)."""
    culprit: str
    """How the culprit is checked: ``rank`` (rank and node), ``node``, ``nan`` (rank, step at or after the
    one asked), ``checkpoint`` (the corrupted step skipped), ``none`` (no incident at all)."""
    signal: str = "incident"
    """``incident``; ``checkpoint_invalid`` (an event); ``heartbeat`` / ``health`` (the process came back)."""
    also: frozenset[str] = frozenset()
    """Incident kinds it may cause besides (not false positives)."""
    disrupts: bool = True
    """Whether the job is expected to restart (False: it must step on undisturbed)."""

    @property
    def accepts(self) -> frozenset[str]:
        return self.kinds | self.also


_NIC = frozenset({"nic_degraded", "straggler"})  # a sick NIC, or the communication-slow rank behind it
EXPECT: dict[str, Expect] = {
    "kill_rank": Expect(frozenset({"rank_died"}), "rank"),
    "kill_9": Expect(frozenset({"rank_died"}), "rank"),
    "kill_node": Expect(frozenset({"node_lost"}), "node"),
    "hang_rank": Expect(frozenset({"hang"}), "rank"),
    "slow_rank": Expect(frozenset({"straggler"}), "rank"),
    "nan_loss": Expect(frozenset({"nan_loss"}), "nan"),
    # The rank stopped (to freeze the checkpoints) and then killed is the fault's trigger: its death (or,
    # should the freeze outlast the hang floor, its hang) is part of it.
    "corrupt_checkpoint": Expect(frozenset(), "checkpoint", "checkpoint_invalid", frozenset({"rank_died", "hang"})),
    "agent_kill_9": Expect(frozenset(), "none", "heartbeat", disrupts=False),
    "controller_kill_9": Expect(frozenset(), "none", "health", disrupts=False),
    "degrade_nic": Expect(_NIC, "node"),
    "nic_loss": Expect(_NIC, "node"),
    "flap_nic": Expect(_NIC, "node"),
    # Every packet dropped both ways: the agent's heartbeats stop too (a lost node); the ranks' collectives
    # stall and the group fails while the node is cut off.
    "partition_node": Expect(frozenset({"node_lost"}), "node", also=frozenset({"nic_degraded", "rank_died", "hang"})),
}
BASE_KINDS = ("kill_rank", "kill_9", "kill_node", "hang_rank", "slow_rank", "nan_loss", "corrupt_checkpoint",
              "agent_kill_9", "controller_kill_9")
NET_KINDS = ("degrade_nic", "nic_loss", "partition_node", "flap_nic")
API_KINDS = frozenset({"kill_rank", "kill_node", "hang_rank", "slow_rank", "nan_loss", *NET_KINDS})
"""Kinds injected through ``POST /jobs/{id}/faults`` (the others from outside)."""
IN_RANK = frozenset({"nan_loss", "slow_rank"})
"""Kinds the rank fires itself at the step asked (a fault file)."""
CLEARED_AFTER = frozenset({"hang_rank", "slow_rank", *NET_KINDS})
"""Kinds whose fault is cleared once resolved (a slow rank or a sick link would otherwise stay so)."""


# -- the schedule ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One fault of the schedule."""

    at_s: float
    """Seconds after the start of the fault phase, at the earliest."""
    kind: str
    rank: int
    """The target rank (node kinds: the node it runs on)."""
    ahead: int
    """Steps after the job's last step at which it is asked to fire."""
    params: dict[str, Any] = field(default_factory=dict)


def eligible_kinds(netns: bool, only: Iterable[str] | None = None) -> list[str]:
    """The kinds a run draws from: every base kind, the network kinds with ``netns``; ``only`` restricts
    (ValueError for an unknown kind, or a network kind without ``netns``)."""
    kinds = [*BASE_KINDS, *(NET_KINDS if netns else ())]
    if not only:
        return kinds
    wanted = [k.strip() for k in only if k.strip()]
    for k in wanted:
        if k not in EXPECT:
            raise ValueError(f"unknown fault kind {k!r} (known: {', '.join(EXPECT)})")
        if k in NET_KINDS and not netns:
            raise ValueError(f"{k} needs --netns (network namespaces, root, ip and tc)")
    return [k for k in kinds if k in wanted]


def _params(kind: str, rng: random.Random) -> dict[str, Any]:
    if kind == "slow_rank":
        return {"factor": round(rng.uniform(3.0, 4.0), 2), "mode": "compute"}
    if kind == "controller_kill_9":
        return {"down_s": round(rng.uniform(2.0, 12.0), 1)}
    if kind == "agent_kill_9":
        return {"down_s": round(rng.uniform(0.0, 1.0), 1)}
    if kind == "degrade_nic":
        return {"fraction": 0.25}
    if kind == "nic_loss":
        return {"percent": 10}
    if kind == "partition_node":
        return {"seconds": 20}
    if kind == "flap_nic":
        return {"seconds": 2, "up_s": 2, "times": 2}
    return {}


def draw_schedule(seed: int, minutes: float, gap_s: float, kinds: Sequence[str], world_size: int = 2) -> list[Planned]:
    """The faults of a run, the same for the same arguments (see the module's docstring)."""
    if not kinds:
        raise ValueError("no fault kinds to draw from")
    if gap_s <= 0:
        raise ValueError("the gap between faults must be positive")
    rng = random.Random(seed)
    horizon = minutes * 60.0
    offsets = []
    t = gap_s * rng.uniform(0.3, 0.7)
    while t < horizon:
        offsets.append(t)
        t += gap_s * rng.uniform(0.5, 1.5)
    order = list(kinds)
    rng.shuffle(order)  # every kind once first, so a run long enough covers them all
    while len(order) < len(offsets):
        order.append(rng.choice(list(kinds)))
    return [Planned(round(at, 1), kind, rng.randrange(world_size), rng.randint(10, 25), _params(kind, rng))
            for at, kind in zip(offsets, order, strict=False)]


# -- what happened ---------------------------------------------------------------------------------------


@dataclass
class FaultRecord:
    """One injected fault, as the bench saw it (times are unix seconds)."""

    kind: str
    rank: int | None
    node: str | None = None
    step_asked: int | None = None
    step_hit: int | None = None
    """The job's step when the fault hit (the controller's, a fault file's own step, or the last step at a kill)."""
    params: dict[str, Any] = field(default_factory=dict)
    fault_id: int | None = None
    injected_at: float = 0.0
    fired_at: float | None = None
    resolved_at: float | None = None
    gave_up_at: float | None = None
    """When the bench stopped waiting for the fault to be resolved (then it clears what it can itself: what
    the job does after that is no recovery of Vigil's)."""
    signal_seen: bool = False
    """``agent_kill_9``: the node heard from the new agent; ``controller_kill_9``: the controller answered again."""
    corrupted_step: int | None = None
    invalid_steps: list[int] = field(default_factory=list)
    invalid_at: float | None = None
    restored_step: int | None = None
    in_rank: bool = False
    """Carried out by the rank itself (a fault file) at the step asked."""
    hit_read: bool = False
    """``step_hit`` / ``fired_at`` of an in-rank fault read from the step rows."""
    restores_before: int = 0
    """Restores the job's logs showed before the corrupt checkpoint's trigger."""
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class IncidentView:
    """An incident as scoring needs it (times are unix seconds)."""

    id: int
    kind: str
    job_id: str | None
    node_id: str | None
    rank: int | None
    status: str
    detected_at: float
    acted_at: float | None = None
    recovered_at: float | None = None
    step_at_detect: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def brief(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "job_id": self.job_id, "node_id": self.node_id, "rank": self.rank,
                "status": self.status, "detected_at": round(self.detected_at, 2), "step_at_detect": self.step_at_detect}


def _first_restart(rank0: Sequence[tuple[float, int]], since: float, until: float, gap_s: float) -> float | None:
    """Time of rank 0's first step in (since, until] that shows a restart: its step goes back (or repeats),
    or it comes ``gap_s`` after the step before."""
    prev_step, prev_ts = -1, since
    for ts, st in rank0:
        if ts <= since:
            prev_step = max(prev_step, st)
            continue
        if ts > until:
            break
        if st <= prev_step or ts - prev_ts > gap_s:
            return ts
        prev_step, prev_ts = st, ts
    return None


def _progressed(rank0: Sequence[tuple[float, int]], after: float, until: float, past: int) -> bool:
    return any(after < ts <= until and st > past for ts, st in rank0)


def _names_target(f: FaultRecord, exp: Expect, inc: IncidentView) -> bool:
    """Whether ``inc`` blames what ``f`` hit (the rank and its node, the node, or for a NaN the rank)."""
    if exp.culprit == "node":
        return inc.node_id == f.node
    if exp.culprit == "nan":
        return inc.rank == f.rank
    return inc.rank == f.rank and inc.node_id == f.node


def _culprit(f: FaultRecord, exp: Expect, inc: IncidentView | None, window: list[IncidentView]) -> bool:
    if exp.culprit == "none":
        return not window
    if exp.culprit == "checkpoint":
        c = f.corrupted_step
        return (c is not None and c in f.invalid_steps and all(s > c for s in f.invalid_steps if s != c)
                and f.restored_step is not None and f.restored_step < c)
    if inc is None:
        return False
    if exp.culprit == "nan":
        return _names_target(f, exp, inc) and int(inc.evidence.get("step", -1)) >= (f.step_asked or 0)
    return _names_target(f, exp, inc)


def judge(f: FaultRecord, accepted: list[IncidentView], window: list[IncidentView],
          rank0: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """One fault's entry of ``faults``: its record and what came of it (module docstring)."""
    exp = EXPECT[f.kind]
    inc = next((i for i in accepted if i.kind in exp.kinds), None)
    fired = f.fired_at if f.fired_at is not None else f.injected_at
    until = f.gave_up_at if f.gave_up_at is not None else (
        f.resolved_at if f.resolved_at is not None else math.inf) + GRACE_S
    if exp.signal == "incident":
        detected = inc is not None
        detect_s = inc.detected_at - fired if inc is not None else None
    elif exp.signal == "checkpoint_invalid":
        detected = f.corrupted_step is not None and f.corrupted_step in f.invalid_steps
        detect_s = f.invalid_at - fired if detected and f.invalid_at is not None else None
    else:
        detected, detect_s = f.signal_seen, None
    reached = max([x for x in (f.step_hit, f.step_asked, inc.step_at_detect if inc else None) if x is not None],
                  default=0)
    recover_s = None
    if exp.disrupts:
        restart = _first_restart(rank0, fired, until, RESTART_GAP_S)
        if restart is not None:
            recovered = _progressed(rank0, restart - 1e-9, until, reached)
            recover_s = restart - fired
        else:  # no restart: only right when Vigil did not act (e.g. a straggler it could not evict) and the job went on
            recovered = (inc is not None and inc.acted_at is None and inc.status in ("RECOVERED", "CLOSED")
                         and _progressed(rank0, inc.detected_at, until, reached))
    else:
        recovered = (_first_restart(rank0, fired, until, math.inf) is None
                     and _progressed(rank0, fired, until, f.step_hit or 0))
    return {
        "kind": f.kind, "rank": f.rank, "node": f.node, "step_asked": f.step_asked, "step_hit": f.step_hit,
        "params": f.params, "fault_id": f.fault_id,
        "incident_id": inc.id if inc else None, "incident_kind": inc.kind if inc else None,
        "incident_status": inc.status if inc else None,
        "incident_rank": inc.rank if inc else None, "incident_node": inc.node_id if inc else None,
        "other_incidents": [i.brief() for i in window if inc is None or i.id != inc.id],
        "detected": detected, "culprit_correct": detected and _culprit(f, exp, inc, window), "recovered": recovered,
        "seconds_to_detect": round(detect_s, 2) if detect_s is not None else None,
        "seconds_to_recover": round(recover_s, 2) if recover_s is not None else None,
        **({"corrupted_step": f.corrupted_step, "invalid_steps": f.invalid_steps, "restored_step": f.restored_step}
           if f.kind == "corrupt_checkpoint" else {}),
        "injected_at": round(f.injected_at, 2), "fired_at": round(fired, 2),
        "resolved_at": round(f.resolved_at, 2) if f.resolved_at is not None else None,
        "gave_up_at": round(f.gave_up_at, 2) if f.gave_up_at is not None else None,
        "error": f.error, "notes": f.notes,
    }


def score(faults: Sequence[FaultRecord], incidents: Iterable[IncidentView],
          rank0: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """Counts and per-fault details from the faults injected, every incident of the run and rank 0's
    (end time, step) rows of the faulted job, in time order (module docstring)."""
    accepted: list[list[IncidentView]] = [[] for _ in faults]
    window: list[list[IncidentView]] = [[] for _ in faults]
    false_positives = []
    for inc in sorted(incidents, key=lambda i: (i.detected_at, i.id)):
        owner = None
        for n, f in enumerate(faults):
            hi = (f.resolved_at if f.resolved_at is not None else math.inf) + GRACE_S
            if f.injected_at - 1.0 <= inc.detected_at <= hi:
                window[n].append(inc)
                exp = EXPECT[f.kind]
                first = not any(i.kind in exp.kinds for i in accepted[n])
                if inc.kind in exp.also or (inc.kind in exp.kinds and (first or _names_target(f, exp, inc))):
                    owner = n  # its consequence, its incident, or the same finding again
                break
        if owner is None:
            false_positives.append(inc)
        else:
            accepted[owner].append(inc)
    results = [judge(f, accepted[n], window[n], rank0) for n, f in enumerate(faults)]
    return {
        "faults_injected": len(results),
        "detected": sum(r["detected"] for r in results),
        "culprit_correct": sum(r["culprit_correct"] for r in results),
        "recovered": sum(r["recovered"] for r in results),
        "false_positives": len(false_positives),
        "false_positive_incidents": [i.brief() for i in false_positives],
        "faults": results,
    }
