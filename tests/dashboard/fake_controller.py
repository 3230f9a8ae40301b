"""TEST DOUBLE of the controller's read API, for the dashboard tests.

This is NOT the controller: it is a small FastAPI app serving, from an in-memory
:class:`FakeControllerState`, exactly the endpoints the dashboard reads through
:class:`controller.client.VigilClient` (``/api/v1/jobs``, ``/api/v1/jobs/{id}``,
``/api/v1/jobs/{id}/metrics``, ``/api/v1/nodes``, ``/api/v1/events``), with the wire schemas of
:mod:`controller.schemas` and the same 404 for an unknown job. It exists so the dashboard can be
tested end to end (HTTP, mounting, browser) while the real ``controller.app.create_app()`` is being
written; the browser fixtures take any ASGI app, so the same tests can later run against the real
controller. It also records the ``Authorization`` headers it saw, to check the dashboard's token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from fastapi import FastAPI, HTTPException, Request

from controller.schemas import (
    EventPublic,
    EventsPublic,
    JobCreate,
    JobMetrics,
    JobPublic,
    JobsPublic,
    JobStatus,
    NodePublic,
    NodesPublic,
    NodeState,
    RankProcess,
    RankSeries,
)

API = "/api/v1"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@dataclass
class FakeControllerState:
    """What the double serves; tests mutate it (under ``lock``) to simulate a running job."""

    jobs: dict[str, JobPublic] = field(default_factory=dict)
    metrics: dict[str, JobMetrics] = field(default_factory=dict)
    nodes: list[NodePublic] = field(default_factory=list)
    events: list[EventPublic] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_job(self, job: JobPublic, metrics: JobMetrics | None = None) -> None:
        with self.lock:
            self.jobs[job.id] = job
            self.metrics[job.id] = metrics or JobMetrics(job_id=job.id, ranks=[])

    def extend_metrics(self, job_id: str, extra_steps: int) -> None:
        """Every rank of ``job_id`` reports ``extra_steps`` more steps (a live job)."""
        with self.lock:
            old = self.metrics[job_id]
            self.metrics[job_id] = JobMetrics(
                job_id=job_id,
                ranks=[
                    # rank_series is deterministic, so regenerating it longer extends it; a
                    # straggler (first step >= 0.5 s) stays one.
                    rank_series(
                        rs.rank,
                        len(rs.step) + extra_steps,
                        slow=bool(rs.step_time_s) and rs.step_time_s[0] >= 0.5,
                    )
                    for rs in old.ranks
                ],
            )


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


def make_metrics(
    job_id: str, points_per_rank: list[int], slow_ranks: frozenset[int] = frozenset()
) -> JobMetrics:
    return JobMetrics(
        job_id=job_id,
        ranks=[rank_series(r, n, slow=r in slow_ranks) for r, n in enumerate(points_per_rank)],
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


def create_fake_controller(state: FakeControllerState) -> FastAPI:
    """The double's FastAPI app (read endpoints only)."""
    app = FastAPI(title="vigil controller TEST DOUBLE")

    @app.middleware("http")
    async def record_auth(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path.startswith(API):
            state.auth_headers.append(request.headers.get("authorization"))
        return await call_next(request)

    @app.get(f"{API}/jobs")
    def list_jobs(limit: int = 100, offset: int = 0) -> dict:
        with state.lock:
            jobs = sorted(state.jobs.values(), key=lambda j: j.created_at, reverse=True)
        return JobsPublic(data=jobs[offset : offset + limit], count=len(jobs)).model_dump(mode="json")

    @app.get(f"{API}/jobs/{{job_id}}")
    def get_job(job_id: str) -> dict:
        with state.lock:
            job = state.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, "job not found")
        return job.model_dump(mode="json")

    @app.get(f"{API}/jobs/{{job_id}}/metrics")
    def job_metrics(job_id: str, since_step: int | None = None) -> dict:
        with state.lock:
            metrics = state.metrics.get(job_id)
        if metrics is None:
            raise HTTPException(404, "job not found")
        if since_step is not None:
            metrics = JobMetrics(
                job_id=job_id,
                ranks=[
                    RankSeries(
                        rank=rs.rank,
                        **{
                            f: [v for s, v in zip(rs.step, getattr(rs, f), strict=True) if s > since_step]
                            for f in ("step", "ts", "loss", "step_time_s", "tokens_per_s")
                        },
                    )
                    for rs in metrics.ranks
                ],
            )
        return metrics.model_dump(mode="json")

    @app.get(f"{API}/nodes")
    def list_nodes() -> dict:
        with state.lock:
            nodes = list(state.nodes)
        return NodesPublic(data=nodes, count=len(nodes)).model_dump(mode="json")

    @app.get(f"{API}/events")
    def list_events(job_id: str | None = None, limit: int = 100) -> dict:
        with state.lock:
            events = [e for e in state.events if job_id is None or e.job_id == job_id]
        events.sort(key=lambda e: e.ts, reverse=True)
        return EventsPublic(data=events[:limit], count=len(events)).model_dump(mode="json")

    return app


def demo_state() -> FakeControllerState:
    """Two jobs (one with 3 ranks of unequal length, one with no data yet), two nodes, three events."""
    state = FakeControllerState()
    state.add_job(
        make_job("job-abc", "pydoc-dsm", JobStatus.RUNNING, steps=100, last_step=19, last_loss=1.6778),
        make_metrics("job-abc", [20, 20, 17], slow_ranks=frozenset({2})),
    )
    state.add_job(
        make_job("job-new", "fresh", JobStatus.PENDING, workers=(2, 2), optimizer="adamw", minutes_ago=1)
    )
    state.nodes = [
        make_node("node-1", ranks=[("job-abc", 0), ("job-abc", 1)]),
        make_node("node-2", NodeState.DEAD, ranks=[("job-abc", 2)]),
    ]
    state.events = [
        make_event(1, "job.status", "job-abc is RUNNING", job_id="job-abc"),
        make_event(2, "incident.straggler", "rank 2 is slow", job_id="job-abc", node_id="node-2"),
        make_event(3, "node.dead", "node-2 missed heartbeats", node_id="node-2"),
    ]
    return state
