"""Storage models (SQLAlchemy 2, typed). Alembic migrations in ``migrations/`` must agree with these."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive values otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, datetime: UTCDateTime()}


RAW_SAMPLES_WITHOUT_FK = True
"""The raw sample tables (``step_metrics``, ``collective_metrics``) carry no foreign key to ``jobs``
(migration 0008): the check ran once per inserted row (on PostgreSQL a trigger that key-share locks the
job's row, from every concurrent ingest) and cost a quarter of the database's ingest rate. Ingest
stores only samples of jobs that exist (:func:`controller.telemetry.store`), and raw rows are pruned
after ``raw_retention_s`` whatever their job; jobs are never deleted. The aggregates keep theirs."""


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]]
    ray_job_id: Mapped[str | None] = mapped_column(String(128))
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    last_step: Mapped[int | None] = mapped_column(Integer)
    last_loss: Mapped[float | None] = mapped_column(Float)
    restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    stalled_restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    progress_mark: Mapped[int | None] = mapped_column(Integer)
    created_by: Mapped[str | None] = mapped_column(String(32))
    """Id of the token that submitted the job (None: auth off, a process-internal token, or stored before
    owners were kept): a ``user`` token acts only on its own jobs (controller/auth.py)."""


class StepMetric(Base):
    """One step of one rank (raw sample)."""

    __tablename__ = "step_metrics"
    # (job, rank, step, attempt): one sample, stored once whatever replays it (and a rank's series);
    # (job, step): one step's rows (the aggregator, the views' forming steps), which the first index
    # can only find by scanning every raw row of the job.
    __table_args__ = (Index("uq_step_metrics_sample", "job_id", "rank", "step", "attempt", unique=True),
                      Index("ix_step_metrics_job_step", "job_id", "step"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32))  # no foreign key: RAW_SAMPLES_WITHOUT_FK
    node_id: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    ts: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(Integer, default=0)
    step_time_s: Mapped[float] = mapped_column(Float)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    data_s: Mapped[float | None] = mapped_column(Float)
    fwd_bwd_s: Mapped[float | None] = mapped_column(Float)
    optim_s: Mapped[float | None] = mapped_column(Float)
    comm_s: Mapped[float | None] = mapped_column(Float)
    comm_wait_s: Mapped[float | None] = mapped_column(Float)
    val_loss: Mapped[float | None] = mapped_column(Float)
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    cpu_wait_s: Mapped[float | None] = mapped_column(Float)


class CollectiveMetric(Base):
    """One collective call of one rank (raw sample)."""

    __tablename__ = "collective_metrics"
    # One call of one rank's attempt at a step, stored once; its (job, step) prefix finds a step's rows.
    __table_args__ = (Index("uq_collective_metrics_sample", "job_id", "step", "rank", "attempt", "seq", unique=True),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32))  # no foreign key: RAW_SAMPLES_WITHOUT_FK
    node_id: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    seq: Mapped[int] = mapped_column(Integer)
    op: Mapped[str] = mapped_column(String(64))
    group: Mapped[str] = mapped_column(String(64))
    tag: Mapped[str] = mapped_column(String(64))
    payload_bytes: Mapped[int] = mapped_column(BigInteger)
    wire_bytes: Mapped[int] = mapped_column(BigInteger)
    elements: Mapped[int] = mapped_column(BigInteger)
    duration_s: Mapped[float] = mapped_column(Float)
    ts: Mapped[float] = mapped_column(Float)


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(128), default="")
    address: Mapped[str] = mapped_column(String(128), default="")
    state: Mapped[str] = mapped_column(String(16), default="ALIVE")
    agent_id: Mapped[str | None] = mapped_column(String(128))
    last_heartbeat: Mapped[datetime | None]
    ranks: Mapped[list[Any]] = mapped_column(JSON, default=list)
    host: Mapped[dict[str, Any]] = mapped_column(default=dict)
    dropped_samples: Mapped[int] = mapped_column(BigInteger, default=0)


class TelemetryBatchSeen(Base):
    """(agent, seq) of every batch ingested: replays are recognised and ignored."""

    __tablename__ = "telemetry_batches"
    __table_args__ = (UniqueConstraint("agent_id", "seq", name="uq_telemetry_batches_agent_seq"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(String(128))
    seq: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    samples: Mapped[int] = mapped_column(Integer, default=0)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(32), index=True)
    node_id: Mapped[str | None] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class CodePackage(Base):
    """One uploader's claim on a stored code package (controller/package_store.py): what counts against
    that user's quota; the rows go with the file when it is garbage-collected."""

    __tablename__ = "code_packages"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32), primary_key=True, index=True)
    """The uploading token's id ('' without one)."""
    size: Mapped[int] = mapped_column(BigInteger)
    uploaded_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """A bearer token of the REST API. Only a hash of the secret is kept (see ``controller.tokens``)."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(128), default="")
    role: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str | None] = mapped_column(String(128))
    """An ``agent`` token scoped to one node: it may ingest and fetch commands for that node only."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(32))
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


# --------------------------------------------------------------------------------------------------
# Telemetry aggregates (kept for good; raw step/collective rows are pruned after a window)
# --------------------------------------------------------------------------------------------------


class TelemetryDirtyStep(Base):
    """A (job, step) whose raw samples changed since its aggregates were last computed.

    Ingest upserts it (``version`` + 1, ``touched_at`` = now) in the same transaction as the raw
    rows; the aggregator recomputes the step once it has settled and deletes the row only if its
    version is still the one it read, so samples that race in are never left out.
    """

    __tablename__ = "telemetry_dirty_steps"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, default=1)
    touched_at: Mapped[float] = mapped_column(Float, index=True)


class JobStepStat(Base):
    """One step of a job over all its ranks: the row a dashboard or Prometheus reads first.

    The columns from ``step_time_p90_s`` to ``reruns`` came later (migration 0006): rows written
    before have ``reporting`` None, and the views derive those figures from ``rank_step_stats``.
    """

    __tablename__ = "job_step_stats"
    __table_args__ = (Index("ix_job_step_stats_job_ts", "job_id", "ts"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float)
    ranks: Mapped[int] = mapped_column(Integer)
    loss_mean: Mapped[float | None] = mapped_column(Float)
    step_time_p50_s: Mapped[float | None] = mapped_column(Float)
    step_time_max_s: Mapped[float | None] = mapped_column(Float)
    slowest_rank: Mapped[int | None] = mapped_column(Integer)
    comm_s_max: Mapped[float | None] = mapped_column(Float)
    comm_wait_max_s: Mapped[float | None] = mapped_column(Float)
    most_waiting_rank: Mapped[int | None] = mapped_column(Integer)
    collectives: Mapped[int] = mapped_column(Integer, default=0)
    payload_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    wire_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    step_time_p90_s: Mapped[float | None] = mapped_column(Float)
    val_loss_mean: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    """Sum over the ranks that reported the step."""
    reporting: Mapped[int | None] = mapped_column(Integer)
    """Ranks with a step sample (``ranks`` also counts ranks seen only in collectives)."""
    start_ts: Mapped[float | None] = mapped_column(Float)
    """Earliest start (``ts - step_time_s``) over the ranks of the kept attempt."""
    reruns: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    """``[[start, end], ...]`` of the step's earlier attempts (None: it ran once)."""
    lost_s: Mapped[float | None] = mapped_column(Float)
    """Seconds the step lost to its slow ranks (:func:`controller.step_stats.seconds_lost`; None: the ranks'
    waits inside collectives are unknown, or the row predates migration 0012)."""


class RankStepStat(Base):
    """The step breakdown of one rank (raw StepSample + what its collectives add up to)."""

    __tablename__ = "rank_step_stats"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[str] = mapped_column(String(128))
    ts: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    data_s: Mapped[float | None] = mapped_column(Float)
    fwd_bwd_s: Mapped[float | None] = mapped_column(Float)
    optim_s: Mapped[float | None] = mapped_column(Float)
    comm_s: Mapped[float | None] = mapped_column(Float)
    comm_wait_s: Mapped[float | None] = mapped_column(Float)
    collectives: Mapped[int] = mapped_column(Integer, default=0)
    payload_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    wire_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    lost_s: Mapped[float | None] = mapped_column(Float)
    """This rank's share of the step's seconds lost to slow ranks (None: unknown)."""
    rel_own_s: Mapped[float | None] = mapped_column(Float)
    """This rank's own time minus the step's median own time (None: unknown); the median of a rank's newest
    values is its offset in the seconds-lost model (:mod:`controller.step_stats`)."""


class CollectiveStepStat(Base):
    """One kind of collective (op, group, tag) in one step, over all ranks.

    Durations are per rank, summed over the rank's calls of that kind in the step; p50 / max / min
    are taken across ranks. ``transfer_s`` sums, over the calls, the fastest rank's duration.
    """

    __tablename__ = "collective_step_stats"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    op: Mapped[str] = mapped_column(String(64), primary_key=True)
    group: Mapped[str] = mapped_column(String(64), primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)
    ts: Mapped[float] = mapped_column(Float)
    calls: Mapped[int] = mapped_column(Integer)
    ranks: Mapped[int] = mapped_column(Integer)
    p50_s: Mapped[float] = mapped_column(Float)
    max_s: Mapped[float] = mapped_column(Float)
    min_s: Mapped[float] = mapped_column(Float)
    slowest_rank: Mapped[int] = mapped_column(Integer)
    transfer_s: Mapped[float] = mapped_column(Float)
    wait_p50_s: Mapped[float] = mapped_column(Float)
    wait_max_s: Mapped[float] = mapped_column(Float)
    most_waiting_rank: Mapped[int] = mapped_column(Integer)
    payload_bytes: Mapped[int] = mapped_column(BigInteger)
    wire_bytes: Mapped[int] = mapped_column(BigInteger)
    elements: Mapped[int] = mapped_column(BigInteger)


# --- detection, recovery, fault injection (docs/RECOVERY.md) -------------------------------------


class Checkpoint(Base):
    """A checkpoint a job wrote (reported by its rank 0 through the telemetry path)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "path", name="uq_checkpoints_job_path"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))
    valid: Mapped[bool] = mapped_column(default=True)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    files: Mapped[int] = mapped_column(Integer, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    manifest_sha256: Mapped[str] = mapped_column(String(64), default="")
    loss: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Fault(Base):
    """An injected fault: what, where, when it fired and when it was undone."""

    __tablename__ = "faults"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int | None] = mapped_column(Integer)
    node_id: Mapped[str | None] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(Integer, default=0)
    hit_step: Mapped[int | None] = mapped_column(Integer)
    """The step the fault really hit (the rank's report, or the job's newest step when the agent acted)."""
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default="PENDING", index=True)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    fired_at: Mapped[datetime | None]
    cleared_at: Mapped[datetime | None]


class NodeCommandRow(Base):
    """A command for one node's agent (kill a pid, dump stacks, ...) and the agent's answer."""

    __tablename__ = "node_commands"
    __table_args__ = (Index("ix_node_commands_node_status", "node_id", "status"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))
    args: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default="PENDING")
    job_id: Mapped[str | None] = mapped_column(String(32))
    incident_id: Mapped[int | None] = mapped_column(BigInteger)
    fault_id: Mapped[int | None] = mapped_column(BigInteger)
    result: Mapped[dict[str, Any]] = mapped_column(default=dict)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    done_at: Mapped[datetime | None]


class Incident(Base):
    """A finding: kind, suspect node/rank, the evidence, and detect / act / recover times."""

    __tablename__ = "incidents"
    __table_args__ = (Index("ix_incidents_job_status", "job_id", "status"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str | None] = mapped_column(String(32))
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="OPEN")
    node_id: Mapped[str | None] = mapped_column(String(128))
    rank: Mapped[int | None] = mapped_column(Integer)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    action: Mapped[str | None] = mapped_column(Text)
    detected_at: Mapped[datetime] = mapped_column(default=utcnow)
    acted_at: Mapped[datetime | None]
    recovered_at: Mapped[datetime | None]
    step_at_detect: Mapped[int | None] = mapped_column(Integer)


class NodeHostSample(Base):
    """A node's host metrics at one heartbeat, a few numbers out of ``Node.host`` (the node history).

    At most one row per node per ``VIGIL_HOST_HISTORY_INTERVAL_S`` and the newest
    ``VIGIL_HOST_HISTORY_MAX_ROWS`` per node are kept (:mod:`controller.host_history`).
    """

    __tablename__ = "node_host_samples"
    __table_args__ = (Index("ix_node_host_samples_node_ts", "node_id", "ts"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(128))
    ts: Mapped[float] = mapped_column(Float)
    cpu_percent: Mapped[float | None] = mapped_column(Float)
    memory_percent: Mapped[float | None] = mapped_column(Float)
    disk_percent: Mapped[float | None] = mapped_column(Float)
    load_1m: Mapped[float | None] = mapped_column(Float)
    rx_bytes_per_s: Mapped[float | None] = mapped_column(Float)
    tx_bytes_per_s: Mapped[float | None] = mapped_column(Float)
    nic_errors_per_s: Mapped[float | None] = mapped_column(Float)
    nic_drops_per_s: Mapped[float | None] = mapped_column(Float)
    gpu_util_percent: Mapped[float | None] = mapped_column(Float)
    gpu_memory_percent: Mapped[float | None] = mapped_column(Float)


class StackDump(Base):
    """py-spy stacks of one rank, collected by its node's agent."""

    __tablename__ = "stack_dumps"
    __table_args__ = (Index("ix_stack_dumps_job_ts", "job_id", "collected_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32))
    incident_id: Mapped[int | None] = mapped_column(BigInteger)
    node_id: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int] = mapped_column(Integer)
    stack: Mapped[str] = mapped_column(Text)
    collected_at: Mapped[datetime] = mapped_column(default=utcnow)


class RankProgress(Base):
    """Where each rank of a job last stood in its collectives while its steps stalled (the newest report per
    rank): a hang's diagnosis lines them up to name the rank that never entered the others' collective."""

    __tablename__ = "rank_progress"

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    ts: Mapped[float] = mapped_column(Float)
    step: Mapped[int] = mapped_column(Integer, default=0)
    idle_s: Mapped[float] = mapped_column(Float, default=0.0)
    state: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """``groups``, ``in_flight`` and ``last_done`` of the rank's :class:`ProgressSample`."""
