"""Detection, recovery and fault injection (docs/RECOVERY.md): faults, agent commands, incidents,
checkpoints, stacks, manual recovery."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from vigil.contract.schemas.common import (
    HOST_MAX_DEPTH,
    HOST_MAX_ITEMS,
    INT32_MAX,
    NAME_MAX,
    TEXT_MAX,
    Line,
    Text,
    _storable_json,
    _Strict,
)
from vigil.contract.schemas.fault_params import check_params
from vigil.contract.schemas.jobs import Params
from vigil.contract.schemas.nodes import NodeState

# --------------------------------------------------------------------------------------------------
# Detection, recovery and fault injection (see docs/RECOVERY.md)
# --------------------------------------------------------------------------------------------------


class FaultKind(str, enum.Enum):
    """Faults the fault-injection API can cause. Each is carried out for real (see docs/RECOVERY.md)."""

    KILL_RANK = "kill_rank"  # the rank SIGKILLs itself as `step` begins (mode agent: its node's agent does, late)
    KILL_NODE = "kill_node"  # the node's agent kills the node's raylet (and its workers) and stops heartbeating
    HANG_RANK = "hang_rank"  # the rank SIGSTOPs itself as `step` begins (mode agent: its node's agent does, late)
    SLOW_RANK = "slow_rank"  # the node's agent duty-cycles SIGSTOP/SIGCONT so the rank runs `factor` x slower
    NAN_LOSS = "nan_loss"  # the rank's loss becomes NaN from `step` (a one-shot fault file read by the rank)
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # bytes of the newest valid checkpoint are overwritten
    DEGRADE_NIC = "degrade_nic"
    NIC_LATENCY = "nic_latency"
    NIC_LOSS = "nic_loss"
    FLAP_NIC = "flap_nic"
    PARTITION_NODE = "partition_node"


class FaultStatus(str, enum.Enum):
    PENDING = "PENDING"  # waiting for the job to reach `step`
    FIRED = "FIRED"  # carried out
    CLEARED = "CLEARED"  # undone (or never needed: the job ended first)
    FAILED = "FAILED"  # could not be carried out (message says why)


PROCESS_MODES = ("rank", "agent")
"""kill_rank's and hang_rank's ways: ``rank`` (default), the rank itself at exactly ``step`` (armed in
its fault file as soon as the fault is created); ``agent``, its node's agent signals the process once
the controller has seen the job reach ``step`` (the step it really hit is later: ``hit_step``)."""

SLOW_MODES = ("throttle", "compute", "comm")
"""slow_rank's ways to slow a rank: ``throttle``, a SIGSTOP/SIGCONT duty cycle of its process by the
agent (from outside, like a host CPU starved by something else: a busy host dilutes it); ``compute``,
the rank's own compute phase made ``factor`` times longer (a slow accelerator: exact whatever the load);
``comm``, the same seconds spent late to its collectives instead (the rank's step's collectives start
``(factor - 1)`` x its compute phase late, inside its optimizer step: a slow communication path, a
starved progress thread; its peers wait for it inside the collective, its forward+backward is as fast
as theirs). A link that is slow for both of its ends is ``degrade_nic`` (network namespaces)."""


class FaultCreate(_Strict):
    """``POST /jobs/{id}/faults``: cause ``kind`` on a rank or node once the job reaches ``step``."""

    kind: FaultKind
    rank: int | None = Field(None, ge=0, le=1_000_000, description="Target rank (rank faults).")
    node_id: Line | None = Field(None, min_length=1, max_length=NAME_MAX, description="Target node (node faults).")
    step: int = Field(0, ge=0, le=INT32_MAX, description="Fire once the job has reached this step (0: at once).")
    params: Params = Field(
        default_factory=dict, max_length=64,
        description="Kind-specific: slow_rank factor (default 3) and mode (throttle | compute | comm), durations in seconds, ...",
    )

    @model_validator(mode="after")
    def _target(self) -> FaultCreate:
        needs_rank = {FaultKind.KILL_RANK, FaultKind.HANG_RANK, FaultKind.SLOW_RANK, FaultKind.NAN_LOSS}
        if self.kind in needs_rank and self.rank is None:
            raise ValueError(f"rank: required for {self.kind.value}")
        if self.kind == FaultKind.KILL_NODE and self.rank is None and self.node_id is None:
            raise ValueError("node_id: required for kill_node (or give a rank: its node is killed)")
        # Every kind's parameters typed and ranged (vigil.contract.schemas.fault_params): none reaches the
        # monitor or an agent that it cannot carry out.
        self.params = check_params(self.kind.value, dict(self.params))
        return self


class FaultPublic(BaseModel):
    id: int
    job_id: str
    kind: FaultKind
    rank: int | None
    node_id: str | None
    step: int
    hit_step: int | None = Field(None, description=(
        "The step the fault really hit: reported by the rank for the faults it carries out itself (exact), "
        "else the job's newest step when the agent carried it out; None until then."))
    params: dict[str, Any]
    status: FaultStatus
    message: str | None
    created_at: datetime
    fired_at: datetime | None
    cleared_at: datetime | None


class FaultsPublic(BaseModel):
    data: list[FaultPublic]
    count: int


class CommandKind(str, enum.Enum):
    """What the controller asks a node's agent to do."""

    KILL_PID = "kill_pid"  # args: pid, signal (default SIGKILL)
    STOP_PID = "stop_pid"  # args: pid
    CONT_PID = "cont_pid"  # args: pid
    THROTTLE_PID = "throttle_pid"  # args: pid, factor (run 1/factor of the time), period_s
    UNTHROTTLE_PID = "unthrottle_pid"  # args: pid
    WRITE_FAULT_FILE = "write_fault_file"  # args: job_id, rank, fault (dict), file ("fault" | "adapt")
    CORRUPT_FILES = "corrupt_files"  # args: path (checkpoint folder under the agent's storage root)
    KILL_NODE = "kill_node"  # args: none
    STOP_RAYLET = "stop_raylet"  # args: none (eviction: the agent keeps running)
    START_RAYLET = "start_raylet"  # args: none (readmission)
    PYSPY_DUMP = "pyspy_dump"  # args: job_id, pids: {rank: pid}
    SHAPE_NIC = "shape_nic"  # args: kind, ... (network faults)


class CommandStatus(str, enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


class NodeCommand(BaseModel):
    id: int
    node_id: str
    kind: CommandKind
    args: dict[str, Any]
    status: CommandStatus
    created_at: datetime


class NodeCommandsPublic(BaseModel):
    data: list[NodeCommand]
    count: int


class CommandResult(_Strict):
    """An agent's answer to a command. ``output`` for pyspy_dump: {"stacks": {rank: text}, "states": {rank: s}}."""

    ok: bool
    message: Text = Field("", max_length=TEXT_MAX)
    output: dict[str, Any] = Field(
        default_factory=dict,
        description=f"JSON of at most {HOST_MAX_ITEMS} values, {HOST_MAX_DEPTH} levels deep; non-finite numbers "
        "are stored as null.",
    )

    @field_validator("output")
    @classmethod
    def _output_is_storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _storable_json(v)


class IncidentKind(str, enum.Enum):
    NODE_LOST = "node_lost"
    RANK_DIED = "rank_died"
    HANG = "hang"
    STRAGGLER = "straggler"
    NIC_DEGRADED = "nic_degraded"
    NAN_LOSS = "nan_loss"
    LOSS_SPIKE = "loss_spike"
    MANUAL = "manual"  # a recovery a user asked for


class IncidentStatus(str, enum.Enum):
    OPEN = "OPEN"  # detected, no action taken (observe policy, or waiting)
    ACTING = "ACTING"  # recovery action under way
    RECOVERED = "RECOVERED"  # the job made progress again after the action
    FAILED = "FAILED"  # recovery gave up
    CLOSED = "CLOSED"  # nothing more to do (job ended, or observe-only)


class IncidentPublic(BaseModel):
    id: int
    job_id: str | None
    kind: IncidentKind
    status: IncidentStatus
    node_id: str | None
    rank: int | None
    evidence: dict[str, Any]
    action: str | None
    step_at_detect: int | None = Field(None, description="The job's newest step when the incident was opened.")
    detected_at: datetime
    acted_at: datetime | None
    recovered_at: datetime | None


class IncidentsPublic(BaseModel):
    data: list[IncidentPublic]
    count: int


class CheckpointPublic(BaseModel):
    id: int
    job_id: str
    step: int
    path: str
    valid: bool
    world_size: int
    files: int
    bytes: int
    manifest_sha256: str
    loss: float | None
    created_at: datetime


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]
    count: int


TRAINING_THREAD = "vigil-train"
"""Name Vigil gives the thread that runs a rank's training function (``vigil/runner.py``), so that
its stack can be told from the process's other threads: under Ray Train the process's *main* thread
idles in Ray's worker loop on every rank, and only the training thread shows where a rank is stuck."""


class StackGroup(BaseModel):
    """Ranks whose stacks share one signature (the innermost frames of the training thread)."""

    signature: str
    ranks: list[int]
    sample: str = Field(description="One rank's stack, its training thread first.")
    thread: str = Field("", description="The thread the signature was taken from (its name in py-spy's dump).")


class StacksPublic(BaseModel):
    job_id: str
    collected_at: datetime | None
    groups: list[StackGroup]
    odd_ranks: list[int] = Field(description="Ranks whose stack differs from the majority: the likely culprits.")
    stacks: dict[int, str] = Field(description="Each rank's py-spy dump, its training thread first.")


class RecoverRequest(_Strict):
    """``POST /jobs/{id}/recover``: restart the job's ranks from the newest valid checkpoint."""

    reason: Text = Field("manual", max_length=1024)
    evict_node: Line | None = Field(None, max_length=NAME_MAX, description="Also evict this node first.")


class NodeActionPublic(BaseModel):
    """``POST /nodes/{id}/evict`` and ``POST /nodes/{id}/readmit``: the node's state after the action."""

    node_id: str
    state: NodeState = Field(description="EVICTED after an eviction, ALIVE after a readmission.")
    outcome: str | None = Field(
        None, description="Eviction only: what became of the drain in Ray (drained, refused, failed, or only marked)."
    )
