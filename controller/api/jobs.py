"""Job routes: submit, list, read, cancel, metrics, logs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status

from controller import jobs as service
from controller.api.deps import CurrentPrincipal, JobId, SessionDep, SettingsDep
from controller.launcher import LaunchError
from controller.packages import package_exists
from controller.series import job_metrics
from vigil.contract.schemas import (
    INT32_MAX,
    LOG_TAIL_DEFAULT,
    LOG_TAIL_MAX,
    JobCreate,
    JobMetrics,
    JobPublic,
    JobsPublic,
    JobStatus,
    LogsPublic,
)

router = APIRouter(prefix="/jobs", tags=["jobs"])


def _get(session: SessionDep, job_id: str):  # type: ignore[no-untyped-def]
    try:
        return service.get_job(session, job_id)
    except service.JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} not found") from None


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def submit_job(body: JobCreate, session: SessionDep, request: Request, settings: SettingsDep,
               principal: CurrentPrincipal) -> JobPublic:
    """Validate and store a job; the supervisor launches it on the cluster. A ``working_dir`` must name
    a package uploaded before (422 otherwise, nothing stored)."""
    if body.working_dir is not None and not package_exists(settings.resolved_packages_dir(), body.working_dir):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=[{
            "type": "package_missing", "loc": ["body", "working_dir"],
            "msg": f"no code package {body.working_dir} was uploaded (POST /api/v1/packages first, or use "
                   "vigil submit --working-dir)"}])
    job = service.create_job(session, body, created_by=principal.token_id)  # its owner (controller/auth.py)
    session.commit()
    request.app.state.supervisor.wake()
    return service.to_public(job)


@router.get("", response_model=JobsPublic)
def list_jobs(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JobsPublic:
    rows, count = service.list_jobs(session, limit, offset)
    return JobsPublic(data=[service.to_public(j) for j in rows], count=count)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, session: SessionDep) -> JobPublic:
    return service.to_public(_get(session, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: JobId, session: SessionDep, request: Request) -> JobPublic:
    """Stop a PENDING or RUNNING job; 409 when it has already ended."""
    job = _get(session, job_id)
    if JobStatus(job.status).is_terminal():
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job {job_id!r} already ended as {job.status}")
    launcher = request.app.state.launcher
    if launcher is not None and job.ray_job_id is not None:
        try:
            launcher.stop(job.ray_job_id)
        except LaunchError as exc:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, detail=str(exc)) from exc
    service.transition(session, job, JobStatus.CANCELLED, "cancelled by user")
    return service.to_public(job)


@router.get("/{job_id}/metrics", response_model=JobMetrics)
def get_metrics(
    job_id: str,
    session: SessionDep,
    since_step: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    max_points: Annotated[int, Query(ge=10, le=100_000)] = 2000,
) -> JobMetrics:
    """Step metrics per rank (loss, step time, tokens/s), downsampled to ``max_points`` per rank."""
    _get(session, job_id)
    return job_metrics(session, job_id, since_step, max_points)


@router.get("/{job_id}/logs", response_model=LogsPublic)
def get_logs(
    job_id: JobId, session: SessionDep, request: Request,
    tail_bytes: Annotated[int, Query(ge=1, le=LOG_TAIL_MAX)] = LOG_TAIL_DEFAULT,
) -> LogsPublic:
    """The end of the driver's log from Ray, at most ``tail_bytes`` (from a line start; the ranks' output is
    in Ray's worker logs). A job's log is its own output, of any size: the whole of it is never sent."""
    job = _get(session, job_id)
    launcher = request.app.state.launcher
    if launcher is None or job.ray_job_id is None:
        return LogsPublic(job_id=job_id, logs="")
    try:
        text = launcher.logs(job.ray_job_id)
    except LaunchError as exc:
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, detail=str(exc)) from exc
    data = text.encode("utf-8", "replace")
    if len(data) <= tail_bytes:
        return LogsPublic(job_id=job_id, logs=text, total_bytes=len(data))
    tail = data[-tail_bytes:]
    newline = tail.find(b"\n")
    if 0 <= newline < len(tail) - 1:
        tail = tail[newline + 1:]
    return LogsPublic(job_id=job_id, logs=tail.decode("utf-8", "ignore"), total_bytes=len(data), truncated=True)
