"""A real ``vigil controller`` process and ranks' telemetry streamed through an agent, counted in the
database, for the tests that crash a controller or an agent mid-stream (tests/agent and the
aggregation-process test of tests/controller).

* :class:`~tests.harness.ControllerProcess` (the tests' one controller process): ``vigil controller`` as a child
  process on a database URL, on a port of its own that ``start()`` reuses after ``kill()`` or ``stop()``;
* :func:`submit_job`: a job submitted through its REST API with an admin token;
* :func:`send_steps`: ranks 0..RANKS-1 report steps through an agent's unix socket as real datagrams,
  CALLS collectives per rank and step;
* :func:`counts` / :func:`expect`: the rows stored for a job, read straight from the database, and the
  counts that mean "every sample exactly once".

Needs: the controller's dependencies, loopback, a writable run folder (short: unix socket paths), and
the database the controller runs on (PostgreSQL on 127.0.0.1:5432 for the postgresql cases). The
``setup`` fixture of tests/agent/conftest.py builds one with its tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from sqlalchemy import func, select

from controller.db import make_engine
from controller.models import CollectiveMetric, StepMetric
from tests.agent.doubles import collective_dict, datagram, send_datagrams, step_dict
from tests.harness import ControllerProcess

RANKS = 2
CALLS = 2  # collectives per rank and step


def submit_job(ctl: ControllerProcess, tokens: dict[str, str]) -> str:
    r = httpx.post(f"{ctl.url}/api/v1/jobs", json={"name": "crash", "steps": 10_000},
                   headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def send_steps(sock: Path, job: str, start: int, stop: int) -> None:
    """Ranks 0..RANKS-1 report steps [start, stop): a StepSample and CALLS collectives each, in step order."""
    items = []
    for st in range(start, stop):
        for r in range(RANKS):
            items.append(step_dict(st, job_id=job, rank=r, pid=os.getpid()))
            items += [collective_dict(st, q, job_id=job, rank=r) for q in range(CALLS)]
    send_datagrams(str(sock), [datagram(items[i:i + 30]) for i in range(0, len(items), 30)])


def counts(db_url: str, job: str) -> tuple[int, int, int, int]:
    """(step rows, distinct (rank, step), collective rows, distinct (rank, step, seq)) of ``job``."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as c:
            s_rows = c.scalar(select(func.count()).select_from(StepMetric).where(StepMetric.job_id == job))
            s_keys = c.scalar(select(func.count()).select_from(
                select(StepMetric.rank, StepMetric.step).where(StepMetric.job_id == job).distinct().subquery()))
            c_rows = c.scalar(select(func.count()).select_from(CollectiveMetric).where(CollectiveMetric.job_id == job))
            c_keys = c.scalar(select(func.count()).select_from(
                select(CollectiveMetric.rank, CollectiveMetric.step, CollectiveMetric.seq)
                .where(CollectiveMetric.job_id == job).distinct().subquery()))
            return int(s_rows), int(s_keys), int(c_rows), int(c_keys)
    finally:
        engine.dispose()


def expect(steps: int) -> tuple[int, int, int, int]:
    return steps * RANKS, steps * RANKS, steps * RANKS * CALLS, steps * RANKS * CALLS
