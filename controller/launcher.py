"""The Ray adapter: every call the controller makes into Ray lives here.

Jobs are Ray jobs submitted through Ray Job Submission, so they outlive a controller restart.
The controller never imports the trainer: it launches it by entrypoint (``python -m vigil``).
Token authentication (Ray 2.60's default for clusters Vigil starts) is handled by Ray's own client
from ``RAY_AUTH_MODE=token`` and the token file (``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN_PATH``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from controller.packages import package_path
from vigil.contract.schemas import JobCreate, JobStatus
from vigil.contract.settings import ENV_JOB_ID, ENV_JOB_SPEC

log = logging.getLogger(__name__)

TRAINER_ENTRYPOINT = "-m vigil"


@dataclass(frozen=True)
class LaunchStatus:
    """Where a launched job stands, in Vigil's terms."""

    status: JobStatus
    message: str | None = None


class LaunchError(RuntimeError):
    """The job could not be submitted to (or queried from) the cluster."""


class JobLauncher(Protocol):
    """Seam between the controller and the engine that runs jobs (Ray here; a fake in unit tests)."""

    def submit(self, job_id: str, spec: JobCreate, env: dict[str, str]) -> str: ...

    def status(self, launch_id: str) -> LaunchStatus: ...

    def stop(self, launch_id: str) -> None: ...

    def logs(self, launch_id: str) -> str: ...


_RAY_TO_VIGIL = {
    "PENDING": JobStatus.PENDING,
    "RUNNING": JobStatus.RUNNING,
    "SUCCEEDED": JobStatus.SUCCEEDED,
    "FAILED": JobStatus.FAILED,
    "STOPPED": JobStatus.CANCELLED,
}


def ray_client_env() -> None:
    """Make Ray's clients in this process use token auth when a token exists and nothing says otherwise."""
    if "RAY_AUTH_MODE" not in os.environ:
        token_path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
        if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_path):
            os.environ["RAY_AUTH_MODE"] = "token"


RANK_ACTOR_CLASSES = ("RayTrainWorker", "ReplicaActor")
"""The Ray actors that are a job's ranks: Ray Train's workers, and live recovery's replicas (vigil/live_replicas.py)."""


class RayJobLauncher:
    """Submits the trainer as a Ray job through the cluster's Job Submission API."""

    def __init__(self, address: str, python: str | None = None, packages_dir: Path | None = None) -> None:
        ray_client_env()
        from ray.job_submission import JobSubmissionClient

        self.address = address
        self.python = python or sys.executable
        self.packages_dir = packages_dir
        self._client = JobSubmissionClient(address)

    def runtime_env(self, job_id: str, spec: JobCreate, env: dict[str, str]) -> dict[str, Any]:
        """Ray's runtime environment for the job: its variables, its code package (Ray uploads the
        local zip to the cluster and unpacks it as the working directory of the driver and of every
        rank), its pip requirements (installed by Ray on each node)."""
        env_vars = {
            ENV_JOB_ID: job_id,
            ENV_JOB_SPEC: json.dumps(spec.model_dump(mode="json")),
            "RAY_TRAIN_V2_ENABLED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            # Ray Train moves each rank into a per-run folder by default; the job's code package is the
            # working directory of the ranks instead (a script entry point and the user's relative
            # paths resolve there, as in the driver).
            "RAY_CHDIR_TO_TRIAL_DIR": "0",
            **env,
        }
        runtime_env: dict[str, Any] = {"env_vars": env_vars}
        if spec.working_dir is not None:
            if self.packages_dir is None:
                raise LaunchError("the job has a working_dir but this controller has no packages folder")
            path = package_path(self.packages_dir, spec.working_dir)
            if not path.is_file():
                raise LaunchError(f"code package {spec.working_dir} is not stored at {path}")
            runtime_env["working_dir"] = str(path)
        if spec.pip:
            runtime_env["pip"] = list(spec.pip)
        return runtime_env

    def submit(self, job_id: str, spec: JobCreate, env: dict[str, str]) -> str:
        runtime_env = self.runtime_env(job_id, spec, env)
        try:
            return self._client.submit_job(
                entrypoint=f"{self.python} {TRAINER_ENTRYPOINT}",
                submission_id=f"vigil-{job_id}",
                runtime_env=runtime_env,
                metadata={"vigil_job_id": job_id, "name": spec.name[:100]},
                entrypoint_num_cpus=0,
            )
        except Exception as exc:  # Ray raises RuntimeError/ConnectionError variants
            raise LaunchError(f"could not submit to Ray at {self.address}: {exc}") from exc

    def status(self, launch_id: str) -> LaunchStatus:
        try:
            info = self._client.get_job_info(launch_id)
        except Exception as exc:
            raise LaunchError(f"could not read status of {launch_id}: {exc}") from exc
        status = _RAY_TO_VIGIL.get(str(info.status.value if hasattr(info.status, "value") else info.status))
        if status is None:
            raise LaunchError(f"unknown Ray job status {info.status!r}")
        return LaunchStatus(status, info.message)

    def stop(self, launch_id: str) -> None:
        try:
            self._client.stop_job(launch_id)
        except Exception as exc:
            raise LaunchError(f"could not stop {launch_id}: {exc}") from exc

    def logs(self, launch_id: str) -> str:
        try:
            return self._client.get_job_logs(launch_id)
        except Exception as exc:
            raise LaunchError(f"could not read logs of {launch_id}: {exc}") from exc

    def placement(self, launch_id: str) -> set[str]:
        """Ray node ids where the job's ranks (its actors of :data:`RANK_ACTOR_CLASSES`) run or ran: dead actors
        too, since a node that ran a rank may still send its spooled samples. Not the driver's node nor Ray
        Train's controller's (the head, shared by every job's driver: a driver sends no samples)."""
        from ray.util.state import list_actors

        try:
            info = self._client.get_job_info(launch_id)
            if not info.job_id:
                return set()
            actors = list_actors(address=self.address, filters=[("job_id", "=", info.job_id)], limit=10_000,
                                 timeout=10, raise_on_missing_output=False)
        except Exception as exc:
            raise LaunchError(f"could not read where {launch_id} runs: {exc}") from exc
        return {a.node_id for a in actors if a.node_id and str(a.class_name).endswith(RANK_ACTOR_CLASSES)}


@dataclass(frozen=True)
class RayNode:
    node_id: str
    name: str
    state: str  # ALIVE | DEAD
    draining: bool = False
    is_head: bool = False
    """The Ray head: GCS, job drivers and Ray Train controllers live there (never evicted)."""
    cpus: float | None = None
    """The node's CPUs in Ray (None: not known)."""
    raylet: tuple[str, int] | None = None
    """The raylet's address and port (its node manager), where Ray says (None: not known)."""


class ClusterControl(Protocol):
    """Seam for node-level control of the engine (Ray here; a fake in unit tests)."""

    def drain_node(self, node_name: str, deadline_s: float, reason: str) -> bool: ...

    def nodes(self) -> list[RayNode]: ...


class RayClusterControl:
    """Eviction through Ray's own node draining (what Ray's autoscaler uses for preemption).

    ``GcsClient.drain_node`` is semi-internal (the hidden ``ray drain-node`` command calls it); it is
    kept here, in the one adapter module. A drained node takes no new work; at the deadline Ray
    Train's ranks there get a PreemptionError and the worker group restarts on the other nodes.
    Ray never un-drains a node: readmitting it means starting a fresh raylet (the agent does that).
    """

    def __init__(self, gcs_address: str) -> None:
        ray_client_env()
        from ray._raylet import GcsClient

        self.gcs_address = gcs_address
        self._gcs = GcsClient(address=gcs_address)

    def nodes(self) -> list[RayNode]:
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        try:
            infos = self._gcs.get_all_node_info(timeout=10)
        except Exception as exc:
            raise LaunchError(f"could not list Ray nodes at {self.gcs_address}: {exc}") from exc
        return [
            RayNode(node_id.hex(), info.node_name, "ALIVE" if info.state == GcsNodeInfo.ALIVE else "DEAD",
                    is_head=bool(info.is_head_node), cpus=float(info.resources_total.get("CPU", 0.0)),
                    raylet=(info.node_manager_address, int(info.node_manager_port))
                    if info.node_manager_address and info.node_manager_port else None)
            for node_id, info in infos.items()
        ]

    def drain_node(self, node_name: str, deadline_s: float, reason: str) -> bool:
        import time

        from ray.core.generated import autoscaler_pb2

        target = [n for n in self.nodes() if n.name == node_name and n.state == "ALIVE"]
        if not target:
            raise LaunchError(f"no live Ray node named {node_name!r}")
        deadline_ms = int(time.time() * 1000 + deadline_s * 1000)
        accepted = True
        for node in target:
            try:
                ok, why = self._gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value(
                    "DRAIN_NODE_REASON_PREEMPTION"), reason[:500], deadline_ms)
            except Exception as exc:
                raise LaunchError(f"drain of {node_name} failed: {exc}") from exc
            if not ok:
                log.warning("drain of %s refused: %s", node_name, why)
                accepted = False
        return accepted
