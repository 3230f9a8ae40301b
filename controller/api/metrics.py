"""Telemetry series of a job (step breakdown per rank, collectives per kind and per call) and /metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, status
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from controller import jobs as job_service
from controller.api.deps import SessionDep
from controller.prometheus import render
from controller.series import StepRange, job_collectives, job_steps
from vigil.contract.schemas import ID_PATTERN, INT32_MAX, TS_MAX, JobCollectivesPublic, JobStepsPublic

router = APIRouter(prefix="/jobs", tags=["telemetry"])
root_router = APIRouter(tags=["metrics"])

JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job's id (job_...).")]
SinceStep = Annotated[int | None, Query(ge=0, le=INT32_MAX, description="First step (inclusive).")]
UntilStep = Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Last step (inclusive).")]
SinceTs = Annotated[float | None, Query(ge=0, le=TS_MAX, description="Earliest unix time of a step's end.")]
UntilTs = Annotated[float | None, Query(ge=0, le=TS_MAX, description="Latest unix time of a step's end.")]
Ranks = Annotated[list[int] | None, Query(max_length=4096, description="Only these ranks (repeat: ranks=0&ranks=3).")]
MaxPoints = Annotated[int, Query(ge=10, le=100_000, description="Most points per series (spikes are kept).")]


def _range(since_step: int | None, until_step: int | None, since_ts: float | None, until_ts: float | None,
           ranks: list[int] | None) -> StepRange:
    if ranks and min(ranks) < 0:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail="ranks: every rank must be >= 0")
    return StepRange(since_step, until_step, since_ts, until_ts, ranks)


def _require_job(session: SessionDep, job_id: str) -> None:
    try:
        job_service.get_job(session, job_id)
    except job_service.JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} not found") from None


@router.get("/{job_id}/steps", response_model=JobStepsPublic)
def get_steps(
    job_id: JobId,
    session: SessionDep,
    since_step: SinceStep = None,
    until_step: UntilStep = None,
    since_ts: SinceTs = None,
    until_ts: UntilTs = None,
    ranks: Ranks = None,
    max_points: MaxPoints = 2000,
    max_ranks: Annotated[int, Query(ge=1, le=10_000, description="Most ranks returned (lowest first).")] = 1024,
) -> JobStepsPublic:
    """Per-rank step breakdown (data, fwd+bwd, optimizer, communication, wait inside collectives, bytes)."""
    _require_job(session, job_id)
    return job_steps(session, job_id, _range(since_step, until_step, since_ts, until_ts, ranks), max_points, max_ranks)


@router.get("/{job_id}/collectives", response_model=JobCollectivesPublic)
def get_collectives(
    job_id: JobId,
    session: SessionDep,
    since_step: SinceStep = None,
    until_step: UntilStep = None,
    since_ts: SinceTs = None,
    until_ts: UntilTs = None,
    ranks: Ranks = None,
    ops: Annotated[list[str] | None, Query(max_length=64, description="Only these ops (all_reduce, ...).")] = None,
    max_points: MaxPoints = 2000,
    raw: Annotated[bool, Query(description="Also return each rank's calls (raw window only).")] = False,
    raw_limit: Annotated[int, Query(ge=1, le=200_000, description="Most raw calls returned.")] = 10_000,
) -> JobCollectivesPublic:
    """Per-step aggregates per kind of collective (p50 / max / slowest rank / wait / bytes), and raw calls on request."""
    _require_job(session, job_id)
    rng = _range(since_step, until_step, since_ts, until_ts, ranks)
    return job_collectives(session, job_id, rng, ops=ops, max_points=max_points, raw=raw, raw_limit=raw_limit)


@root_router.get("/metrics", include_in_schema=False)
def prometheus_metrics(request: Request) -> Response:
    """Prometheus text format (access: ``ROUTE_POLICY``'s METRICS rule, i.e. a reader's token unless
    ``VIGIL_METRICS_OPEN``)."""
    return Response(render(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
