"""Checkpoints jobs report (rank 0, through the telemetry path), and reads of them."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.jobs import record_event
from controller.models import Checkpoint
from vigil.contract.schemas import CheckpointPublic, CheckpointSample


def record_checkpoints(session: Session, samples: list[CheckpointSample]) -> None:
    """Upsert by (job, path): a checkpoint later found corrupt is re-reported with ``valid=False``."""
    for s in samples:
        row = session.scalar(select(Checkpoint).where(Checkpoint.job_id == s.job_id, Checkpoint.path == s.path))
        if row is None:
            # created_at: when the rank finished writing it (the sample's time), not when it was heard of.
            row = Checkpoint(job_id=s.job_id, path=s.path, created_at=datetime.fromtimestamp(s.ts, UTC))
            session.add(row)
        if not s.valid:
            # The row is upserted (a replay writes the same folder again, valid): the event keeps it on record.
            record_event(session, "checkpoint_invalid", f"checkpoint at step {s.step} found invalid: {s.message}",
                         job_id=s.job_id, data={"step": s.step, "path": s.path, "reason": s.message})
        row.step = s.step
        row.valid = s.valid
        row.world_size = s.world_size
        row.files = s.files
        row.bytes = s.bytes
        row.manifest_sha256 = s.manifest_sha256
        row.loss = s.loss
    session.flush()


def list_checkpoints(session: Session, job_id: str) -> list[CheckpointPublic]:
    rows = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)).all()
    return [CheckpointPublic.model_validate(r, from_attributes=True) for r in rows]


def newest_valid(session: Session, job_id: str) -> Checkpoint | None:
    return session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.valid.is_(True))
        .order_by(Checkpoint.step.desc()).limit(1)
    )
