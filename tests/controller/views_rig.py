"""Helpers of the controller's view tests (test_views*.py): a running job, steps posted as an agent posts
them, one aggregator flush, the viewer client, and the live controller on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import update

from controller.db import session_scope
from controller.models import Job
from tests.live_controller import LiveController, step_sample
from vigil.contract.schemas import (
    Heartbeat,
    JobStatus,
    Role,
)

API = "/api/v1"


# --------------------------------------------------------------------------------------------------
# Helpers (the fixture any_lc: tests/controller/conftest.py)
# --------------------------------------------------------------------------------------------------


def running_job(lc: LiveController, steps: int = 1000) -> str:
    job = lc.submit_job("views", steps=steps).id
    lc.set_job_status(job, JobStatus.RUNNING)
    return job


def post_steps(lc: LiveController, job: str, rows: Iterable[tuple[int, int, float, float]], node: str = "n1",
               **fields: Any) -> None:
    """Step samples (rank, step, end ts, step time) from ``node``'s agent, in batches."""
    samples = [step_sample(job, rank, step, ts=ts, step_time_s=st, **fields) for rank, step, ts, st in rows]
    for i in range(0, len(samples), 5000):
        lc.post_batch(node, samples[i:i + 5000])


def flush(lc: LiveController) -> None:
    lc.settle()
    lc.app.state.telemetry.flush()


def viewer(lc: LiveController) -> Any:
    return lc.client(Role.VIEWER)


def set_job_times(lc: LiveController, job: str, started: float | None, finished: float | None = None) -> None:
    """A job's start and end (no API sets them: the supervisor does, at the time it sees Ray's status)."""
    def dt(t: float | None) -> datetime | None:
        return datetime.fromtimestamp(t, UTC) if t is not None else None
    with session_scope(lc.app.state.sessions) as s:
        s.execute(update(Job).where(Job.id == job).values(started_at=dt(started), finished_at=dt(finished)))


def nearest_rank(values: list[float], q: int) -> float:
    """The q-th percentile by the nearest-rank definition: the ceil(q/100 n)-th smallest value."""
    ordered = sorted(values)
    k = -(-q * len(ordered) // 100)
    return ordered[k - 1]




def heartbeat(lc: LiveController, node: str, ts: float, host: dict[str, Any]) -> None:
    lc.post_batch(node, heartbeat=Heartbeat(ts=ts, hostname=node, host=host))
