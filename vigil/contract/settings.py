"""Process settings for every Vigil process (env prefix ``VIGIL_``).

One settings object per process, obtained through :func:`get_settings`; never built at import
time, so tests can set the environment first and call ``get_settings.cache_clear()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vigil.contract.checkpoint_layout import as_location, is_uri
from vigil.contract.schemas import slugify


class Settings(BaseSettings):
    """Settings shared by the controller, the CLI and the agents."""

    model_config = SettingsConfigDict(env_prefix="VIGIL_", extra="ignore")

    home: Path = Field(Path(".vigil"), description="Working folder for the database, logs and runtime files.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite:///<home>/vigil.db. postgresql+psycopg://... for PostgreSQL."
    )
    host: str = Field("127.0.0.1", description="Address the controller binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the controller binds.")
    controller_url: str = Field(
        "http://127.0.0.1:8000",
        description="Where clients and agents reach the controller. Agents also take a comma-separated list "
        "(controllers sharing one PostgreSQL database; they fail over between them); other clients one URL.",
    )
    ray_address: str | None = Field(
        None, description="Ray dashboard address for job submission, e.g. http://127.0.0.1:8265; None: jobs are not launched."
    )
    ray_gcs_address: str | None = Field(
        None, description="Ray GCS address (host:port) for node draining (eviction); None: no eviction through Ray."
    )
    deploy_agents: bool = Field(
        False, description="Start one agent per alive Ray node through Ray itself (a detached actor pinned to each "
        "node, controller/fleet.py), and on every node that joins later; needs ray_gcs_address.")
    agent_controller_url: str | None = Field(
        None, description="The controller URL(s) the Ray-deployed agents use (comma-separated; default controller_url).")
    launch_retry_s: float = Field(
        300.0, ge=0, description="How long a PENDING job keeps retrying a launch Ray refuses (its agent may be starting)."
    )
    monitor_interval_s: float = Field(0.5, gt=0, description="How often the detectors and recovery run.")
    monitor_reconnect_grace_s: float = Field(
        11.0, ge=0, le=600,
        description="After the controller (re)starts or takes the lead, silence gets this much longer than the node "
        "timeout before a node is lost or a job hung: an agent that found the controller down retries only after "
        "its backoff (at most 10 s by default).")
    run_dir: Path = Field(default_factory=lambda: default_run_dir(), description=(
        "Node-local folder for agent sockets and fault files: /run/vigil for root, $XDG_RUNTIME_DIR/vigil or "
        "/tmp/vigil-<uid> otherwise (never one fixed /tmp path another user could create first)."))
    supervisor_interval_s: float = Field(1.0, gt=0, description="How often the controller polls Ray for job status.")
    leader_interval_s: float = Field(
        1.0, gt=0, le=60,
        description="How often a standby controller tries the leader lock, and the leader checks it still holds it "
        "(PostgreSQL; controller/leader.py): a standby takes over within about this long of the leader's death.",
    )
    controller_id: str | None = Field(
        None, min_length=1, max_length=128,
        description="Names this controller in leadership events and logs; default host:pid.",
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="Largest request body the API accepts.")
    auth_enabled: bool = Field(
        True, description="Every route but /healthz needs a bearer token; false only on a machine you trust alone."
    )
    user_node_actions: bool = Field(
        False, description="Let `user` tokens evict and readmit nodes (which moves every job's ranks off a node); "
        "off: only an admin does.")
    metrics_open: bool = Field(
        False, description="Serve /metrics without a token (for a Prometheus that scrapes over loopback)."
    )
    dashboard_open_reads: bool = Field(
        True, description="The mounted dashboard reads the API with a viewer token of its own, so whoever reaches "
        "the port may look. `vigil controller` turns it off when it binds an address other hosts can reach: a "
        "browser then signs in (any reading token) before it sees anything.")
    dashboard_token: str | None = Field(
        None, repr=False, description="Token of the mounted dashboard; default: a viewer token minted per process."
    )
    token: str | None = Field(
        None, repr=False, description="Bearer token the CLI sends (VIGIL_TOKEN); default: the one in <home>/admin-token."
    )
    raw_retention_s: float = Field(
        3600.0, gt=0, description="Seconds raw step and collective samples are kept (aggregates are kept for good)."
    )
    aggregate_settle_s: float = Field(
        2.0, ge=0, description="A step is aggregated once no new sample of it arrived for this long."
    )
    telemetry_interval_s: float = Field(1.0, gt=0, description="Period of the telemetry aggregation pass.")
    aggregation_process: bool | None = Field(
        None, description="Run the aggregation passes in a process of their own, off the ingest's GIL (default: "
        "yes, unless the database is in-memory SQLite). controller/aggregation_process.py says why."
    )
    raw_prune_interval_s: float = Field(30.0, gt=0, description="Period of the pruning of raw samples.")
    host_history_interval_s: float = Field(
        5.0, ge=0, le=3600, description="Shortest time between two stored host samples of a node (node history)."
    )
    host_history_max_rows: int = Field(
        2000, ge=10, le=1_000_000, description="Host samples kept per node, the newest (GET /nodes/{id}/history)."
    )
    metrics_max_jobs: int = Field(20, ge=1, le=1000, description="Active jobs exported on /metrics (newest first).")
    metrics_max_ranks: int = Field(
        32, ge=1, le=4096, description="Ranks exported per job on /metrics: the slowest ones of the latest step."
    )

    storage_path: Path | str | None = Field(
        None, description="Checkpoint storage of the jobs this controller starts: a folder every node sees, or a "
        "URI of an object store (s3://bucket/prefix, S3-compatible: docs/DEPLOY.md); default <home>/storage."
    )
    packages_dir: Path | None = Field(
        None, description="Where uploaded code packages are stored (content-addressed zips); default <home>/packages."
    )
    max_package_bytes: int = Field(32 * 1024 * 1024, gt=0, description="Largest code package (zip) accepted.")
    max_package_unzipped_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="Most bytes a code package may unpack to (zip bombs are refused)."
    )
    max_package_files: int = Field(10_000, gt=0, description="Most entries a code package may hold.")
    package_quota_bytes: int = Field(
        1 << 30, gt=0, description="Most bytes of code packages one user's token may keep stored (an admin: no "
        "limit); packages no recent job uses are removed first (package_keep_s).")
    package_keep_s: float = Field(
        86_400.0, ge=0, description="A code package no unfinished job uses is removed once this long has passed "
        "since its upload and since the last job using it was created or ended.")

    @field_validator("storage_path", mode="before")
    @classmethod
    def _storage_location(cls, value: object) -> object:
        """A URI stays a (normalised) string, anything else is a folder (``Path`` would fold ``s3://``)."""
        if isinstance(value, str):
            return as_location(value) if value else None
        return value

    def resolved_storage(self) -> Path | str:
        """Where the jobs this controller starts keep their checkpoints (handed to them as
        ``VIGIL_STORAGE_PATH``): :attr:`storage_path` (a URI as it is, a folder resolved), else
        ``<home>/storage``."""
        if is_uri(self.storage_path):
            return str(self.storage_path)
        return self.resolved_storage_path()

    def resolved_storage_path(self) -> Path:
        """The local folder of the jobs' checkpoints: :attr:`storage_path`, else ``<home>/storage``. A URI
        storage has none: ``ValueError`` (:meth:`resolved_storage` names either)."""
        if is_uri(self.storage_path):
            raise ValueError(f"the checkpoint storage is {self.storage_path}, not a local folder")
        return (Path(self.storage_path) if self.storage_path else self.home / "storage").resolve()

    def resolved_packages_dir(self) -> Path:
        """Where code packages live: :attr:`packages_dir`, else ``<home>/packages``."""
        return (self.packages_dir or self.home / "packages").resolve()

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite under :attr:`home`."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'vigil.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings()


def admin_token_path(home: Path) -> Path:
    """Where ``vigil up`` keeps the first admin token (mode 0600), and where the CLI looks for it."""
    return Path(home) / "admin-token"


# The environment variables that cross process boundaries (the controller sets them for a job's driver
# and ranks, `vigil up` for the agents and the dashboard). Settings fields read their own VIGIL_<FIELD>.
ENV_HOME = "VIGIL_HOME"
ENV_RUN_DIR = "VIGIL_RUN_DIR"
ENV_CONTROLLER_URL = "VIGIL_CONTROLLER_URL"
ENV_TOKEN = "VIGIL_TOKEN"
"""A bearer token: the CLI's, or a job driver's own (role job)."""
ENV_AGENT_TOKEN = "VIGIL_AGENT_TOKEN"
"""An agent's token; wins over ``VIGIL_TOKEN`` in the agent's environment."""
ENV_DASHBOARD_TOKEN = "VIGIL_DASHBOARD_TOKEN"
SECRET_ENVS = (ENV_AGENT_TOKEN, ENV_TOKEN, ENV_DASHBOARD_TOKEN)
"""Never passed on to processes that do not need them (a raylet the agent restarts, a shell's children)."""
CHILD_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "SHELL", "VIRTUAL_ENV",
    "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "VIGIL_CACHE_DIR", "VIGIL_TELEMETRY",
})
CHILD_ENV_PREFIXES = ("LC_", "RAY_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "NVIDIA_", "HF_", "XDG_", "AWS_")
"""What a process that runs users' code (a raylet: its workers are the ranks) inherits of Vigil's environment:
these names and prefixes only, never a copy (``VIGIL_HOME``, ``VIGIL_DATABASE_URL``, any token stay out).
``RAY_*`` is Ray's own (a Ray token in it is Ray's worker credential: docs/SECURITY.md); ``AWS_*`` is the
object store's (the ranks write their checkpoints there: docs/SECURITY.md, docs/DEPLOY.md)."""


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process that runs users' code, from ``base`` (default: this process's) by the
    allowlist above, plus ``extra``."""
    src = os.environ if base is None else base
    kept = {k: v for k, v in src.items() if k in CHILD_ENV_NAMES or k.startswith(CHILD_ENV_PREFIXES)}
    return {**kept, **extra}


ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
"""torch's Flight Recorder size (entries per process); must be set before the first process group."""
FR_BUFFER_DEFAULT = 500
"""What Vigil sets for its ranks unless the environment has it: a dump of a full buffer costs ~5 ms.
(Here, not in :mod:`vigil.capture`, which imports torch: the job's driver sets it for the ranks.)"""
ENV_JOB_ID = "VIGIL_JOB_ID"
ENV_JOB_SPEC = "VIGIL_JOB_SPEC"
"""The job spec as JSON (``JobCreate``), for its driver."""
ENV_CHECKPOINT_ROOT = "VIGIL_CHECKPOINT_ROOT"
"""A standalone rank's checkpoint root (outside a Vigil job)."""
ENV_STORAGE_PATH = "VIGIL_STORAGE_PATH"
"""Where checkpoints live: a folder every node sees, or a URI of an object store (``s3://bucket/prefix``;
the endpoint and credentials from the standard ``AWS_*`` variables). The controller sets it for the job's
driver and ranks, and ``vigil up`` for the agents."""
DEFAULT_STORAGE_PATH = "~/.vigil-storage"


def storage_path_from_env(env: Mapping[str, str] | None = None) -> Path:
    """The local checkpoint folder of a process the controller did not configure in full (an agent):
    ``$VIGIL_STORAGE_PATH``, else :data:`DEFAULT_STORAGE_PATH`. Where the storage may be a URI (the job's
    driver and ranks): :func:`storage_from_env`."""
    env = os.environ if env is None else env
    return Path(env.get(ENV_STORAGE_PATH) or DEFAULT_STORAGE_PATH).expanduser()


def storage_from_env(env: Mapping[str, str] | None = None) -> Path | str:
    """The checkpoint storage of the job's driver and ranks: ``$VIGIL_STORAGE_PATH``, a URI of an object
    store (``s3://bucket/prefix``, normalised: :func:`vigil.contract.checkpoint_layout.normalise_uri`) or a
    folder (resolved), else :data:`DEFAULT_STORAGE_PATH`."""
    env = os.environ if env is None else env
    location = as_location(env.get(ENV_STORAGE_PATH) or DEFAULT_STORAGE_PATH)
    return location if is_uri(location) else Path(location).expanduser().resolve()


def default_run_dir() -> Path:
    """Where a node's agent socket and fault files live unless configured (see ``Settings.run_dir``)."""
    if os.geteuid() == 0:
        return Path("/run/vigil")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "vigil" if runtime else Path(f"/tmp/vigil-{os.geteuid()}")


def agent_socket_path(run_dir: Path, node_id: str) -> Path:
    """Path of the unix datagram socket where the agent of ``node_id`` listens for rank samples."""
    return Path(run_dir) / "agents" / f"{node_id}.sock"


FAULT_FIRED_SUFFIX = ".fired"
"""A fault file the rank has acted on is renamed with this suffix (before acting: one shot)."""


def adapt_file_path(run_dir: Path | str, job_id: str, rank: int) -> Path:
    """The adapt file of ``rank`` of ``job_id`` on its node (``recovery.policy: adapt``), beside its fault file:
    written by the agent (``write_fault_file`` with ``file: adapt``), read by the rank once per step. It holds
    every setting the controller has asked for, oldest first: ``{"versions": [{"version": 1, "params": {"tau":
    48}}, {"version": 2, "params": {}}]}`` (``params``: overrides of the spec's ``optimizer.params``; ``{}``: the
    spec's own). The ranks take the newest version all of them have read, together, at a checkpoint boundary."""
    return Path(run_dir) / "faults" / slugify(job_id) / f"rank-{int(rank)}.adapt.json"


def fault_file_path(run_dir: Path | str, job_id: str, rank: int) -> Path:
    """The one-shot fault file of ``rank`` of ``job_id`` on its node: written by the agent
    (``write_fault_file``), read by the rank once per step (docs/RECOVERY.md)."""
    return Path(run_dir) / "faults" / slugify(job_id) / f"rank-{int(rank)}.json"
