"""Detectors: what is wrong, and with which node or rank. Pure reads; the monitor acts on what they find.

Each detector looks at the stored telemetry, heartbeats and incidents through
:mod:`controller.recovery.reads`, writes nothing, and returns :class:`Finding` s: the incident kind,
the suspect node and/or rank, and the evidence (the numbers that triggered it, stored on the
incident as they are). :mod:`controller.recovery.policy` decides what each finding calls for.

Here: node lost, rank died, NaN loss / loss spike, hang (and its diagnosis from py-spy stacks), NIC
degraded (the NIC detector of :mod:`controller.recovery.nic`, adapted), and a job's restart after a
recovery action. Stragglers (compute-slow and late ranks) are :mod:`controller.recovery.stragglers`.
Thresholds are the job's ``recovery.thresholds`` (:class:`~vigil.contract.schemas.RecoveryThresholds`);
the heartbeat timeout is the monitor's own.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from controller.models import Incident, Job, Node
from controller.recovery import collectives, nic, reads
from controller.recovery.stacks import SUSPECT_STATES, group_stacks, process_state
from vigil.contract.schemas import IncidentKind, IncidentStatus, JobStatus, NodeState, RecoveryThresholds


class Stage(str, enum.Enum):
    """Where a finding stands in its incident's life."""

    DETECTED = "detected"  # a new fault: an incident is opened for it
    DIAGNOSED = "diagnosed"  # more evidence on an incident under way (a hang's stacks are in): now decide
    RESUMED = "resumed"  # the job restarted after Vigil acted on the incident


@dataclass(frozen=True)
class Finding:
    """One thing a detector found (see the module docstring)."""

    kind: IncidentKind
    job_id: str | None
    node_id: str | None
    rank: int | None
    evidence: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    """The job's newest step when found (the incident's ``step_at_detect``)."""
    stage: Stage = Stage.DETECTED
    incident_id: int | None = None
    """The incident under way this finding is about (DIAGNOSED, RESUMED; a manual recovery's own)."""
    suspects: tuple[int, ...] = ()
    """Ranks to act on, in order (a diagnosed hang: the odd ranks out, else every rank)."""


@dataclass(frozen=True)
class LostNode:
    """A node whose heartbeats stopped: one ``node_lost`` finding per running job with ranks there (one
    without a job when none has)."""

    node_id: str
    age_s: float
    findings: list[Finding]


# -- nodes ----------------------------------------------------------------------------------------------


def lost_nodes(s: Session, now: float, timeout_s: float, since: float | None = None) -> list[LostNode]:
    """ALIVE nodes not heard from for more than ``timeout_s``, silence counted from ``since`` at the
    earliest (the monitor's start: a restarted controller must not take its own absence for the nodes')."""
    out = []
    for node in reads.alive_nodes(s):
        if node.last_heartbeat is None:
            continue
        age = now - node.last_heartbeat.timestamp()
        if now - max(node.last_heartbeat.timestamp(), since or 0.0) <= timeout_s:
            continue
        jobs = {r.get("job_id") for r in node.ranks or []}
        running = [j for j in jobs if j and (job := s.get(Job, j)) and job.status == JobStatus.RUNNING.value]
        findings = []
        for job_id in running or [None]:
            job = s.get(Job, job_id) if job_id else None
            ranks = sorted({int(r["rank"]) for r in node.ranks or [] if r.get("job_id") == job_id})
            findings.append(Finding(IncidentKind.NODE_LOST, job_id, node.id, ranks[0] if len(ranks) == 1 else None,
                                    {"heartbeat_age_s": round(age, 2), "timeout_s": timeout_s, "ranks": ranks},
                                    step=job.last_step if job else None))
        out.append(LostNode(node.id, age, findings))
    return out


def nodes_heard_again(s: Session) -> list[Incident]:
    """OPEN ``node_lost`` incidents whose node is ALIVE again (a late heartbeat, or a host that came back;
    one whose job was restarted elsewhere is ACTING and followed by :func:`resumed`)."""
    out = []
    for inc in reads.open_node_losses(s):
        node = s.get(Node, inc.node_id) if inc.node_id else None
        if node is not None and node.state == NodeState.ALIVE.value:
            out.append(inc)
    return out


# -- ranks ----------------------------------------------------------------------------------------------


def rank_died(s: Session, job: Job, steps: int, th: RecoveryThresholds, now: float,
              live: bool = False) -> list[Finding]:
    """The rank whose process died first (the agents report each rank's pid alive or not). ``live``: each
    death is its own (live recovery replaces one replica, the others train on: no group goes down after it),
    and is found although the rank already runs again (a warm spare took over before the death was named)."""
    if job.last_step is not None and job.last_step >= steps:
        return []  # the job is finishing: its ranks exit
    # Deaths before the current worker group started belong to an older group (Ray Train's restart, or
    # Vigil's own kill or rollback, took it down): neither a new culprit nor a stale pid to name.
    attempt = reads.current_attempt(s, job.id)
    started = reads.attempt_started(s, job.id, attempt) if attempt > 1 else None  # attempt 1: no older group
    if live:
        return _replica_died(s, job, th, now, started)
    dead = {rank: loc for rank, loc in reads.rank_locations(s, job.id).items()
            if not loc.alive and not (started is not None and loc.dead_since is not None and loc.dead_since < started)}
    for rank, loc in dead.items():
        if reads.death_seen(s, job.id, rank, loc.pid):
            return []  # this death is already an incident; the rest of its group went down after it
    if not dead:
        return []
    # When one rank dies, Ray Train takes the rest of the group down after it: the culprit is the
    # rank whose death was seen first. Wait a moment for every agent to report before naming it.
    first_rank, first = min(dead.items(), key=lambda kv: (kv[1].dead_since or float("inf"), kv[0]))
    if first.dead_since is not None and now - first.dead_since < th.death_grace_s:
        return []
    return [Finding(IncidentKind.RANK_DIED, job.id, first.node_id, first_rank, {
        "pid": first.pid, "last_step": job.last_step, "dead_since": first.dead_since,
        "also_dead": {str(r): loc.dead_since for r, loc in dead.items() if r != first_rank}}, step=job.last_step)]


def _replica_died(s: Session, job: Job, th: RecoveryThresholds, now: float, started: float | None) -> list[Finding]:
    """:func:`rank_died` under live recovery: the first death not named yet, once it is ``death_grace_s`` old."""
    deaths = sorted(((loc.dead_since or now, rank, loc) for rank, loc in reads.rank_deaths(s, job.id)
                     if not (started is not None and loc.dead_since is not None and loc.dead_since < started)),
                    key=lambda d: (d[0], d[1]))
    for _, rank, loc in deaths:
        if reads.death_seen(s, job.id, rank, loc.pid):
            continue
        if loc.dead_since is not None and now - loc.dead_since < th.death_grace_s:
            return []
        return [Finding(IncidentKind.RANK_DIED, job.id, loc.node_id, rank, {
            "pid": loc.pid, "last_step": job.last_step, "dead_since": loc.dead_since, "also_dead": {}},
            step=job.last_step)]
    return []


# -- loss -----------------------------------------------------------------------------------------------


def loss(s: Session, job: Job, th: RecoveryThresholds) -> list[Finding]:
    """A non-finite loss since Vigil last acted (``nan_loss``), else a loss spike: the newest loss above
    ``spike_ratio`` x the median of the recent window. A fault already under way is not found again."""
    if reads.under_way(s, job.id, IncidentKind.NAN_LOSS) is not None:
        return []
    recent = reads.recent_losses(s, job.id)
    if not recent:
        return []
    since = reads.last_action_ts(s, job.id)
    # A step without a loss is a non-finite loss only from a rank that reports its loss at every step
    # (lately, in any run attempt): code stepped by its optimizer alone (a torchrun script) reports none,
    # a Ray Train function only at its ray.train.report steps (every 20th, say). So: a step without a loss
    # right after two steps with one. (A loss not finite from a job's very first step is not told apart from
    # no loss; nor one at a sparse reporter's report step: docs/RECOVERY.md.)
    finite = {(r.rank, r.step) for r in recent if r.loss is not None}
    seen = {r.rank for r in recent if r.loss is not None}
    bad, earlier = [], None
    for r in recent:
        if r.loss is not None or r.ts <= since:
            continue
        if r.rank in seen:  # a rank with a loss in the window: NaN where it stopped reporting one
            if (r.rank, r.step - 1) in finite and (r.rank, r.step - 2) in finite:
                bad.append(r)
            continue
        earlier = reads.ranks_reporting_loss(s, job.id) if earlier is None else earlier
        if r.rank in earlier:
            bad.append(r)
    if bad:
        first = min(bad, key=lambda r: (r.step, r.rank))
        return [Finding(IncidentKind.NAN_LOSS, job.id, None, first.rank,
                        {"step": first.step, "ranks": sorted({r.rank for r in bad}), "loss": None}, step=job.last_step)]
    finite_losses = [r.loss for r in recent if r.loss is not None]
    if len(finite_losses) >= 50 and reads.under_way(s, job.id, IncidentKind.LOSS_SPIKE) is None:
        newest = recent[0]
        base = statistics.median(finite_losses[5:])
        if newest.loss is not None and base > 0 and newest.loss > th.spike_ratio * base:
            return [Finding(IncidentKind.LOSS_SPIKE, job.id, None, newest.rank,
                            {"step": newest.step, "loss": newest.loss, "median": base}, step=job.last_step)]
    return []


# -- hang -----------------------------------------------------------------------------------------------


def hang(s: Session, job: Job, steps: int, th: RecoveryThresholds, now: float,
         since: float | None = None, *, per_rank: bool = False) -> list[Finding]:
    """No new step for max(``hang_k`` x median step time, ``hang_floor_s``), silence counted from ``since``
    at the earliest (the monitor's start: the steps of a controller's downtime arrive late, from the
    agents' spools). ``per_rank`` (live recovery, whose survivors train on without a hung rank): also one
    rank silent that long while another stepped since, named with its node."""
    if job.last_step is not None and job.last_step >= steps:
        return []  # the last step is done: the ranks are saving and exiting
    last_ts = reads.last_step_ts(s, job.id)
    if last_ts is None:
        return []
    times = reads.recent_step_times(s, job.id)
    median = statistics.median(times) if times else 0.0
    limit = max(th.hang_k * median, th.hang_floor_s)
    idle = now - last_ts
    if per_rank:
        found = _rank_hang(s, job, limit, now, since)
        if found:
            return found
    if now - max(last_ts, since or 0.0) <= limit:
        return []
    return [Finding(IncidentKind.HANG, job.id, None, None,
                    {"idle_s": round(idle, 2), "limit_s": round(limit, 2), "median_step_s": round(median, 4),
                     "last_step": job.last_step}, step=job.last_step)]


def _rank_hang(s: Session, job: Job, limit: float, now: float, since: float | None) -> list[Finding]:
    last = reads.last_step_ts_by_rank(s, job.id)
    if len(last) < 2:
        return []
    rank = min(last, key=lambda r: (last[r], r))
    newest = max(last.values())
    if newest - last[rank] <= limit or now - max(last[rank], since or 0.0) <= limit:
        return []
    loc = reads.rank_locations(s, job.id).get(rank)
    return [Finding(IncidentKind.HANG, job.id, loc.node_id if loc is not None else None, rank,
                    {"idle_s": round(now - last[rank], 2), "limit_s": round(limit, 2), "others_stepped_s_ago":
                     round(now - newest, 2), "last_step": job.last_step}, step=job.last_step)]


def diagnose_hang(s: Session, job: Job, inc: Incident, th: RecoveryThresholds, now: float) -> list[Finding]:
    """An OPEN hang once every rank's py-spy stack and collective report are in (or ``stack_wait_s``
    passed): the stacks grouped by their innermost frames; a single odd rank out becomes the incident's
    rank and node. Suspects: the odd ranks, else every rank."""
    if inc.status != IncidentStatus.OPEN.value:
        return []
    dumps = reads.stack_dumps(s, inc.id)
    expected = len(reads.rank_locations(s, job.id))
    waited = now - inc.detected_at.timestamp()
    if len({d.rank for d in dumps}) < expected and waited < th.stack_wait_s:
        return []
    # Every rank's collective report too, where the ranks have watchers (one reported): a report still on
    # its way would leave the culprit out of the line-up for good (seen in CI: "every rank entered it").
    # A rank its stack shows stopped (SIGSTOP, uninterruptible sleep) sends none: not waited for.
    progress = reads.rank_progress(s, job.id)
    stuck = {d.rank for d in dumps if process_state(d.stack) in SUSPECT_STATES}
    if progress and len(set(progress) | stuck) < expected and waited < th.stack_wait_s:
        return []
    stacks = {d.rank: d.stack for d in dumps}
    groups, odd = group_stacks(stacks)
    locs = reads.rank_locations(s, job.id)
    evidence = {**inc.evidence, "stack_groups": [{"ranks": g.ranks, "signature": g.signature} for g in groups],
                "odd_ranks": odd, "stacks_from": sorted(stacks)}
    # Where each rank stands in its collectives (its watcher's reports): the rank(s) that never entered
    # the collective the others wait in. It names the culprit before the stacks do.
    found = collectives.analyse(progress, [r for r, loc in locs.items() if loc.alive])
    late: list[int] = []
    if found is not None:
        evidence["collectives"] = {**found, "summary": collectives.summary(found)}
        late = found["not_entered"]
    rank, node_id = inc.rank, inc.node_id
    named = late if len(late) == 1 else odd
    if len(named) == 1:
        rank = named[0]
        node_id = locs[rank].node_id if rank in locs else None
    # Suspects: the ranks that never entered the awaited collective, else the odd ranks out by stack; else
    # the rank found silent on its own (live recovery); else every rank.
    suspects = late or odd or ([inc.rank] if inc.rank is not None else sorted(locs))
    return [Finding(IncidentKind.HANG, job.id, node_id, rank, evidence, step=job.last_step, stage=Stage.DIAGNOSED,
                    incident_id=inc.id, suspects=tuple(suspects))]


# -- NIC ------------------------------------------------------------------------------------------------


def nic_degraded(job: Job, found: list[nic.NicFinding]) -> list[Finding]:
    """The NIC detector's findings for ``job`` (``nic.NicDetector.detect``, which keeps each node's
    heartbeat history and so runs every pass) as at most one finding: per node, its communication-slow
    straggler if any, else its first NIC finding (``nic.incidents``); the first node's only, one
    incident per pass."""
    return [Finding(f.kind, job.id, f.node_id, f.rank, f.evidence, step=job.last_step)
            for f in nic.incidents(found)[:1]]


# -- after an action ------------------------------------------------------------------------------------


def resumed(s: Session, job: Job, th: RecoveryThresholds, *, live: bool = False) -> list[Finding]:
    """ACTING incidents of the job after which the job visibly restarted (:func:`restart_seen`; under live
    recovery :func:`rejoin_seen`: the replaced rank back)."""
    out = []
    for inc in reads.acting(s, job.id):
        assert inc.acted_at is not None
        restart_ts = (rejoin_seen(s, job.id, inc.rank, inc.acted_at.timestamp(), inc.detected_at.timestamp())
                      if live and inc.kind != IncidentKind.NAN_LOSS.value
                      else restart_seen(s, job.id, inc.acted_at.timestamp(), th.restart_gap_s))
        if restart_ts is not None:
            out.append(Finding(IncidentKind(inc.kind), job.id, inc.node_id, inc.rank, {"restarted_at": restart_ts},
                               step=job.last_step, stage=Stage.RESUMED, incident_id=inc.id))
    return out


def restart_seen(s: Session, job_id: str, since: float, gap_s: float) -> float | None:
    """Time of the first step after ``since`` that shows the worker group restarted.

    A restart resumes from a checkpoint, so a rank's step number goes back (or repeats); a
    restart right after a checkpoint at the last step shows as a pause (``gap_s``) in the steps instead.
    """
    before = reads.rank0_max_step_until(s, job_id, since)
    prev_step = before if before is not None else -1
    prev_ts = since
    for r in reads.rank0_steps_after(s, job_id, since):
        if r.step <= prev_step or r.ts - prev_ts > gap_s:
            return float(r.ts)
        prev_step, prev_ts = r.step, r.ts
    return None


LIVE_REJOIN_GAP_S = 2.5
"""Live recovery: a pause this long in one rank's own steps, after the action, is its replacement coming
back (a new process: seconds at least); the survivors' own pause while a quorum re-forms is shorter."""
LIVE_HEAL_LOOKBACK_S = 10.0
"""Live recovery: a replacement's heal this long before the detection still answers it (a warm spare can
heal before a death is confirmed: ~2 s after a kill, against ~2.4 s to detect it)."""


def rejoin_seen(s: Session, job_id: str, rank: int | None, since: float, detected: float | None = None) -> float | None:
    """Live recovery: time the replacement of ``rank`` (of any rank: None) stepped with the others: its first
    step from its heal on (the heal record, from :data:`LIVE_HEAL_LOOKBACK_S` before ``detected`` but after the
    job's previous recovery), else the
    first step after ``since`` that follows a pause of :data:`LIVE_REJOIN_GAP_S` in that rank's steps (a
    replacement that did not record its heal). A warm spare comes back without such a pause: only its heal
    tells it apart."""
    if detected is not None:
        earlier = reads.last_recovery_before(s, job_id, detected)  # a heal before it answered that recovery
        heal = reads.first_heal_after(s, job_id, rank, max(detected - LIVE_HEAL_LOOKBACK_S, earlier or 0.0))
        if heal is not None:
            return reads.first_step_from(s, job_id, int(heal.rank), float(heal.ts))
    prev: dict[int, float] = {}
    for r, ts in reads.rank_step_times_around(s, job_id, rank, since):
        if ts > since and r in prev and ts - prev[r] > LIVE_REJOIN_GAP_S:
            return float(ts)
        prev[r] = ts
    return None
