"""Recovery actions: what Vigil does to a job or a node, for the monitor and for the API alike.

* :func:`restart_job`: manual recovery (``POST /jobs/{id}/recover``): kill every rank so that Ray
  Train restarts the worker group from the newest valid checkpoint, evicting a node first if asked;
* :func:`evict_node` / :func:`readmit_node`: ``POST /nodes/{id}/evict`` / ``.../readmit`` and the
  monitor's evictions (the Ray head is refused: :class:`HeadNodeError`);
* :func:`fail_job`: stop the job FAILED (bounded restarts);
* :func:`carry_out`: a policy :class:`~controller.recovery.policy.Decision` on a finding, as it is: open
  (or take up) its incident, record a refused eviction, evict, collect stacks, kill ranks, and move the
  incident on. It decides nothing: the Ray head and the room left are facts the policy had
  (:mod:`controller.recovery.facts`; ``is_head_node`` and ``leaves_room`` are re-exported here).

Ranks and nodes are acted on through agent commands (:mod:`controller.recovery.commands`) and Ray's
node draining (the launcher's :class:`~controller.launcher.ClusterControl`); incidents only through
:mod:`controller.recovery.incidents`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace

from sqlalchemy.orm import Session

from controller.jobs import record_event, transition
from controller.launcher import ClusterControl, JobLauncher, LaunchError
from controller.models import Incident, Job, Node
from controller.recovery import adapt, commands, facts, incidents, policy, reads
from controller.recovery.detectors import Finding, Stage
from controller.recovery.facts import head_refusal, is_head_node, leaves_room
from vigil.contract.schemas import CommandKind, IncidentKind, JobCreate, JobStatus, NodeState

__all__ = ["HeadNodeError", "carry_out", "evict_node", "fail_job", "is_head_node", "leaves_room", "mark_node_dead",
           "readmit_node", "restart_job"]

log = logging.getLogger(__name__)


class HeadNodeError(ValueError):
    """Eviction refused: the node is the Ray head."""


def evict_node(s: Session, cluster: ClusterControl | None, node_id: str, reason: str, deadline_s: float) -> str:
    """Drain ``node_id`` in Ray (ranks there checkpoint, then restart elsewhere) and mark it EVICTED.

    The Ray head is refused (HeadNodeError): the GCS, every job driver and every Ray Train controller
    live there (Ray Train pins each worker group's synchronization actor to the driver's node), so a
    drained head takes every job down with it instead of moving one job's ranks.
    """
    node = s.get(Node, node_id)
    if node is None:
        raise LookupError(node_id)
    if is_head_node(cluster, node_id):
        raise HeadNodeError(head_refusal(node_id))
    outcome = "marked evicted"
    if cluster is not None:
        try:
            accepted = cluster.drain_node(node_id, deadline_s, reason)
            outcome = f"drained in Ray with a {deadline_s:.0f}s deadline" if accepted else "Ray refused the drain"
        except LaunchError as exc:
            outcome = f"drain failed: {exc}"
    node.state = NodeState.EVICTED.value
    record_event(s, "node_evicted", f"{node_id} evicted ({reason}): {outcome}", node_id=node_id,
                 data={"reason": reason, "deadline_s": deadline_s})
    return outcome


def readmit_node(s: Session, node_id: str) -> None:
    """Put an evicted node back: its agent starts a fresh raylet (Ray never un-drains a node)."""
    node = s.get(Node, node_id)
    if node is None:
        raise LookupError(node_id)
    if node.state != NodeState.EVICTED.value:
        raise ValueError(f"node {node_id} is {node.state}, not EVICTED")
    commands.enqueue(s, node_id, CommandKind.STOP_RAYLET, {})
    commands.enqueue(s, node_id, CommandKind.START_RAYLET, {})
    node.state = NodeState.ALIVE.value
    record_event(s, "node_readmitted", f"{node_id} readmitted", node_id=node_id)


def mark_node_dead(s: Session, node_id: str, age_s: float) -> None:
    """A node not heard from for ``age_s``: DEAD (Ray Train restarts its jobs' groups without it)."""
    node = s.get(Node, node_id)
    if node is None or node.state != NodeState.ALIVE.value:
        return
    node.state = NodeState.DEAD.value
    record_event(s, "node_dead", f"no heartbeat from {node.id} for {age_s:.1f}s", node_id=node.id)


def fail_job(s: Session, launcher: JobLauncher | None, job: Job, reason: str) -> None:
    """Stop the job in Ray (best effort) and mark it FAILED with ``reason``."""
    if launcher is not None and job.ray_job_id:
        try:
            launcher.stop(job.ray_job_id)
        except LaunchError as exc:
            log.warning("could not stop %s: %s", job.id, exc)
    transition(s, job, JobStatus.FAILED, reason)


def kill_ranks(s: Session, job: Job, inc: Incident, ranks: Iterable[int] | None = None) -> None:
    """SIGKILL ``ranks`` (default: every rank of the job, by rank) through their agents; Ray Train then
    restarts the worker group from the newest valid checkpoint. Ranks not located are skipped."""
    locs = reads.rank_locations(s, job.id)
    for rank in sorted(locs) if ranks is None else ranks:
        if rank in locs:
            commands.enqueue(s, locs[rank].node_id, CommandKind.KILL_PID, {"pid": locs[rank].pid, "signal": 9},
                             job_id=job.id, incident_id=inc.id)


def collect_stacks(s: Session, job: Job, inc: Incident) -> None:
    """Ask every node holding ranks of the job for py-spy stacks of them (answers become StackDumps)."""
    by_node: dict[str, dict[str, int]] = defaultdict(dict)
    for rank, loc in reads.rank_locations(s, job.id).items():
        by_node[loc.node_id][str(rank)] = loc.pid
    for node_id, pids in by_node.items():
        commands.enqueue(s, node_id, CommandKind.PYSPY_DUMP, {"job_id": job.id, "pids": pids}, job_id=job.id,
                         incident_id=inc.id)


def carry_out(s: Session, decision: policy.Decision, finding: Finding, job: Job | None, *,
              cluster: ClusterControl | None, launcher: JobLauncher | None, deadline_s: float,
              clock: Callable[[], float]) -> Incident | None:
    """Carry out ``decision`` on ``finding`` as it is: open its incident (or take up ``finding.incident_id``),
    record an eviction the policy refused (``decision.refused``: an ``eviction_refused`` event), evict,
    collect stacks, kill, then move the incident on. None when the decision is to ignore the finding."""
    if decision.action == policy.Action.IGNORE:
        return None
    if finding.incident_id is not None:
        inc = s.get(Incident, finding.incident_id)
        assert inc is not None, finding
    else:
        inc = incidents.open_incident(s, finding, clock())
    if finding.stage == Stage.DIAGNOSED:
        incidents.annotate(inc, finding)
    if decision.refused is not None:
        record_event(s, "eviction_refused", decision.refused, job_id=inc.job_id, node_id=finding.node_id,
                     data={"incident_id": inc.id, "reason": decision.evict_reason})
    if decision.evict is not None:
        _evict(s, cluster, decision, inc, deadline_s)
    if job is not None:
        if decision.action == policy.Action.DIAGNOSE:
            collect_stacks(s, job, inc)
        if decision.kill_all or decision.kill:
            kill_ranks(s, job, inc, None if decision.kill_all else decision.kill)
        if decision.action == policy.Action.ADAPT:
            spec = JobCreate.model_validate(job.spec)
            assert spec.recovery.adapt is not None, job.id
            adapt.request(s, job, inc, spec.recovery.adapt.params, clock())
    if decision.action in policy.ACTING_ACTIONS:
        assert decision.reason is not None, decision
        incidents.act(s, inc, decision.reason, clock())
    elif decision.action == policy.Action.CLOSE:
        incidents.close(inc, decision.reason)
    elif decision.action == policy.Action.FAIL:
        assert job is not None, finding
        fail_job(s, launcher, job, decision.reason or "recovery gave up")
    elif decision.reason is not None:
        incidents.note(inc, decision.reason)
    return inc


def _evict(s: Session, cluster: ClusterControl | None, decision: policy.Decision, inc: Incident,
           deadline_s: float) -> None:
    """Drain the decision's node. The policy knew whether it is the Ray head (its facts); one that became the
    head since is still never drained (:func:`evict_node` refuses it): the refusal is recorded and the rest
    of the decision (the kills, the incident's move) goes on, as decided."""
    assert decision.evict is not None, decision
    try:
        evict_node(s, cluster, decision.evict, decision.evict_reason, deadline_s)
    except HeadNodeError as exc:
        log.warning("incident %s: %s", inc.id, exc)
        record_event(s, "eviction_refused", str(exc), job_id=inc.job_id, node_id=decision.evict,
                     data={"incident_id": inc.id, "reason": decision.evict_reason})


def restart_job(s: Session, cluster: ClusterControl | None, job: Job, reason: str, evict: str | None = None, *,
                clock: Callable[[], float] = time.time) -> Incident:
    """Manual recovery (``POST /jobs/{id}/recover``): a ``manual`` incident, ``evict`` drained first if given,
    then every rank killed so that Ray Train restarts the group from the newest valid checkpoint.

    The caller checks that the job runs and that ``evict`` exists and is not the Ray head (the API
    answers 404/409); a head found here anyway is kept, with an ``eviction_refused`` event. The node the
    user named is drained whatever room is left (the facts are gathered without the room check).
    """
    spec = JobCreate.model_validate(job.spec)
    finding = Finding(IncidentKind.MANUAL, job.id, evict, None, {"manual": True, "reason": reason}, step=job.last_step)
    inc = incidents.open_incident(s, finding, clock(), announce=False)
    finding = replace(finding, incident_id=inc.id)
    known = facts.gather(s, cluster, job, spec, finding, check_room=False)
    decision = policy.policy_for(spec.recovery).decide(finding, known)
    carry_out(s, decision, finding, job, cluster=cluster, launcher=None,
              deadline_s=spec.recovery.thresholds.drain_deadline_s, clock=clock)
    return inc
