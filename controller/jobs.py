"""Jobs: creation, reads, and the one function that changes a job's status."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.models import Event, Job
from controller.tokens import revoke_job_tokens
from vigil.contract.schemas import STORED, JobCreate, JobPublic, JobStatus

log = logging.getLogger(__name__)


class IllegalTransition(ValueError):
    """A status change that the job life cycle does not allow (e.g. SUCCEEDED -> RUNNING)."""


class JobNotFound(LookupError):
    pass


def new_job_id() -> str:
    return "job_" + uuid.uuid4().hex[:12]


def record_event(
    session: Session, kind: str, message: str, *, job_id: str | None = None, node_id: str | None = None,
    data: dict | None = None,
) -> Event:
    ev = Event(kind=kind, message=message, job_id=job_id, node_id=node_id, data=data or {})
    session.add(ev)
    return ev


def transition(session: Session, job: Job, new: JobStatus, message: str | None = None) -> bool:
    """Move ``job`` to ``new``; the only place a job's status changes.

    Returns False (and changes nothing) when the job is already in ``new``; raises
    :class:`IllegalTransition` for a move the life cycle forbids. Records an event; a move to a
    terminal status revokes the job's tokens.
    """
    old = JobStatus(job.status)
    if old == new:
        return False
    if not old.can_move_to(new):
        raise IllegalTransition(f"job {job.id}: illegal status change {old.value} -> {new.value}")
    now = datetime.now(UTC)
    job.status = new.value
    if new == JobStatus.RUNNING and job.started_at is None:
        job.started_at = now
    if new.is_terminal():
        job.finished_at = now
        revoke_job_tokens(session, job.id)  # the driver's token ends with its job, however it ends
    if message is not None:
        job.message = message[:4096]
    record_event(session, "job_status", f"{old.value} -> {new.value}" + (f": {message}" if message else ""),
                 job_id=job.id, data={"from": old.value, "to": new.value})
    log.info("job %s: %s -> %s", job.id, old.value, new.value)
    return True


def create_job(session: Session, spec: JobCreate, created_by: str | None = None) -> Job:
    job = Job(id=new_job_id(), name=spec.name, status=JobStatus.PENDING.value, spec=spec.model_dump(mode="json"),
              created_by=created_by)
    session.add(job)
    record_event(session, "job_submitted", f"job {spec.name!r} submitted", job_id=job.id)
    session.flush()
    return job


def get_job(session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job


def list_jobs(session: Session, limit: int, offset: int) -> tuple[list[Job], int]:
    count = session.scalar(select(func.count()).select_from(Job)) or 0
    rows = session.scalars(select(Job).order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)).all()
    return list(rows), count


def active_jobs(session: Session) -> list[Job]:
    unfinished = [s.value for s in JobStatus if not s.is_terminal()]  # not "live": that is recovery.policy live
    return list(session.scalars(select(Job).where(Job.status.in_(unfinished))).all())


def to_public(job: Job) -> JobPublic:
    return JobPublic(
        id=job.id, name=job.name, status=JobStatus(job.status),
        spec=JobCreate.model_validate(job.spec, context={STORED: True}),
        ray_job_id=job.ray_job_id, message=job.message, created_at=job.created_at, started_at=job.started_at,
        finished_at=job.finished_at, last_step=job.last_step, last_loss=job.last_loss, created_by=job.created_by,
    )
