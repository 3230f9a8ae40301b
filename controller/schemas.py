"""Wire schemas: the one contract between the controller, the agents, the trainer and the dashboard.

Pydantic v2 models only; importing this module must stay cheap (no torch, no ray, no SQLAlchemy).
Every field says what it means and what it accepts; invalid input raises a ``ValidationError``
that names the field and the rule, which the API returns as 422.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import re
import shlex
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from controller.optimizer_params import OptimizerParams, parse_optimizer_params

NAME_MAX = 128
TEXT_MAX = 4096
MAX_TELEMETRY_ITEMS = 10_000
INT32_MAX = 2**31 - 1
"""Largest value of an ``Integer`` column (PostgreSQL's int4): counters stored there are bounded by it."""
INT64_MAX = 2**63 - 1
"""Largest value of a ``BigInteger`` column."""
TS_MAX = 253_402_300_799.0
"""Last second of year 9999: the largest unix time a ``datetime`` can hold."""
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Ids in URLs (jobs, tokens): what the controller generates, so anything else is refused with 422."""
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""Node ids in URLs: what an agent may call its node (``agent.main`` enforces the same characters)."""
HOST_MAX_ITEMS = 20_000
HOST_MAX_DEPTH = 12

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# Cached: ingest checks the same few job ids and op names millions of times a minute, and a
# cache hit skips the Python call (measured: validating a batch costs ~40% less). Only
# strings that pass are cached (a raise is not), so what is accepted does not change.
@functools.lru_cache(maxsize=4096)
def _no_control(v: str) -> str:
    """Single-line text: no control characters (NUL, newlines, escapes) in names and identifiers."""
    if _CONTROL.search(v):
        raise ValueError("must not contain control characters")
    return v


def _no_nul(v: str) -> str:
    """Free text may span lines, but never holds NUL (PostgreSQL text cannot store it)."""
    if "\x00" in v:
        raise ValueError("must not contain NUL characters")
    return v


Line = Annotated[str, AfterValidator(_no_control)]
"""A name or identifier: one line of printable text (length limits are set per field)."""
Text = Annotated[str, AfterValidator(_no_nul)]
"""Free text: any characters but NUL (length limits are set per field)."""

_SLUG_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def slugify(value: str, max_length: int = 64) -> str:
    """``value`` made safe as one path component: ``[A-Za-z0-9_.-]``, no leading dot, never empty.

    Names are stored verbatim but never used in a path as they are: ``../../etc`` becomes
    ``etc-<hash>``. A value that is already safe comes back unchanged (so ``job_0123abcd`` keeps
    naming the same folder); one that had to change gets a short hash of the original, so that
    two different names cannot end up sharing a folder.
    """
    slug = _SLUG_BAD.sub("-", value)
    slug = re.sub(r"\.{2,}", ".", slug).strip("-._")
    if slug == value and 0 < len(slug) <= max_length:
        return slug
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{slug[: max(0, max_length - 11)]}-{digest}" if slug else digest


class _Strict(BaseModel):
    """Base for input models: unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------------------
# Job status
# --------------------------------------------------------------------------------------------------


class JobStatus(str, enum.Enum):
    """Life cycle of a job. Only :func:`controller.jobs.transition` changes a job's status."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES

    def can_move_to(self, new: JobStatus) -> bool:
        return new in _ALLOWED[self]


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
_ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


# --------------------------------------------------------------------------------------------------
# Job spec
# --------------------------------------------------------------------------------------------------

OptimizerKind = Literal[
    "adamw",
    "powersgd",
    "fp16_compress",
    "local_adamw",
    "slowmo",
    "dsm",
    "sdp4bit",
    "sdp4bit_qw",
    "sdp4bit_qwd",
    "sdp4bit_tlq",
    "sdp4bit_tlq_hs",
    "sdp4bit_ulq",
    "cser",
    "cser_pl",
    "ef_sgd",
    "qsparse_local_sgd",
    "compressed_adam",
]


class ModelSpec(_Strict):
    """GPT-style byte-level language model (vocabulary of 256 bytes)."""

    n_layer: int = Field(2, ge=1, le=48, description="Transformer blocks.")
    n_head: int = Field(2, ge=1, le=64, description="Attention heads per block.")
    d_model: int = Field(64, ge=8, le=8192, description="Embedding width; a multiple of n_head.")
    context: int = Field(64, ge=8, le=4096, description="Context length in bytes.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        return self


class DataSpec(_Strict):
    """Training data. ``pydoc`` is CPython's own documentation text plus stdlib sources: on every machine."""

    corpus: Literal["pydoc"] = Field("pydoc", description="Offline corpus to train on.")
    max_bytes: int = Field(4_000_000, ge=10_000, le=200_000_000, description="Bytes of corpus to use.")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Share of the corpus held out for validation.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for sampling batches and initialising the model.")


_P = TypeVar("_P", bound=OptimizerParams)
STORED = "stored"
"""Validation-context key: ``{STORED: True}`` reads a spec back from the database, where a row stored before
``optimizer.params`` was checked must still list (the check runs at submission)."""

Params = dict[
    Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(_no_control)],
    Annotated[float, Field(allow_inf_nan=False)]
    | Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)]
    | Annotated[str, StringConstraints(max_length=256), AfterValidator(_no_control)]
    | bool,
]
"""Method- or kind-specific parameters: names of at most 64 characters, text of at most 256, finite numbers
(stored as JSON, which PostgreSQL refuses with NaN in it). Give the field ``max_length`` for the count."""


class OptimizerSpec(_Strict):
    """Which optimizer, its learning rate and its method-specific parameters."""

    kind: OptimizerKind = Field("adamw", description="Optimizer; see ALGORITHMS.md.")
    lr: float = Field(1e-3, gt=0.0, le=10.0, description="Peak learning rate.")
    weight_decay: float = Field(0.1, ge=0.0, le=1.0, description="Decoupled weight decay of the local optimizer.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="Global gradient-norm clip; 0 disables.")
    params: Params = Field(
        default_factory=dict, max_length=64,
        description="Method-specific parameters (tau, gamma, rank, compressor, ...): at most 64, names of at "
        "most 64 characters, text values of at most 256, numbers finite; each kind accepts the names, types "
        "and ranges of its class in controller/optimizer_params.py (unknown names are refused).",
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerSpec:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        return self

    @model_validator(mode="after")
    def _params_fit_kind(self, info: ValidationInfo) -> OptimizerSpec:
        # Raises ValueError "optimizer.params.<field> (<kind>): <rule>": a 422 at submission, not a
        # failure on the ranks later. The parse is cheap; typed_params() repeats it.
        if not (info.context or {}).get(STORED):
            parse_optimizer_params(self.kind, self.params)
        return self

    def typed_params(self, expect: type[_P] = OptimizerParams) -> _P:  # type: ignore[assignment]
        """``params`` parsed into the kind's dataclass (``controller.optimizer_params.PARAMS_BY_KIND``),
        defaults filled in. ``expect``: the class the caller works with; ``TypeError`` if the kind's is another."""
        typed = parse_optimizer_params(self.kind, self.params)
        if not isinstance(typed, expect):
            raise TypeError(f"optimizer.kind {self.kind!r} takes {type(typed).__name__}, not {expect.__name__}")
        return typed


class ScalingSpec(_Strict):
    """How many ranks, and what each one needs. Elastic between min and max workers."""

    min_workers: int = Field(1, ge=1, le=1024, description="Fewest ranks the job may run on.")
    max_workers: int = Field(2, ge=1, le=1024, description="Most ranks the job may run on.")
    cpus_per_worker: float = Field(1.0, gt=0.0, le=256.0, description="CPUs reserved per rank.")

    @model_validator(mode="after")
    def _min_le_max(self) -> ScalingSpec:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) must be <= max_workers ({self.max_workers})")
        return self


class LRScheduleSpec(_Strict):
    """Learning-rate schedule: linear warmup, then constant or cosine decay to ``min_lr_ratio * lr``."""

    kind: Literal["constant", "cosine"] = Field("cosine", description="Shape after warmup.")
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the peak (cosine).")


class CheckpointSpec(_Strict):
    """When to checkpoint and how many to keep."""

    interval_steps: int = Field(0, ge=0, le=10_000_000, description="Steps between checkpoints; 0: none.")
    keep_last: int = Field(3, ge=1, le=100, description="Valid checkpoints kept.")


class RecoveryPolicy(str, enum.Enum):
    OBSERVE = "observe"
    EVICT_RESTART = "evict_restart"
    ROLLBACK = "rollback"


class RecoveryThresholds(_Strict):
    """The detectors' thresholds for this job (docs/RECOVERY.md, "Detection"). Every field has a default.

    Monitor-wide values that judge nodes rather than jobs (the heartbeat timeout) are controller
    settings, not here.
    """

    death_grace_s: float = Field(
        1.5, ge=0.0, le=60.0,
        description="rank_died: after a rank is seen dead, wait this long for every agent's report before naming "
        "the rank that died first.")
    hang_k: float = Field(
        10.0, gt=0.0, le=1000.0, description="hang: no new step for max(hang_k x median step time, hang_floor_s).")
    hang_floor_s: float = Field(
        15.0, gt=0.0, le=86_400.0, description="hang: the shortest silence that counts as a hang, in seconds.")
    stack_wait_s: float = Field(
        10.0, ge=0.0, le=600.0,
        description="hang: how long to wait for every rank's py-spy stack before deciding without the missing ones.")
    straggler_ratio: float = Field(
        1.7, ge=1.0, le=100.0,
        description="straggler: over the last straggler_m scored steps, a rank's median compute (or lateness) is "
        "at least this many times its peers' median ...")
    straggler_own_ratio: float = Field(
        1.4, ge=1.0, le=100.0, description="straggler: ... and this many times its own recent median ...")
    straggler_step_ratio: float = Field(
        1.2, ge=1.0, le=100.0,
        description="straggler: ... and slower than its peers by this factor in at least straggler_k of those steps "
        "(persistence) ...")
    straggler_k: int = Field(6, ge=1, le=100, description="straggler: steps of the window that must be slow (k of m).")
    straggler_m: int = Field(
        10, ge=1, le=100, description="straggler: the window of scored steps (also bounds how much is read per pass).")
    straggler_min_excess_s: float = Field(
        0.025, ge=0.0, le=60.0, description="straggler: ... and its excess over its peers is at least this many seconds ...")
    straggler_min_share: float = Field(
        0.25, ge=0.0, le=1.0, description="straggler: ... and at least this share of the median step time.")
    checkpoint_settle_s: float = Field(
        0.25, ge=0.0, le=3600.0,
        description="straggler: steps in a checkpoint's shadow are scored again this long after it completed.")
    spike_ratio: float = Field(
        3.0, gt=1.0, le=1000.0, description="loss_spike: a loss above this many times the recent median.")
    drain_deadline_s: float = Field(
        5.0, gt=0.0, le=3600.0, description="eviction: the ranks on a drained node get this long to checkpoint.")
    restart_gap_s: float = Field(
        5.0, gt=0.0, le=3600.0,
        description="a pause this long in the job's steps after a recovery action counts as its restart.")

    @model_validator(mode="after")
    def _k_le_m(self) -> RecoveryThresholds:
        if self.straggler_k > self.straggler_m:
            raise ValueError(f"straggler_k ({self.straggler_k}) must be <= straggler_m ({self.straggler_m})")
        return self


class RecoverySpec(_Strict):
    """What the controller does when it detects a fault in this job."""

    policy: RecoveryPolicy = Field(RecoveryPolicy.EVICT_RESTART, description="observe | evict_restart | rollback.")
    max_restarts: int = Field(3, ge=0, le=100, description="Restarts without progress before the job FAILS.")
    thresholds: RecoveryThresholds = Field(
        default_factory=RecoveryThresholds, description="The detectors' thresholds for this job (defaults: docs/RECOVERY.md).")


DEFAULT_ENTRYPOINT = "examples.gpt_pydoc.gpt_train:train_func"
"""The bundled GPT example (``examples/gpt_pydoc``, installed with Vigil): what a spec without an
``entrypoint`` runs. It is written against the public rank API like any user's code."""
ENTRYPOINT_MAX = 1024
PACKAGE_REF_PATTERN = r"^sha256:[0-9a-f]{64}$"
"""How a job refers to an uploaded code package: ``sha256:`` and the zip's hex digest."""
_FUNCTION_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_PIP_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*([<>=!~]=?[^\s;,]+\s*(,\s*[<>=!~]=?[^\s;,]+\s*)*)?$")


@dataclass(frozen=True)
class Entrypoint:
    """A parsed ``entrypoint``: a function (``module:function``) or a script with its arguments."""

    module: str | None = None
    function: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()

    @property
    def is_script(self) -> bool:
        return self.script is not None


def parse_entrypoint(value: str) -> Entrypoint:
    """``"pkg.mod:func"`` or ``"python path/to/script.py --arg 1"``; ``ValueError`` saying the rule."""
    value = value.strip()
    if _FUNCTION_ENTRY.match(value):
        module, _, function = value.partition(":")
        return Entrypoint(module=module, function=function)
    try:
        words = shlex.split(value)
    except ValueError as e:
        raise ValueError(f"cannot be split into words ({e})") from e
    if len(words) >= 2 and words[0] in ("python", "python3"):
        script = words[1]
        parts = PurePosixPath(script).parts
        if not script.endswith(".py") or script.startswith("/") or ".." in parts or "\\" in script:
            raise ValueError(f"script {script!r} must be a relative path to a .py file inside working_dir (no '..')")
        return Entrypoint(script=script, args=tuple(words[2:]))
    raise ValueError(
        "must be a function as 'package.module:function' or a script as 'python train.py [args...]'"
    )


def _check_entrypoint(v: str) -> str:
    parse_entrypoint(v)
    return v


def _check_requirement(v: str) -> str:
    if not _PIP_REQUIREMENT.match(v.strip()):
        raise ValueError("must be a pip requirement 'name', 'name[extra]' or 'name==1.2' (no URLs, paths or options)")
    return v.strip()


class JobCreate(_Strict):
    """A job as submitted by a user (REST body or YAML file)."""

    name: Line = Field(
        ..., min_length=1, max_length=NAME_MAX,
        description="Free-form name: stored and returned verbatim, never used as a path (see slugify).",
    )
    entrypoint: Annotated[Line, AfterValidator(_check_entrypoint)] = Field(
        DEFAULT_ENTRYPOINT, min_length=1, max_length=ENTRYPOINT_MAX,
        description="What every rank runs: a function 'package.module:function' called with `config` (Ray "
        "Train style), or a script 'python train.py --epochs 3' run as __main__ on every rank (a path inside "
        "working_dir). Both use the rank API (trainer.sdk). Default: the bundled GPT example.",
    )
    working_dir: str | None = Field(
        None, pattern=PACKAGE_REF_PATTERN,
        description="The job's code: 'sha256:<hex>' of a package uploaded to /api/v1/packages (the CLI's "
        "--working-dir does both); Ray ships it to the driver and every rank, which import from it.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Free JSON handed to a function entry point (its one argument): at most {HOST_MAX_ITEMS} "
        f"values, {HOST_MAX_DEPTH} levels deep.",
    )
    pip: list[Annotated[str, StringConstraints(min_length=1, max_length=256), AfterValidator(_no_control),
                        AfterValidator(_check_requirement)]] = Field(
        default_factory=list, max_length=64,
        description="Extra pip requirements for this job, installed by Ray's runtime environment (needs the "
        "package index reachable from the nodes; the job FAILS with Ray's message otherwise).",
    )
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    steps: int = Field(100, ge=1, le=10_000_000, description="Optimizer steps to run.")
    batch_size: int = Field(8, ge=1, le=65_536, description="Sequences per rank per step.")
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    eval_interval: int = Field(0, ge=0, le=10_000_000, description="Steps between validation evaluations; 0: at end.")

    @field_validator("config")
    @classmethod
    def _config_is_storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _storable_json(v)

    @model_validator(mode="after")
    def _script_needs_code(self) -> JobCreate:
        if parse_entrypoint(self.entrypoint).is_script and self.working_dir is None:
            raise ValueError("entrypoint: a script entry point needs working_dir (the code it runs)")
        return self


class PackagePublic(BaseModel):
    """A stored code package (``POST /api/v1/packages``); a job names it by ``ref`` in ``working_dir``."""

    ref: str = Field(..., description="'sha256:<hex>': what a job spec's working_dir holds.")
    sha256: str
    size: int = Field(..., description="Bytes of the zip.")
    files: int = Field(..., description="Files it holds.")
    unzipped_bytes: int = Field(..., description="Bytes it unpacks to.")
    created: bool = Field(False, description="Stored by this request (False: the same bytes were already stored).")


class JobPublic(BaseModel):
    id: str
    name: str
    status: JobStatus
    spec: JobCreate
    ray_job_id: str | None = None
    message: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    last_step: int | None = None
    last_loss: float | None = None


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


# --------------------------------------------------------------------------------------------------
# Telemetry (rank -> agent -> controller)
# --------------------------------------------------------------------------------------------------

Finite = Annotated[float, Field(allow_inf_nan=False)]
UnixTime = Annotated[float, Field(ge=0.0, le=TS_MAX, allow_inf_nan=False)]
"""Seconds since the epoch, within what a datetime (and the database) can hold."""
JobRef = Annotated[Line, Field(min_length=1, max_length=64)]


class StepSample(_Strict):
    """One optimizer step of one rank, as the rank reports it."""

    kind: Literal["step"] = "step"
    job_id: JobRef
    rank: int = Field(..., ge=0, le=1_000_000)
    world_size: int = Field(1, ge=1, le=1_000_000)
    step: int = Field(..., ge=0, le=INT32_MAX)
    ts: UnixTime = Field(..., description="Unix time the step ended.")
    loss: float | None = Field(..., description="Training loss; None when not finite (a finding, not bad input).")
    lr: float | None = None
    tokens: int = Field(0, ge=0, le=INT32_MAX, description="Tokens this rank processed in the step.")
    step_time_s: Finite = Field(..., ge=0.0)
    tokens_per_s: Finite = Field(0.0, ge=0.0)
    data_s: Finite | None = Field(None, ge=0.0, description="Time waiting for data.")
    fwd_bwd_s: Finite | None = Field(None, ge=0.0, description="Forward + backward.")
    optim_s: Finite | None = Field(None, ge=0.0, description="Optimizer step, excluding communication.")
    comm_s: Finite | None = Field(None, ge=0.0, description="Sum of the step's collectives.")
    comm_wait_s: Finite | None = Field(None, ge=0.0, description="Wait inside the collectives.")
    val_loss: float | None = None
    pid: int | None = Field(None, ge=0, le=INT32_MAX)
    dropped: int = Field(0, ge=0, le=INT32_MAX, description="Samples this rank dropped since its last delivered one.")


class CollectiveSample(_Strict):
    """One collective call of one rank, as the communication layer recorded it."""

    kind: Literal["collective"] = "collective"
    job_id: JobRef
    rank: int = Field(..., ge=0, le=1_000_000)
    step: int = Field(..., ge=0, le=INT32_MAX)
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
    loss: float | None = None
    message: Text = Field("", max_length=1024)


RankSample = Annotated[StepSample | CollectiveSample | CheckpointSample, Field(discriminator="kind")]


def _storable_json(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` bounded in size and depth, NaN/inf as None, and no NUL in any string.

    Every database can store the result in a JSON column (PostgreSQL refuses NaN and NUL).
    """
    count = 0

    def walk(v: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if count > HOST_MAX_ITEMS:
            raise ValueError(f"holds more than {HOST_MAX_ITEMS} values")
        if depth > HOST_MAX_DEPTH:
            raise ValueError(f"is nested deeper than {HOST_MAX_DEPTH} levels")
        if isinstance(v, dict):
            return {_no_nul(str(k)): walk(x, depth + 1) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, str):
            return _no_nul(v)
        if isinstance(v, float) and not math.isfinite(v):
            return None  # a probe reading that is not a number: "unavailable", not bad input
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX:
            raise ValueError(f"holds an integer beyond 64 bits ({v})")
        return v

    return walk(value, 0)


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


# --------------------------------------------------------------------------------------------------
# Read models
# --------------------------------------------------------------------------------------------------


class NodeState(str, enum.Enum):
    ALIVE = "ALIVE"
    DEAD = "DEAD"
    EVICTED = "EVICTED"


class NodePublic(BaseModel):
    id: str
    hostname: str
    address: str
    state: NodeState
    agent_id: str | None
    last_heartbeat: datetime | None
    heartbeat_age_s: float | None
    ranks: list[RankProcess] = []
    host: dict[str, Any] = {}


class NodesPublic(BaseModel):
    data: list[NodePublic]
    count: int


class EventPublic(BaseModel):
    id: int
    ts: datetime
    kind: str
    job_id: str | None
    node_id: str | None
    message: str
    data: dict[str, Any] = {}


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


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


class Health(BaseModel):
    status: Literal["ok"]
    database: str
    version: str


class LogsPublic(BaseModel):
    job_id: str
    logs: str


# --------------------------------------------------------------------------------------------------
# Tokens (who may call the API)
# --------------------------------------------------------------------------------------------------


class Role(str, enum.Enum):
    """What a bearer token may do; ``controller.auth.ROUTE_POLICY`` maps every route to roles."""

    ADMIN = "admin"
    """Everything, including token management."""
    USER = "user"
    """Submit, cancel, recover, evict/readmit, and read."""
    AGENT = "agent"
    """A node agent: ingest telemetry and heartbeats; nothing else."""
    VIEWER = "viewer"
    """Read only (the dashboard)."""
    JOB = "job"
    """A job's Ray driver: only its own job (the token names it)."""


class TokenCreate(_Strict):
    """A token to issue. ``job_id`` is required for (and only for) the ``job`` role."""

    role: Role = Field(..., description="admin | user | agent | viewer | job.")
    name: Line = Field("", max_length=NAME_MAX, description="What the token is for (shown in lists).")
    job_id: str | None = Field(None, pattern=ID_PATTERN, description="The job a ``job`` token is scoped to.")
    node_id: str | None = Field(
        None, pattern=NODE_ID_PATTERN,
        description="The node an ``agent`` token is scoped to: it may ingest and fetch commands for that node only.",
    )
    expires_at: datetime | None = Field(
        None, description="When the token stops working (ISO 8601; UTC when no offset is given); none: never."
    )

    @field_validator("expires_at")
    @classmethod
    def _expiry_in_future(cls, v: datetime | None) -> datetime | None:
        if v is None:
            return v
        if v.tzinfo is None:
            v = v.replace(tzinfo=UTC)
        if v <= datetime.now(UTC):
            raise ValueError("must be in the future")
        return v

    @model_validator(mode="after")
    def _job_scope(self) -> TokenCreate:
        if (self.role == Role.JOB) != (self.job_id is not None):
            raise ValueError("job_id is required for the job role, and only for it")
        if self.node_id is not None and self.role != Role.AGENT:
            raise ValueError("node_id: only an agent token is scoped to a node")
        return self


class TokenPublic(BaseModel):
    """A token as listed: never the secret itself (only stored as a hash), only its first characters."""

    id: str
    name: str
    role: Role
    job_id: str | None = None
    node_id: str | None = Field(None, description="The node an agent token is scoped to (none: any node).")
    hint: str = Field(..., description="The token's first characters, to tell tokens apart.")
    created_at: datetime
    created_by: str | None = Field(None, description="Id of the token that issued this one.")
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = Field(None, description="Last accepted use (updated at most once a minute).")
    active: bool = Field(..., description="Neither revoked nor expired.")


class TokenCreated(TokenPublic):
    """The answer to creating a token: the only time its secret is shown."""

    token: str


class TokensPublic(BaseModel):
    data: list[TokenPublic]
    count: int



# --------------------------------------------------------------------------------------------------
# Step and collective series (GET /jobs/{id}/steps, /jobs/{id}/collectives)
# --------------------------------------------------------------------------------------------------


class RankStepsPublic(BaseModel):
    """One rank's step breakdown as parallel arrays (one entry per step, oldest first).

    ``final`` is False for a step whose aggregates are still being formed (samples may still
    arrive); its values are computed from the raw samples received so far.
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


# --------------------------------------------------------------------------------------------------
# Detection, recovery and fault injection (see docs/RECOVERY.md)
# --------------------------------------------------------------------------------------------------


class FaultKind(str, enum.Enum):
    """Faults the fault-injection API can cause. Each is carried out for real (see docs/RECOVERY.md)."""

    KILL_RANK = "kill_rank"  # the node's agent sends SIGKILL to the rank's process
    KILL_NODE = "kill_node"  # the node's agent kills the node's raylet (and its workers) and stops heartbeating
    HANG_RANK = "hang_rank"  # the node's agent sends SIGSTOP to the rank's process
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


SLOW_MODES = ("throttle", "compute")
"""slow_rank's ways to slow a rank: ``throttle``, a SIGSTOP/SIGCONT duty cycle of its process by the
agent (from outside, like a host CPU starved by something else: a busy host dilutes it); ``compute``,
the rank's own compute phase made ``factor`` times longer (a slow accelerator: exact whatever the load)."""


class FaultCreate(_Strict):
    """``POST /jobs/{id}/faults``: cause ``kind`` on a rank or node once the job reaches ``step``."""

    kind: FaultKind
    rank: int | None = Field(None, ge=0, le=1_000_000, description="Target rank (rank faults).")
    node_id: Line | None = Field(None, min_length=1, max_length=NAME_MAX, description="Target node (node faults).")
    step: int = Field(0, ge=0, le=INT32_MAX, description="Fire once the job has reached this step (0: at once).")
    params: Params = Field(
        default_factory=dict, max_length=64,
        description="Kind-specific: slow_rank factor (default 3) and mode (throttle | compute), durations in seconds, ...",
    )

    @model_validator(mode="after")
    def _target(self) -> FaultCreate:
        needs_rank = {FaultKind.KILL_RANK, FaultKind.HANG_RANK, FaultKind.SLOW_RANK, FaultKind.NAN_LOSS}
        if self.kind in needs_rank and self.rank is None:
            raise ValueError(f"rank: required for {self.kind.value}")
        if self.kind == FaultKind.KILL_NODE and self.rank is None and self.node_id is None:
            raise ValueError("node_id: required for kill_node (or give a rank: its node is killed)")
        if len(self.params) > 16:
            raise ValueError("params may hold at most 16 entries")
        for k, v in self.params.items():
            if len(k) > 64 or (isinstance(v, str) and len(v) > 256):
                raise ValueError("params: keys at most 64 characters, string values at most 256")
        if self.kind == FaultKind.SLOW_RANK:
            factor = self.params.get("factor", 3.0)
            if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1.0 < factor <= 100.0:
                raise ValueError("params.factor: slow_rank's factor must be a number above 1 and at most 100")
            if self.params.get("mode", "throttle") not in SLOW_MODES:
                raise ValueError(f"params.mode: slow_rank's mode must be one of {', '.join(SLOW_MODES)}")
        return self


class FaultPublic(BaseModel):
    id: int
    job_id: str
    kind: FaultKind
    rank: int | None
    node_id: str | None
    step: int
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
    WRITE_FAULT_FILE = "write_fault_file"  # args: job_id, rank, fault (dict)
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


class StackGroup(BaseModel):
    """Ranks whose stacks share one signature (the innermost frames)."""

    signature: str
    ranks: list[int]
    sample: str


class StacksPublic(BaseModel):
    job_id: str
    collected_at: datetime | None
    groups: list[StackGroup]
    odd_ranks: list[int] = Field(description="Ranks whose stack differs from the majority: the likely culprits.")
    stacks: dict[int, str]


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
