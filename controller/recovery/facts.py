"""What the recovery policy knows when it decides: :class:`Facts`, gathered once per finding by :func:`gather`.

The policy (:mod:`controller.recovery.policy`) reads no database and asks Ray nothing: every fact it needs
is here, gathered before its one ``decide``, and nothing after it turns the decision into another one.

* **recovering**: an incident of the job is under way (the cooldown);
* **head**: the finding's node is the live Ray head (never evicted: its GCS, every job driver and Ray Train
  controller live there);
* **room**: the job's workers (``min_workers x cpus_per_worker`` CPUs) still fit on the live Ray nodes
  other than the finding's node and those Vigil evicted or lost (else evicting it leaves the job nowhere to
  run); with ``refusal``, the ``eviction_refused`` event's text when the node may not be evicted;
* **restarts so far** and **progress since the last restart**: for a finding whose job resumed after an
  action (stage RESUMED), this restart counted in, with ``max_restarts`` and progress as
  :mod:`vigil.contract.restarts` defines them (the resume point: the newest valid checkpoint, or under
  ``live`` a replaced replica's peers' newest step).

Unknown counts as harmless: no cluster or Ray unreachable is "not the head" and "room left", as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.launcher import ClusterControl, LaunchError, RayNode
from controller.models import Job, Node
from controller.recovery import reads
from controller.recovery.detectors import Finding, Stage
from vigil.contract.restarts import RestartBudget, progressed
from vigil.contract.schemas import IncidentKind, JobCreate, NodeState, RecoveryPolicy


@dataclass(frozen=True)
class Facts:
    """Everything :meth:`controller.recovery.policy.Policy.decide` needs besides the finding (module docstring)."""

    recovering: bool = False
    """An incident of the job is under way (OPEN or ACTING; loss spikes aside; under observe ACTING only)."""
    head: bool = False
    """The finding's node is the live Ray head."""
    room: bool = True
    """The job's workers still fit on the other live nodes without the finding's node."""
    refusal: str = ""
    """Why the finding's node may not be evicted (the ``eviction_refused`` event's text); "" when it may."""
    restarts: int = 0
    """The job's restarts so far (for a RESUMED finding, this one included)."""
    stalled_restarts: int = 0
    """Restarts in a row without progress (for a RESUMED finding, this one included)."""
    progressed: bool = True
    """RESUMED: the job's resume point moved forward since the previous restart."""
    resume_point: int | None = None
    """RESUMED: where this restart resumed from (the job's new progress mark); else None."""


def head_refusal(node_id: str) -> str:
    """Why the Ray head is never evicted (the API's 409 detail and the ``eviction_refused`` event)."""
    return (f"node {node_id!r} is the Ray head (GCS, job drivers, Ray Train controllers) and is never evicted; "
            "run no ranks there (`ray start --head --num-cpus=0`) or replace the head")


def _ray_nodes(cluster: ClusterControl | None) -> list[RayNode] | None:
    if cluster is None:
        return None
    try:
        return cluster.nodes()
    except LaunchError:
        return None


def _is_head(nodes: list[RayNode] | None, node_id: str) -> bool:
    return any(n.is_head for n in nodes or [] if n.name == node_id and n.state == "ALIVE")


def _leaves_room(s: Session, nodes: list[RayNode] | None, spec: JobCreate, node_id: str) -> bool:
    if not nodes or not any(n.cpus for n in nodes):
        return True
    out = set(s.scalars(select(Node.id).where(Node.state != NodeState.ALIVE.value)))
    free = sum(n.cpus or 0.0 for n in nodes if n.state == "ALIVE" and n.name != node_id and n.name not in out)
    return free >= spec.scaling.min_workers * spec.scaling.cpus_per_worker


def is_head_node(cluster: ClusterControl | None, node_id: str) -> bool:
    """Whether ``node_id`` is the live Ray head (unknown, e.g. Ray unreachable, counts as no)."""
    return _is_head(_ray_nodes(cluster), node_id)


def leaves_room(s: Session, cluster: ClusterControl | None, spec: JobCreate, node_id: str) -> bool:
    """Whether the job's workers (``min_workers`` x ``cpus_per_worker`` CPUs) still fit on the live Ray nodes
    other than ``node_id`` and those Vigil has evicted or lost. Unknown (no cluster, Ray unreachable, CPUs
    not reported) counts as yes: the check only keeps Vigil from evicting a job out of every place to run."""
    return _leaves_room(s, _ray_nodes(cluster), spec, node_id)


def recovering(s: Session, job: Job) -> bool:
    """Whether a recovery of the job is under way (the cooldown's fact; under observe and adapt only ACTING counts)."""
    # Under observe an incident stays OPEN for good; under adapt one stays OPEN while the job runs adapted (it
    # restarts nothing): only ACTING mutes the detectors then.
    observe = (job.spec.get("recovery") or {}).get("policy") in (RecoveryPolicy.OBSERVE.value,
                                                                 RecoveryPolicy.ADAPT.value)
    return reads.recovering(s, job.id, observe=observe)


def resume_point(s: Session, job: Job, spec: JobCreate, finding: Finding) -> int:
    """Where the restart after ``finding``'s incident resumed from (:mod:`vigil.contract.restarts`): under
    ``live`` a replaced replica heals from its peers at the job's newest step; a restart of every rank (any
    other policy, a rollback, a manual restart) resumes from the newest valid checkpoint (-1: none)."""
    if spec.recovery.policy == RecoveryPolicy.LIVE and finding.kind not in (IncidentKind.NAN_LOSS,
                                                                             IncidentKind.MANUAL):
        return job.last_step or 0
    return reads.newest_valid_step(s, job.id)


def gather(s: Session, cluster: ClusterControl | None, job: Job | None, spec: JobCreate | None,
           finding: Finding, *, check_room: bool = True) -> Facts:
    """The facts for ``finding`` (module docstring). ``check_room=False``: a manual recovery, whose node the
    user named, is evicted whatever room is left (the Ray head aside)."""
    if job is None or spec is None:
        return Facts()
    if finding.stage == Stage.RESUMED:
        point = resume_point(s, job, spec, finding)
        budget = RestartBudget(spec.recovery.max_restarts)
        return Facts(recovering=recovering(s, job), restarts=job.restarts + 1,
                     stalled_restarts=budget.after_restart(job.stalled_restarts, job.progress_mark, point),
                     progressed=progressed(job.progress_mark, point), resume_point=point)
    head, room, refusal = False, True, ""
    if finding.node_id is not None:
        nodes = _ray_nodes(cluster)
        head = _is_head(nodes, finding.node_id)
        room = not check_room or _leaves_room(s, nodes, spec, finding.node_id)
        if not room:
            refusal = (f"{finding.node_id} not evicted: job {job.id}'s {spec.scaling.min_workers} worker(s) would "
                       "not fit on the other nodes")
        elif head:
            refusal = head_refusal(finding.node_id)
    return Facts(recovering=recovering(s, job), head=head, room=room, refusal=refusal, restarts=job.restarts,
                 stalled_restarts=job.stalled_restarts)
