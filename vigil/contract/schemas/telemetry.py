"""Telemetry: the samples a rank sends (steps, collectives, checkpoints), the agent's batches and
heartbeats, and the step and collective series the API reads back."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    field_validator,
)

from vigil.contract.schemas.common import (
    HOST_MAX_DEPTH,
    HOST_MAX_ITEMS,
    INT32_MAX,
    INT64_MAX,
    MAX_TELEMETRY_ITEMS,
    NAME_MAX,
    TS_MAX,
    Line,
    Text,
    _storable_json,
    _Strict,
)

# --------------------------------------------------------------------------------------------------
# Telemetry (rank -> agent -> controller)
# --------------------------------------------------------------------------------------------------

Finite = Annotated[float, Field(allow_inf_nan=False)]


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


Observed = Annotated[float | None, BeforeValidator(_finite_or_none)]
"""A value the training observed (a loss, a learning rate): a number that is not finite is a finding the
detectors read as "not finite" (None), not bad input; the JSON path and the columnar one store it alike."""
UnixTime = Annotated[float, Field(ge=0.0, le=TS_MAX, allow_inf_nan=False)]
"""Seconds since the epoch, within what a datetime (and the database) can hold."""
JobRef = Annotated[Line, Field(min_length=1, max_length=64)]

CAPTURED_TAG = "torch"
"""The ``tag`` of a collective that torch.distributed ran on its own (DDP, FSDP, DTensor, the user's calls),
read from its Flight Recorder (:mod:`vigil.capture`): its bytes are estimated from the op and sizes, not
counted by Vigil's communication layer."""
LIVE_OPS = frozenset({"heal", "quorum"})
"""Ops of live recovery's own records (a heal from a peer; a quorum formed again after a failed collective):
events and timeline phases, not collectives of the job's training."""


def bytes_estimated(tag: str) -> bool:
    """Whether a collective's bytes are an estimate (captured from torch) rather than counted by Vigil."""
    return tag == CAPTURED_TAG


class StepSample(_Strict):
    """One optimizer step of one rank, as the rank reports it."""

    kind: Literal["step"] = "step"
    job_id: JobRef
    rank: int = Field(..., ge=0, le=1_000_000)
    world_size: int = Field(1, ge=1, le=1_000_000)
    step: int = Field(..., ge=0, le=INT32_MAX)
    attempt: int = Field(0, ge=0, le=INT32_MAX, description=(
        "Run attempt of the rank's worker group: increases at every restart of the ranks (0: unknown). "
        "Re-run steps after a restore are new samples under a newer attempt; the newest attempt of a step wins."))
    ts: UnixTime = Field(..., description="Unix time the step ended.")
    loss: Observed = Field(..., description="Training loss; None when not finite (a finding, not bad input).")
    lr: Observed = None
    tokens: int = Field(0, ge=0, le=INT32_MAX, description="Tokens this rank processed in the step.")
    step_time_s: Finite = Field(..., ge=0.0)
    tokens_per_s: Finite = Field(0.0, ge=0.0)
    data_s: Finite | None = Field(None, ge=0.0, description="Time waiting for data.")
    fwd_bwd_s: Finite | None = Field(None, ge=0.0, description="Forward + backward.")
    optim_s: Finite | None = Field(None, ge=0.0, description="Optimizer step, excluding communication.")
    comm_s: Finite | None = Field(None, ge=0.0, description="Sum of the step's collectives.")
    comm_wait_s: Finite | None = Field(None, ge=0.0, description="Wait inside the collectives.")
    val_loss: Observed = None
    pid: int | None = Field(None, ge=0, le=INT32_MAX)
    dropped: int = Field(0, ge=0, le=INT32_MAX, description="Samples this rank dropped since its last delivered one.")
    cpu_wait_s: Finite | None = Field(None, ge=0.0, description=(
        "Time the rank's main thread was runnable but waited for a CPU during the step (the kernel's run-queue "
        "delay, /proc/self/schedstat): a host whose CPUs are taken by something else; None where unknown."))


class CollectiveSample(_Strict):
    """One collective call of one rank, as the communication layer recorded it."""

    kind: Literal["collective"] = "collective"
    job_id: JobRef
    rank: int = Field(..., ge=0, le=1_000_000)
    step: int = Field(..., ge=0, le=INT32_MAX)
    attempt: int = Field(0, ge=0, le=INT32_MAX, description=(
        "Run attempt of the rank's worker group: increases at every restart of the ranks (0: unknown). "
        "Re-run steps after a restore are new samples under a newer attempt; the newest attempt of a step wins."))
    seq: int = Field(..., ge=0, le=INT32_MAX, description="Order of the call within the step.")
    op: Line = Field(..., min_length=1, max_length=64)
    group: Line = Field("world", max_length=64)
    tag: Line = Field("", max_length=64, description="What was sent: grads, weights, push, pull, ...")
    payload_bytes: int = Field(..., ge=0, le=INT64_MAX)
    wire_bytes: int = Field(..., ge=0, le=INT64_MAX)
    elements: int = Field(0, ge=0, le=INT64_MAX, description="Model elements this call communicates (for bits/element).")
    duration_s: Finite = Field(..., ge=0.0)
    ts: UnixTime


class CheckpointSample(_Strict):
    """A checkpoint a job wrote, reported by its rank 0 once complete (or found bad on restore)."""

    kind: Literal["checkpoint"] = "checkpoint"
    job_id: str = Field(..., min_length=1, max_length=64)
    rank: int = Field(0, ge=0, le=1_000_000)
    step: int = Field(..., ge=0, le=INT32_MAX)
    ts: float = Field(..., ge=0.0, le=TS_MAX)
    path: Text = Field(..., min_length=1, max_length=1024, description="Checkpoint folder (on shared storage).")
    valid: bool = Field(True, description="Complete, manifest written and checksums verified.")
    world_size: int = Field(1, ge=1, le=1_000_000)
    files: int = Field(0, ge=0, le=1_000_000)
    bytes: int = Field(0, ge=0, le=INT64_MAX)
    manifest_sha256: str = Field("", max_length=64)
    loss: Observed = None
    message: Text = Field("", max_length=1024)


class FaultSample(_Strict):
    """An injected fault that the rank itself carried out (a fault file, vigil/faults.py), sent just
    before acting: the step it really hit, for the fault's record (``hit_step``)."""

    kind: Literal["fault"] = "fault"
    job_id: JobRef
    rank: int = Field(..., ge=0, le=1_000_000)
    step: int = Field(..., ge=0, le=INT32_MAX, description="The step the fault hit.")
    attempt: int = Field(0, ge=0, le=INT32_MAX)
    ts: UnixTime
    fault_id: int = Field(..., ge=0, le=INT64_MAX, description="The controller's fault id (from the fault file).")
    fault_kind: Line = Field(..., min_length=1, max_length=32)


class CollectiveRef(_Strict):
    """One collective of one rank, as its Flight Recorder names it."""

    group: Line = Field(..., min_length=1, max_length=64, description="Process group (world, or torch's name).")
    seq: int = Field(..., ge=0, le=INT64_MAX, description="The group's collective sequence number.")
    op: Line = Field(..., min_length=1, max_length=64)
    enqueued_ts: UnixTime | None = Field(None, description="When the rank entered it.")


class GroupProgress(_Strict):
    """How far one rank got in one process group: the last collective it entered and the last done."""

    group: Line = Field(..., min_length=1, max_length=64)
    last_enqueued: int = Field(..., ge=-1, le=INT64_MAX)
    last_completed: int = Field(..., ge=-1, le=INT64_MAX)


class ProgressSample(_Strict):
    """Where a rank stands in its collectives while its steps stall (sent by the rank's watcher thread
    about once a second while no step finished for a while): what a hang's diagnosis lines up across
    ranks to name the rank the others wait for (:mod:`vigil.rank.watch`)."""

    kind: Literal["progress"] = "progress"
    job_id: JobRef
    rank: int = Field(..., ge=0, le=1_000_000)
    attempt: int = Field(0, ge=0, le=INT32_MAX)
    ts: UnixTime
    step: int = Field(0, ge=0, le=INT32_MAX, description="The step the rank is in (the last one begun).")
    idle_s: Finite = Field(..., ge=0.0, description="Seconds since the rank's last step ended.")
    groups: list[GroupProgress] = Field(default_factory=list, max_length=64)
    in_flight: list[CollectiveRef] = Field(default_factory=list, max_length=16,
                                           description="Collectives entered and not done, oldest first.")
    last_done: CollectiveRef | None = Field(None, description="The newest collective done.")


RankSample = Annotated[StepSample | CollectiveSample | CheckpointSample | FaultSample | ProgressSample, Field(discriminator="kind")]


class RankProcess(_Strict):
    job_id: Line = Field(..., max_length=64)
    rank: int = Field(..., ge=0, le=1_000_000)
    pid: int = Field(..., ge=0, le=INT32_MAX)
    alive: bool = True
    dead_since: float | None = Field(None, ge=0.0, le=TS_MAX, description="Unix time the agent first saw it dead.")


class Heartbeat(_Strict):
    """The agent's periodic sign of life, with what it sees on its node."""

    ts: UnixTime
    hostname: Line = Field("", max_length=NAME_MAX)
    address: Line = Field("", max_length=NAME_MAX)
    ranks: list[RankProcess] = Field(default_factory=list, max_length=4096)
    host: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Host metrics (CPU, memory, ...) or unavailable: JSON of at most {HOST_MAX_ITEMS} values, "
        f"{HOST_MAX_DEPTH} levels deep; a number that is not finite is stored as null.",
    )
    dropped_samples: int = Field(0, ge=0, le=INT64_MAX, description="Samples lost on this node since the agent started.")

    @field_validator("host")
    @classmethod
    def _host_is_storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _storable_json(v)


class TelemetryBatch(_Strict):
    """What an agent posts to ``/api/v1/telemetry``. Idempotent on (agent_id, seq)."""

    agent_id: Line = Field(..., min_length=1, max_length=NAME_MAX)
    node_id: Line = Field(..., min_length=1, max_length=NAME_MAX)
    seq: int = Field(..., ge=0, le=INT64_MAX, description="Batch number, increasing per agent.")
    sent_at: Finite
    samples: list[RankSample] = Field(default_factory=list, max_length=MAX_TELEMETRY_ITEMS)
    heartbeat: Heartbeat | None = None


class TelemetryAck(BaseModel):
    accepted: bool
    duplicate: bool
    stored: int



class RankSeries(BaseModel):
    """Step metrics of one rank, as parallel arrays (cheap to plot)."""

    rank: int
    step: list[int]
    ts: list[float]
    loss: list[float | None]
    step_time_s: list[float]
    tokens_per_s: list[float]



class JobMetrics(BaseModel):
    job_id: str
    ranks: list[RankSeries]



# --------------------------------------------------------------------------------------------------
# Step and collective series (GET /jobs/{id}/steps, /jobs/{id}/collectives)
# --------------------------------------------------------------------------------------------------


class RankStepsPublic(BaseModel):
    """One rank's step breakdown as parallel arrays (one entry per step, oldest first).

    ``final`` is False for a step still forming (samples may still arrive); its values are computed
    from the raw samples received so far.
    """

    rank: int
    node_id: str = Field(..., description="Node of the rank's latest step.")
    step: list[int]
    ts: list[float]
    final: list[bool]
    loss: list[float | None]
    step_time_s: list[float | None]
    data_s: list[float | None]
    fwd_bwd_s: list[float | None]
    optim_s: list[float | None]
    comm_s: list[float | None]
    comm_wait_s: list[float | None] = Field(..., description="Wait inside collectives (duration minus the fastest rank's).")
    collectives: list[int]
    wire_bytes: list[int]


class JobStepsPublic(BaseModel):
    job_id: str
    data: list[RankStepsPublic]
    count: int = Field(..., description="Ranks that match the filter (``data`` may hold fewer: ``max_ranks``).")


class CollectiveSeriesPublic(BaseModel):
    """One kind of collective (op, group, tag) per step, over ranks, as parallel arrays.

    Durations are each rank's total time in this kind of collective within the step; p50 / max /
    min are over ranks. ``transfer_s``: sum over the calls of the fastest rank's duration.
    """

    op: str
    group: str
    tag: str
    estimated: bool = Field(False, description=(
        "Bytes estimated from the op and sizes (a collective torch ran on its own, captured from its Flight "
        "Recorder: tag 'torch'), not counted by Vigil's communication layer."))
    step: list[int]
    ts: list[float]
    final: list[bool]
    calls: list[int]
    ranks: list[int]
    p50_s: list[float]
    max_s: list[float]
    min_s: list[float]
    slowest_rank: list[int]
    transfer_s: list[float]
    wait_p50_s: list[float]
    wait_max_s: list[float]
    most_waiting_rank: list[int]
    payload_bytes: list[int]
    wire_bytes: list[int]
    elements: list[int]


class CollectiveCallPublic(BaseModel):
    """One collective call of one rank, as stored raw (only within the raw retention window)."""

    rank: int
    node_id: str
    step: int
    seq: int
    op: str
    group: str
    tag: str
    estimated: bool = Field(False, description="Bytes estimated (see CollectiveSeriesPublic.estimated).")
    duration_s: float
    wait_s: float = Field(..., description="duration_s minus the fastest rank's duration of the same call.")
    payload_bytes: int
    wire_bytes: int
    elements: int
    ts: float


class JobCollectivesPublic(BaseModel):
    job_id: str
    data: list[CollectiveSeriesPublic]
    count: int
    raw: list[CollectiveCallPublic] | None = Field(None, description="Per-rank calls, when asked for (``raw=true``).")
    raw_truncated: bool = Field(False, description="More raw calls matched than ``raw_limit``.")
