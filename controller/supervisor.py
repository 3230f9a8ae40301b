"""The job supervisor: launches PENDING jobs and follows their status in the engine.

``step()`` does one pass over the active jobs, so tests drive it one iteration at a time; the
controller runs it in a background thread every ``interval`` seconds (and at once when woken).
"""

from __future__ import annotations

import logging
import re
import time

from sqlalchemy.orm import Session, sessionmaker

from controller.db import session_scope
from controller.jobs import active_jobs, record_event, transition
from controller.launcher import JobLauncher, LaunchError
from controller.models import Job
from controller.recovery.incidents import close_for_ended_jobs
from controller.tokens import create_token, revoke_job_tokens
from vigil.contract.background import BackgroundLoop
from vigil.contract.schemas import STORED, JobCreate, JobStatus, Role, TokenCreate
from vigil.contract.settings import ENV_TOKEN

log = logging.getLogger(__name__)

FINAL_LINE_SEARCH_CHARS = 65_536
"""The end of a finished driver's log searched for its final step."""


class Supervisor(BackgroundLoop):
    def __init__(
        self, sessions: sessionmaker[Session], launcher: JobLauncher | None, job_env: dict[str, str],
        interval: float = 1.0,
        launch_retry_s: float = 60.0,
    ) -> None:
        self.sessions = sessions
        self.launcher = launcher
        self.job_env = job_env
        self.interval = interval
        self.launch_retry_s = launch_retry_s
        self._launch_failures: dict[str, float] = {}
        super().__init__()

    # -- one iteration --------------------------------------------------------------------------
    def step(self) -> None:
        if self.launcher is None:
            return
        with session_scope(self.sessions) as session:
            for job in active_jobs(session):
                try:
                    self._advance(session, job)
                except LaunchError as exc:
                    log.warning("job %s: %s", job.id, exc)

    def _advance(self, session: Session, job: Job) -> None:
        assert self.launcher is not None
        if job.ray_job_id is None:
            spec = JobCreate.model_validate(job.spec, context={STORED: True})
            # The driver's own token: it may read its job (and, later, post its job's records) and
            # nothing else; transition() revokes it when the job ends.
            issued = create_token(session, TokenCreate(role=Role.JOB, job_id=job.id, name=f"driver of {job.id}"))
            try:
                job.ray_job_id = self.launcher.submit(job.id, spec, {**self.job_env, ENV_TOKEN: issued.token})
            except LaunchError as exc:
                revoke_job_tokens(session, job.id)
                # Ray's job API refuses for a while after a cluster starts ("No available agent to
                # submit job, please try again later"): retry until launch_retry_s has passed.
                first = self._launch_failures.setdefault(job.id, time.monotonic())
                if time.monotonic() - first < self.launch_retry_s:
                    log.info("job %s: launch failed, retrying: %s", job.id, exc)
                    return
                transition(session, job, JobStatus.FAILED, f"launch failed: {exc}")
                return
            self._launch_failures.pop(job.id, None)
            record_event(session, "job_launched", f"submitted to Ray as {job.ray_job_id}", job_id=job.id)
            return
        st = self.launcher.status(job.ray_job_id)
        current = JobStatus(job.status)
        if st.status == current:
            return
        if current == JobStatus.PENDING and st.status.is_terminal() and st.status != JobStatus.CANCELLED:
            # A job can finish between two polls: pass through RUNNING so the life cycle stays legal.
            transition(session, job, JobStatus.RUNNING)
        transition(session, job, st.status, st.message if st.status == JobStatus.FAILED else None)
        if st.status == JobStatus.SUCCEEDED:
            self._final_step(session, job)
        if st.status.is_terminal():
            # Its incidents settle with it (one transaction): a reader never sees an ended job whose
            # recovery still says ACTING until the monitor's next pass (seen in CI).
            close_for_ended_jobs(session)

    def _final_step(self, session: Session, job: Job) -> None:
        """The job's own word on where it ended (its driver's last line, vigil/driver.py): telemetry that
        never reached the controller (an agent that died, samples a rank could not deliver) must not make
        a finished job look short. Only ever raises ``last_step``."""
        assert self.launcher is not None and job.ray_job_id is not None
        try:
            tail = self.launcher.logs(job.ray_job_id)[-FINAL_LINE_SEARCH_CHARS:]
        except LaunchError as exc:
            log.info("job %s: no driver log to read its final step from: %s", job.id, exc)
            return
        found = re.findall(rf"vigil trainer: job {re.escape(job.id)} SUCCEEDED step=(\d+)", tail)
        if not found:
            return
        final = int(found[-1])
        steps = int((job.spec or {}).get("steps") or 0)
        if final > steps:  # the log is the job's own (its code can print this line): never past its budget
            log.warning("job %s: its driver log claims step %d of %d; ignored", job.id, final, steps)
            return
        if job.last_step is None or final > job.last_step:
            record_event(session, "final_step", f"the driver reports step {final}; telemetry had reached "
                         f"{job.last_step if job.last_step is not None else 'none'}", job_id=job.id,
                         data={"final_step": final, "telemetry_step": job.last_step})
            job.last_step = final

    # -- background thread (BackgroundLoop: start, stop, wake) ------------------------------------
    thread_name = "vigil-supervisor"

    def tick(self) -> None:
        self.step()
