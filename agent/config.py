"""What one agent is told (:class:`AgentConfig`): its node, its controllers, its token, its folders and
intervals, validated on construction (bad values raise ``ValidationError`` naming the field)."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vigil.contract.schemas import MAX_TELEMETRY_ITEMS, NAME_MAX
from vigil.contract.settings import (
    DEFAULT_STORAGE_PATH,
    ENV_AGENT_TOKEN,
    ENV_STORAGE_PATH,
    ENV_TOKEN,
    agent_socket_path,
    get_settings,
    storage_path_from_env,
)

log = logging.getLogger(__name__)

_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
TOKEN_ENV = ENV_AGENT_TOKEN
"""Checked first: an agent-specific token wins over a general ``VIGIL_TOKEN`` in the same environment."""
TOKEN_ENVS = (TOKEN_ENV, ENV_TOKEN)


class AgentConfig(BaseModel):
    """Everything one agent needs; validated on construction (bad values raise ``ValidationError``).

    Paths left unset are derived from ``run_dir`` (default: ``VIGIL_RUN_DIR`` / settings).
    """

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(
        ..., min_length=1, max_length=NAME_MAX, description="Node this agent watches (Ray node id)."
    )
    agent_id: str = Field(
        "", max_length=NAME_MAX, description='Batch numbering identity; default f"{hostname}-{node_id}".'
    )
    hostname: str = Field(default_factory=socket.gethostname, description="Reported in heartbeats.")
    address: str = Field(
        "",
        max_length=NAME_MAX,
        description="Reported in heartbeats; default: local address of the route to the controller.",
    )
    controller_url: str = Field(
        "",
        description="Base URL of the controller: the first of controller_urls (given alone, or as a "
        "comma-separated list, it sets them).",
    )
    controller_urls: list[str] = Field(
        default_factory=list,
        min_length=1,
        description="Every controller this agent may talk to, in order of preference (controllers sharing one "
        "PostgreSQL database); it moves on to the next when one does not answer. Default: "
        "VIGIL_CONTROLLER_URL, a comma-separated list.",
    )
    token: str = Field(
        ..., min_length=1, repr=False, description="Bearer token with the agent role (required)."
    )
    run_dir: Path = Field(
        default_factory=lambda: get_settings().run_dir, description="Node-local runtime folder."
    )
    socket_path: Path | None = Field(
        None, description="Rank datagram socket; default agent_socket_path(run_dir, node_id)."
    )
    socket_group: int | None = Field(
        None, ge=0, description="Group id of the rank socket file (mode 0660): the ranks' own group when they "
        "run as another user than the agent (vigil up as root: controller/rankuser.py).")
    spool_dir: Path | None = Field(None, description="Disk spool; default <run_dir>/spool/<node_id>.")
    spool_max_bytes: int = Field(
        256 << 20, ge=4096, description="Bound of the spool; oldest batches dropped beyond."
    )
    flush_interval_s: float = Field(
        0.5, gt=0, le=60, description="Longest a sample waits before its batch leaves."
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, le=3600, description="Heartbeat period (also metric sampling)."
    )
    max_batch_items: int = Field(2000, ge=1, le=MAX_TELEMETRY_ITEMS, description="Most samples per batch.")
    max_buffered_samples: int = Field(
        200_000,
        ge=1,
        description="Samples held in memory between socket and shipper; beyond: dropped, counted.",
    )
    http_timeout_s: float = Field(5.0, gt=0, le=300, description="Timeout of one post to the controller.")
    backoff_initial_s: float = Field(0.2, gt=0, description="First retry wait after a failed post.")
    backoff_max_s: float = Field(10.0, gt=0, description="Longest retry wait.")
    disk_paths: list[Path] = Field(
        default_factory=lambda: [Path("/")], description="Filesystems whose usage is reported."
    )
    commands: bool = Field(
        True, description="Poll the controller for commands (kill, stop, py-spy, ...) and carry them out."
    )
    command_wait_s: float = Field(
        2.0, ge=0, le=30, description="A long poll for commands: the controller answers as soon as one is "
        "queued for this node, or after this long (0: a plain poll every heartbeat interval)."
    )
    storage_root: Path = Field(
        default_factory=storage_path_from_env,
        description=f"corrupt_files only touches files under this folder (default ${ENV_STORAGE_PATH} or "
        f"{DEFAULT_STORAGE_PATH}); resolved once here.",
    )
    raylet_pid: int | None = Field(
        None, ge=2, description="This node's raylet, when it cannot be found by its --node-name / --node_id."
    )
    ray_gcs_address: str | None = Field(
        None, min_length=3, pattern=r"^\S+:[0-9]{1,5}$",
        description="This node's Ray cluster (GCS host:port): only a raylet whose --gcs-address is this one is "
        "this node's (two clusters on one host may name their nodes alike). None: any raylet naming the node.",
    )
    ray_start_pid: int | None = Field(
        None, ge=2, description="The `ray start --block` process of this node (killed with its session)."
    )
    ray_join_cmd: list[str] | None = Field(
        None,
        min_length=1,
        description="argv (no shell) that starts this node's raylet again (start_raylet, readmission).",
    )
    pyspy_timeout_s: float = Field(10.0, gt=0, le=300, description="Longest one py-spy dump may take.")
    raylet_stop_grace_s: float = Field(
        5.0, ge=0, le=300, description="stop_raylet: seconds between SIGTERM and SIGKILL."
    )
    raylet_start_wait_s: float = Field(
        60.0, gt=0, le=3600, description="start_raylet: how long to wait for the raylet to appear."
    )

    @field_validator("node_id")
    @classmethod
    def _node_id_is_a_file_name(cls, v: str) -> str:
        # It names the socket and the spool folder.
        if not _SAFE_ID.match(v):
            raise ValueError(
                "node_id may only hold letters, digits, '.', '_' and '-' (not starting with them)"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _controllers(cls, data: Any) -> Any:
        """Both URL fields from whichever was given (or the settings): a comma-separated controller_url
        (``--controller A,B``, ``VIGIL_CONTROLLER_URL=A,B``) is the list, and the first of the list is
        controller_url."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        one, urls = data.get("controller_url"), data.get("controller_urls")
        if urls is None:
            urls = one if one else get_settings().controller_url
        if isinstance(urls, str):
            urls = split_urls(urls)
        data["controller_urls"] = urls
        if (not one or (isinstance(one, str) and "," in one)) and isinstance(urls, list) and urls:
            data["controller_url"] = urls[0]
        return data

    @field_validator("controller_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return _check_url("controller_url", v)

    @field_validator("controller_urls")
    @classmethod
    def _http_urls(cls, v: list[str]) -> list[str]:
        for url in v:
            _check_url("controller_urls", url)
        return list(dict.fromkeys(v))  # each once, first place kept

    @field_validator("storage_root")
    @classmethod
    def _resolved(cls, v: Path) -> Path:
        return Path(v).expanduser().resolve()

    @field_validator("ray_join_cmd")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v[0] or any("\x00" in a for a in v)):
            raise ValueError("ray_join_cmd: argv[0] must name a program and no argument may hold NUL")
        return v

    @model_validator(mode="after")
    def _derive_defaults(self) -> AgentConfig:
        if self.controller_url != self.controller_urls[0]:
            raise ValueError(f"controller_url must be the first of controller_urls ({self.controller_urls[0]!r}), "
                             f"got {self.controller_url!r}")
        if not self.agent_id:
            # The whole node id: ingest is idempotent on (agent_id, seq), so two agents must never share
            # an id (node names such as vigil-node-1 / vigil-node-2 share their first 8 characters).
            self.agent_id = f"{self.hostname}-{self.node_id}"[-NAME_MAX:]
        if self.socket_path is None:
            self.socket_path = agent_socket_path(self.run_dir, self.node_id)
        if self.spool_dir is None:
            self.spool_dir = Path(self.run_dir) / "spool" / self.node_id
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("backoff_initial_s must be <= backoff_max_s")
        return self


def split_urls(text: str) -> list[str]:
    """``"http://a:8000, http://b:8000"`` -> the URLs, blanks dropped."""
    return [u.strip() for u in text.split(",") if u.strip()]


def _check_url(field: str, url: str) -> str:
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{field} must hold http(s) URLs, got {url!r}")
    return url
