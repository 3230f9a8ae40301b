"""Derived read views: what the dashboard and the CLI show without fetching every rank's series.

A 1,024-rank job's raw series are megabytes; these views are computed by the controller from the
same tables (:mod:`controller.views`) and stay small whatever the number of ranks:

* :class:`JobOverviewPublic` (``GET /jobs/{id}/overview``): per step, the job-wide figures (mean
  loss, total throughput, step-time percentiles over ranks, the slowest rank), the top-k slowest
  ranks of the window, and the job's markers (restarts, evictions, incidents, checkpoints, faults)
  at their steps. ``since_step`` makes it incremental.
* :class:`StepHeatmapPublic` (``GET /jobs/{id}/heatmap``): step time rank x step, binned server side
  to at most ``max_ranks`` x ``max_steps`` cells (each cell the max of its bin: a straggler survives).
* :class:`GoodputPublic` (``GET /jobs/{id}/goodput``): productive time against time lost per cause,
  and the ETTR.
* :class:`NodeHistoryPublic` (``GET /nodes/{id}/history``): a node's host metrics over time (the
  controller keeps a bounded history per node).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

# --------------------------------------------------------------------------------------------------
# Job overview
# --------------------------------------------------------------------------------------------------

MARKER_KINDS = ("restart", "eviction", "incident", "checkpoint", "fault")
"""What :class:`JobMarker` may stand for."""


class JobMarker(BaseModel):
    """Something that happened to the job, placed on the step axis (drawn on the loss curve)."""

    kind: str = Field(..., description=f"One of {', '.join(MARKER_KINDS)}.")
    step: int | None = Field(..., description="The job's step when it happened (None: not known).")
    ts: float = Field(..., description="Unix time it happened.")
    label: str = Field(..., description="One line for a person: what happened.")
    ref: str | None = Field(None, description="What it refers to: incident id, checkpoint id, fault id, node id.")


class RankSummary(BaseModel):
    """One rank over the job's last ``rank_window`` steps (the slowest ranks are listed by this)."""

    rank: int
    node_id: str
    steps: int = Field(..., description="Steps this rank reported in the window.")
    step_time_mean_s: float
    step_time_max_s: float
    vs_median: float = Field(..., description="This rank's mean step time / the median rank's mean (1.0: typical).")
    comm_wait_mean_s: float | None = Field(None, description="Mean wait inside collectives per step (None: unknown).")


class JobOverviewPublic(BaseModel):
    """Per step, the job-wide figures (lists aligned on ``step``, ascending; the latest run attempt of a
    re-run step wins), then the window's slowest ranks and the job's markers."""

    job_id: str
    ranks: int = Field(..., description="Ranks that reported a step in the window.")
    step: list[int]
    ts: list[float] = Field(..., description="Latest end time of the step over ranks.")
    loss: list[float | None] = Field(..., description="Mean training loss over ranks (None: none finite).")
    val_loss: list[float | None] = Field(..., description="Mean validation loss over the ranks that reported one.")
    tokens_per_s: list[float] = Field(..., description="Sum over ranks.")
    step_time_p50_s: list[float]
    step_time_p90_s: list[float]
    step_time_max_s: list[float]
    slowest_rank: list[int] = Field(..., description="The rank with the max step time at that step.")
    reporting: list[int] = Field(..., description="Ranks that reported the step.")
    wire_bytes: list[int] = Field(..., description="Bytes the step's collectives put on the wire, summed over ranks.")
    final: list[bool] = Field(
        default_factory=list,
        description="False: the step is still forming (its figures come from the samples received so far); an "
        "incremental client asks again from the first such step rather than from last_step + 1.")
    slowest_ranks: list[RankSummary] = Field(
        ..., description="The ``top_k`` ranks with the highest mean step time over the job's last ``rank_window`` "
        "steps (whatever ``since_step``), slowest first.")
    markers: list[JobMarker] = Field(
        ..., description="Restarts, evictions, incidents, checkpoints, faults: all of the job's (whatever "
        "``since_step``: a marker may come late, e.g. a restart placed at a re-run step), oldest first.")
    last_step: int | None = Field(..., description="Newest step in the window (pass it + 1 as since_step next time, "
                                  "or the first step whose ``final`` is False if it is lower).")


# --------------------------------------------------------------------------------------------------
# Heatmap
# --------------------------------------------------------------------------------------------------


class StepHeatmapPublic(BaseModel):
    """Step time (seconds) rank x step, binned: row ``i`` covers ranks ``rank_lo[i]..rank_hi[i]``,
    column ``j`` steps ``step_lo[j]..step_hi[j]``; a cell is the max over its bin (None: no data)."""

    job_id: str
    rank_lo: list[int]
    rank_hi: list[int]
    step_lo: list[int]
    step_hi: list[int]
    z: list[list[float | None]] = Field(..., description="Rows (rank bins) x columns (step bins).")


# --------------------------------------------------------------------------------------------------
# Goodput
# --------------------------------------------------------------------------------------------------

LOST_CAUSES = ("startup", "restart", "lost_steps", "checkpoint", "hang", "slow_ranks", "other")
"""Where the wall time that was not productive went (:class:`GoodputPublic`)."""


class GoodputPublic(BaseModel):
    """Where a job's wall time went: ``productive_s + sum(lost_s.values()) == wall_s``.

    * ``productive_s``: time inside the steps whose result was kept (the last run attempt of each step).
    * ``lost_s["startup"]``: from the job's start to its first step's start.
    * ``lost_s["restart"]``: from a failure (or its detection) until the ranks ran a step again.
    * ``lost_s["lost_steps"]``: steps computed and then thrown away (re-run after a restore).
    * ``lost_s["checkpoint"]``: gaps between steps where a checkpoint was saved.
    * ``lost_s["hang"]``: from the last step before a hang until Vigil detected it.
    * ``lost_s["slow_ranks"]``: inside kept steps, the time the steps waited for ranks slower than the
      median rank (:class:`SecondsLostPublic`); taken out of the productive time.
    * ``lost_s["other"]``: any other gap between steps.
    """

    job_id: str
    wall_s: float = Field(..., description="From the job's start to its end (or now, while it runs).")
    productive_s: float
    lost_s: dict[str, float] = Field(..., description=f"Keys: {', '.join(LOST_CAUSES)}.")
    ettr: float | None = Field(..., description="productive_s / wall_s (None before the job started).")
    restarts: int
    steps_rerun: int = Field(..., description="Steps computed more than once (their earlier attempts are lost).")


# --------------------------------------------------------------------------------------------------
# Seconds lost to slow ranks
# --------------------------------------------------------------------------------------------------


class RankLost(BaseModel):
    """What one rank cost the job: its share of the steps' seconds lost (docs/RECOVERY.md)."""

    rank: int
    node_id: str = Field(..., description="The node of the rank's newest step.")
    seconds_lost: float
    share_of_wall: float | None = Field(..., description="seconds_lost / the job's wall time (None: not started).")
    steps_charged: int = Field(..., description="Steps in which this rank was slower than the median rank.")
    last_step_lost_s: float | None = Field(..., description="Its share of the newest counted step.")


class NodeLost(BaseModel):
    """What one node's ranks cost the job, summed over its ranks."""

    node_id: str
    seconds_lost: float
    share_of_wall: float | None
    ranks: list[int]


class SecondsLostPublic(BaseModel):
    """Seconds lost to slow ranks, live (``GET /jobs/{id}/stragglers``): per step, what the step would have
    saved had every rank run at the median rank's pace, each rank's and each node's share of it (cumulative,
    most first), and the shares of the wall time. Counts the aggregated steps (the newest few forming steps
    join within seconds); a re-run step counts its newest attempt only."""

    job_id: str
    wall_s: float = Field(..., description="From the job's start to its end (or now).")
    seconds_lost: float = Field(..., description="Sum over the counted steps.")
    share_of_wall: float | None
    steps: int = Field(..., description="Steps counted (their ranks' waits inside collectives known).")
    ranks: list[RankLost] = Field(..., description="Most seconds lost first.")
    nodes: list[NodeLost] = Field(..., description="Most seconds lost first.")
    step: list[int] = Field(..., description="The newest counted steps (at most max_points), ascending.")
    lost_s: list[float] = Field(..., description="Seconds lost in each step of ``step``.")


# --------------------------------------------------------------------------------------------------
# Node history
# --------------------------------------------------------------------------------------------------


class NodeHistoryPublic(BaseModel):
    """A node's host metrics over time, aligned on ``ts`` (None: not reported at that time).

    NIC rates are summed over the node's interfaces; errors and drops are per second, summed too.
    """

    node_id: str
    ts: list[float]
    cpu_percent: list[float | None]
    memory_percent: list[float | None]
    disk_percent: list[float | None] = Field(..., description="The fullest of the node's disks.")
    load_1m: list[float | None]
    rx_bytes_per_s: list[float | None]
    tx_bytes_per_s: list[float | None]
    nic_errors_per_s: list[float | None]
    nic_drops_per_s: list[float | None]
    gpu_util_percent: list[float | None] = Field(..., description="Mean over the node's GPUs (None: no GPU).")
    gpu_memory_percent: list[float | None]
