"""The job life cycle: one transition function that refuses illegal moves (pure; SQLite in memory)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from controller.jobs import IllegalTransition, create_job, transition
from controller.models import Base, Event
from vigil.contract.schemas import JobCreate, JobStatus

LEGAL = {
    (JobStatus.PENDING, JobStatus.RUNNING), (JobStatus.PENDING, JobStatus.FAILED),
    (JobStatus.PENDING, JobStatus.CANCELLED), (JobStatus.RUNNING, JobStatus.SUCCEEDED),
    (JobStatus.RUNNING, JobStatus.FAILED), (JobStatus.RUNNING, JobStatus.CANCELLED),
}


@pytest.mark.parametrize("old", list(JobStatus))
@pytest.mark.parametrize("new", list(JobStatus))
def test_transition_table(old: JobStatus, new: JobStatus) -> None:
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    with Session(engine) as s:
        job = create_job(s, JobCreate(name="t"))
        job.status = old.value
        if old == new:
            assert transition(s, job, new) is False
        elif (old, new) in LEGAL:
            assert transition(s, job, new) is True
            assert job.status == new.value
            assert (job.finished_at is not None) == new.is_terminal()
            assert s.query(Event).filter(Event.kind == "job_status").count() == 1
        else:
            with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
                transition(s, job, new)
            assert job.status == old.value


def test_terminal_states() -> None:
    assert {s for s in JobStatus if s.is_terminal()} == {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
