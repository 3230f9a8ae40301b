"""Test doubles for the controller's seams (unit tests only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.launcher import LaunchError, LaunchStatus
from vigil.contract.schemas import JobCreate, JobStatus


@dataclass
class FakeLauncher:
    """Records submissions; tests set each launched job's status by hand."""

    statuses: dict[str, LaunchStatus] = field(default_factory=dict)
    submitted: list[tuple[str, JobCreate, dict[str, str]]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    fail_submit: bool = False
    log_text: dict[str, str] = field(default_factory=dict)
    """A launched job's driver log (default: one line naming it)."""

    def submit(self, job_id: str, spec: JobCreate, env: dict[str, str]) -> str:
        if self.fail_submit:
            raise LaunchError("cluster unreachable")
        launch_id = f"fake-{job_id}"
        self.submitted.append((job_id, spec, env))
        self.statuses[launch_id] = LaunchStatus(JobStatus.PENDING)
        return launch_id

    def status(self, launch_id: str) -> LaunchStatus:
        return self.statuses[launch_id]

    def stop(self, launch_id: str) -> None:
        self.stopped.append(launch_id)
        self.statuses[launch_id] = LaunchStatus(JobStatus.CANCELLED)

    def logs(self, launch_id: str) -> str:
        return self.log_text.get(launch_id, f"logs of {launch_id}\n")
