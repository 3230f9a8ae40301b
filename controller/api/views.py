"""Derived read views (controller/views.py): a job's overview, its binned step-time heatmap, its goodput,
and a node's host history."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from controller import goodput, seconds_lost, views
from controller import jobs as job_service
from controller.api.deps import JobId, NodeId, SessionDep
from controller.models import Job, Node
from vigil.contract.schemas import (
    INT32_MAX,
    TS_MAX,
    GoodputPublic,
    JobOverviewPublic,
    NodeHistoryPublic,
    SecondsLostPublic,
    StepHeatmapPublic,
)

router = APIRouter(tags=["views"])

SinceStep = Annotated[int | None, Query(ge=0, le=INT32_MAX, description="First step (inclusive).")]
MaxPoints = Annotated[int, Query(ge=10, le=100_000, description="Most points returned (spikes are kept).")]


def _job(session: SessionDep, job_id: str) -> Job:
    try:
        return job_service.get_job(session, job_id)
    except job_service.JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} not found") from None


@router.get("/jobs/{job_id}/overview", response_model=JobOverviewPublic)
def get_overview(
    job_id: JobId,
    session: SessionDep,
    since_step: SinceStep = None,
    top_k: Annotated[int, Query(ge=1, le=100, description="How many of the slowest ranks to list.")] = 10,
    rank_window: Annotated[int, Query(ge=1, le=10_000, description="The slowest ranks are judged over the job's "
                                      "last this many steps.")] = 50,
    max_points: MaxPoints = 2000,
) -> JobOverviewPublic:
    """Job-wide figures per step (mean loss, total throughput, step-time p50/p90/max, slowest rank), the
    slowest ranks of the last ``rank_window`` steps, and the job's markers."""
    return views.job_overview(session, _job(session, job_id), since_step=since_step, top_k=top_k,
                              rank_window=rank_window, max_points=max_points)


@router.get("/jobs/{job_id}/heatmap", response_model=StepHeatmapPublic)
def get_heatmap(
    job_id: JobId,
    session: SessionDep,
    since_step: SinceStep = None,
    max_ranks: Annotated[int, Query(ge=1, le=1024, description="Most rows (rank bins).")] = 128,
    max_steps: Annotated[int, Query(ge=1, le=2000, description="Most columns (step bins).")] = 200,
) -> StepHeatmapPublic:
    """Step time rank x step, each cell the max of its bin of ranks and steps."""
    _job(session, job_id)
    return views.job_heatmap(session, job_id, since_step=since_step, max_ranks=max_ranks, max_steps=max_steps)


@router.get("/jobs/{job_id}/goodput", response_model=GoodputPublic)
def get_goodput(job_id: JobId, session: SessionDep) -> GoodputPublic:
    """Productive time against time lost per cause (startup, restart, lost steps, checkpoint, hang,
    other), and the ETTR."""
    return goodput.job_goodput(session, _job(session, job_id), time.time())


@router.get("/jobs/{job_id}/stragglers", response_model=SecondsLostPublic)
def get_seconds_lost(job_id: JobId, session: SessionDep, max_points: MaxPoints = 2000) -> SecondsLostPublic:
    """Seconds lost to slow ranks: per step, what the step would have saved had every rank run at the median
    rank's pace; each rank's and node's share, cumulative and as a share of the wall time (docs/RECOVERY.md,
    "Seconds lost to slow ranks")."""
    return seconds_lost.job_seconds_lost(session, _job(session, job_id), max_points=max_points)


@router.get("/nodes/{node_id}/history", response_model=NodeHistoryPublic)
def get_node_history(
    node_id: NodeId,
    session: SessionDep,
    since_ts: Annotated[float | None, Query(ge=0, le=TS_MAX, description="Earliest unix time.")] = None,
    max_points: MaxPoints = 2000,
) -> NodeHistoryPublic:
    """The node's host metrics over time (CPU, memory, disk, load, NIC rates, GPU use)."""
    if session.get(Node, node_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"node {node_id!r} not found")
    return views.node_history(session, node_id, since_ts=since_ts, max_points=max_points)
