"""Wire-schema values for the unit tests of the dashboard's pure functions (tables, figures), and the
per-rank step series the live tests feed the real controller with.

Plain :mod:`vigil.contract.schemas` objects built in memory: no server. (What the dashboard shows of a
real controller is tested against the real one: see ``conftest.py``.)
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from vigil.contract.schemas import (
    EventPublic,
    JobCreate,
    JobPublic,
    JobStatus,
    NodePublic,
    NodeState,
    RankProcess,
    RankSeries,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def make_job(
    job_id: str,
    name: str = "demo",
    status: JobStatus = JobStatus.RUNNING,
    *,
    steps: int = 100,
    workers: tuple[int, int] = (2, 4),
    optimizer: str = "dsm",
    last_step: int | None = None,
    last_loss: float | None = None,
    minutes_ago: int = 5,
) -> JobPublic:
    spec = JobCreate.model_validate(
        {
            "name": name,
            "steps": steps,
            "optimizer": {"kind": optimizer},
            "scaling": {"min_workers": workers[0], "max_workers": workers[1]},
        }
    )
    return JobPublic(
        id=job_id,
        name=name,
        status=status,
        spec=spec,
        created_at=T0 - timedelta(minutes=minutes_ago),
        started_at=T0 if status != JobStatus.PENDING else None,
        last_step=last_step,
        last_loss=last_loss,
    )


def rank_series(rank: int, n_steps: int, *, slow: bool = False, nan_at: int | None = None) -> RankSeries:
    """``n_steps`` deterministic steps of one rank; ``slow`` makes it a straggler (0.5 s vs 0.1 s)."""
    base = 0.5 if slow else 0.1
    steps = list(range(n_steps))
    return RankSeries(
        rank=rank,
        step=steps,
        ts=[1.7e9 + s for s in steps],
        loss=[None if s == nan_at else 5.0 / (1 + 0.1 * s) + 0.01 * rank for s in steps],
        step_time_s=[base + 0.001 * (s % 7) for s in steps],
        tokens_per_s=[512 / (base + 0.001 * (s % 7)) for s in steps],
    )


def make_node(
    node_id: str, state: NodeState = NodeState.ALIVE, ranks: list[tuple[str, int]] | None = None
) -> NodePublic:
    return NodePublic(
        id=node_id,
        hostname=f"host-{node_id}",
        address="198.18.0.2",
        state=state,
        agent_id=f"agent-{node_id}",
        last_heartbeat=T0,
        heartbeat_age_s=1.25,
        ranks=[RankProcess(job_id=j, rank=r, pid=1000 + r) for j, r in (ranks or [])],
        host={"cpu_percent": 12.5, "mem": {"used_gb": 3.25}},
    )


def make_event(
    event_id: int, kind: str, message: str, job_id: str | None = None, node_id: str | None = None
) -> EventPublic:
    return EventPublic(
        id=event_id,
        ts=T0 + timedelta(seconds=event_id),
        kind=kind,
        job_id=job_id,
        node_id=node_id,
        message=message,
    )
