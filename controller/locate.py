"""Where a job's ranks run: node and pid of each rank, from the agents' newest heartbeats.

Read by fault injection (:mod:`controller.faults`: which node's agent carries a fault out, which pid it
signals), by the recovery monitor's detectors and actions (:mod:`controller.recovery`: a dead pid, the
node of a slow rank, whom to kill) and by the REST API (a fault may target only a node holding a rank of
its job). Read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.models import Node
from vigil.contract.schemas import NodeState


@dataclass(frozen=True)
class RankLocation:
    """One rank's process as its node's agent last reported it."""

    node_id: str
    pid: int
    alive: bool
    dead_since: float | None = None
    """When the agent saw the process gone (unix time), None while it lives or when not reported."""


def rank_locations(session: Session, job_id: str) -> dict[int, RankLocation]:
    """Where each rank of ``job_id`` runs, from the newest heartbeats (live processes preferred, then the
    latest to die). Nodes marked DEAD are left out."""
    out: dict[int, RankLocation] = {}
    for node in session.scalars(select(Node).where(Node.state != NodeState.DEAD.value)).all():
        for r in node.ranks or []:
            if r.get("job_id") != job_id:
                continue
            loc = RankLocation(node.id, int(r.get("pid", 0)), bool(r.get("alive", True)), r.get("dead_since"))
            cur = out.get(int(r["rank"]))
            # A live process first; among dead ones the latest to die (an older group's stale entry
            # must not hide the death of the current one).
            if cur is None or (loc.alive and not cur.alive) or (
                    not loc.alive and not cur.alive and (loc.dead_since or 0.0) > (cur.dead_since or 0.0)):
                out[int(r["rank"])] = loc
    return out


def rank_deaths(session: Session, job_id: str) -> list[tuple[int, RankLocation]]:
    """Every dead process of ``job_id``'s ranks the heartbeats report, (rank, where), a rank running again
    elsewhere or in a newer process included (a live replacement): one rank's death is not hidden by its
    successor, as it is in :func:`rank_locations`. Nodes marked DEAD are left out."""
    return [(int(r["rank"]), RankLocation(node.id, int(r.get("pid", 0)), False, r.get("dead_since")))
            for node in session.scalars(select(Node).where(Node.state != NodeState.DEAD.value)).all()
            for r in node.ranks or [] if r.get("job_id") == job_id and not r.get("alive", True)]
