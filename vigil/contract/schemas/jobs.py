"""Jobs: status and its transitions' terminal states, the job spec (model, data, optimizer, scaling,
schedule, checkpoints, recovery, entry point, code package) and the job's public views."""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vigil.contract.optimizer_params import OPTIMIZER_KINDS, OptimizerParams, parse_optimizer_params
from vigil.contract.schemas.common import (
    HOST_MAX_DEPTH,
    HOST_MAX_ITEMS,
    INT64_MAX,
    NAME_MAX,
    Line,
    _no_control,
    _storable_json,
    _Strict,
)
from vigil.contract.schemas.thresholds import RecoveryThresholds

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

OptimizerKind = Literal[OPTIMIZER_KINDS]  # type: ignore[valid-type]
"""Every optimizer kind: the keys of ``vigil.contract.optimizer_params.PARAMS_BY_KIND`` (one list; the
trainer's registry is checked against it by tests/vigil/optim/test_kinds.py)."""


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
        "and ranges of its class in vigil/contract/optimizer_params.py (unknown names are refused).",
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
        """``params`` parsed into the kind's dataclass (``vigil.contract.optimizer_params.PARAMS_BY_KIND``),
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
    LIVE = "live"  # every rank a torchft replica: survivors train on, a replacement heals from a peer
    ADAPT = "adapt"  # a degraded link answered with stronger compression (recovery.adapt), eviction only if cheaper


LIVE_OPTIMIZERS: frozenset[str] = frozenset({
    "adamw", "local_adamw", "slowmo", "dsm", "cser", "cser_pl", "ef_sgd", "qsparse_local_sgd",
})
"""Optimizer kinds that can run under ``recovery.policy: live``: their cross-replica traffic is all-reduce
(SlowMo and DSM with ``params.sharded: false``). Sharded state (SDP4Bit, compressed Adam) cannot be healed
from one live peer, and the DDP communication hooks (PowerSGD, fp16) need a fixed process group."""
LIVE_NEEDS_UNSHARDED: frozenset[str] = frozenset({"slowmo", "dsm"})


ADAPTABLE: dict[str, frozenset[str]] = {
    "local_adamw": frozenset({"tau"}), "slowmo": frozenset({"tau"}), "dsm": frozenset({"tau"}),
}
"""What ``recovery.policy: adapt`` may change while the job runs, per optimizer kind: the ``optimizer.params``
whose new value every rank can take at the same step without a restart (a longer local period: fewer,
equally large synchronisations)."""


class AdaptSpec(_Strict):
    """``recovery.adapt``: the more compressed setting a job switches to while one of its links is degraded."""

    params: dict[str, Any] = Field(
        ..., min_length=1, max_length=8,
        description="optimizer.params overrides taken while a link is degraded (e.g. {tau: 48} for a local-step "
        "method whose spec says 12); the spec's own values come back when the link recovers.")


DEFAULT_QUORUM_EVERY_STEPS = 10  # recovery.quorum_every_steps (docs/BENCHMARKS.md: live recovery's steady state)


class RecoverySpec(_Strict):
    """What the controller does when it detects a fault in this job."""

    policy: RecoveryPolicy = Field(
        RecoveryPolicy.EVICT_RESTART,
        description="observe | evict_restart | rollback | live (survivors train on while a failed rank is replaced "
        "and heals from a live peer; all-reduce optimizers only) | adapt (a degraded link answered by switching "
        "to recovery.adapt's setting at a checkpoint boundary: docs/RECOVERY.md).")
    max_restarts: int = Field(3, ge=0, le=100, description="Restarts without progress before the job FAILS.")
    quorum_every_steps: int = Field(
        DEFAULT_QUORUM_EVERY_STEPS, ge=1, le=1000,
        description="live: a step opens with a quorum every this many steps while every rank is in (every step "
        "while one is missing, so a replacement joins at once; a rank that dies is noticed by its failed collective "
        "either way). 1: every step, as torchft's examples do. Each quorum is a round trip to the lighthouse.")
    spares: int = Field(
        0, ge=0, le=64,
        description="live: replicas kept started and idle (torch and the job's code imported) on nodes with room; a "
        "rank whose process or node is lost continues on one, which heals from a live peer, and a new spare is "
        "started behind it. Each spare holds scaling.cpus_per_worker CPUs while it waits.")
    thresholds: RecoveryThresholds = Field(
        default_factory=RecoveryThresholds, description="The detectors' thresholds for this job (defaults: docs/RECOVERY.md).")
    adapt: AdaptSpec | None = Field(None, description="policy adapt: the setting taken while a link is degraded.")

    @model_validator(mode="after")
    def _spares_are_live(self) -> RecoverySpec:
        if self.spares and self.policy != RecoveryPolicy.LIVE:
            raise ValueError(f"recovery.spares ({self.spares}): only with recovery.policy 'live' (a spare takes over "
                             f"a lost rank while the others train on; {self.policy.value!r} restarts the whole group)")
        return self


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
        "working_dir). Both use the rank API (vigil.sdk). Default: the bundled GPT example.",
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

    @model_validator(mode="after")
    def _live_needs_all_reduce(self) -> JobCreate:
        if self.recovery.policy != RecoveryPolicy.LIVE:
            return self
        kind = self.optimizer.kind
        if kind not in LIVE_OPTIMIZERS:
            raise ValueError(f"recovery.policy: 'live' needs an all-reduce optimizer ({', '.join(sorted(LIVE_OPTIMIZERS))}); "
                             f"optimizer.kind {kind!r} keeps the restart path: use 'evict_restart'")
        if kind in LIVE_NEEDS_UNSHARDED and self.optimizer.params.get("sharded", True) is not False:
            raise ValueError(f"recovery.policy: 'live' needs optimizer.params.sharded: false for {kind!r} "
                             "(a sharded outer state cannot be healed from one live peer)")
        return self


    @model_validator(mode="after")
    def _adapt_fits_optimizer(self, info: ValidationInfo) -> JobCreate:
        adapt, kind = self.recovery.adapt, self.optimizer.kind
        if self.recovery.policy != RecoveryPolicy.ADAPT:
            if adapt is not None:
                raise ValueError("recovery.adapt: only with recovery.policy 'adapt'")
            return self
        if kind not in ADAPTABLE:
            raise ValueError(f"recovery.policy: 'adapt' needs an optimizer whose compression can change while it runs "
                             f"({', '.join(sorted(ADAPTABLE))}); optimizer.kind is {kind!r}")
        if adapt is None:
            raise ValueError(f"recovery.adapt: required with recovery.policy 'adapt' (e.g. params: {{tau: 48}} for {kind!r})")
        for name in adapt.params:
            if name not in ADAPTABLE[kind]:
                raise ValueError(f"recovery.adapt.params.{name}: {kind!r} can change only {sorted(ADAPTABLE[kind])} "
                                 "while it runs")
        if not (info.context or {}).get(STORED):
            try:
                adapted_params(self, adapt.params)
            except ValueError as e:
                raise ValueError(f"recovery.adapt: {e}") from e
        return self


def adapted_params(spec: JobCreate, overrides: Mapping[str, Any]) -> OptimizerParams:
    """The optimizer's typed params with ``overrides`` (``recovery.adapt.params``, or {} for the spec's own)."""
    return parse_optimizer_params(spec.optimizer.kind, {**spec.optimizer.params, **overrides})


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
    created_by: str | None = Field(None, description="Id of the token that submitted the job (its owner).")


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int
