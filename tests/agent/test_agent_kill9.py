"""A node agent killed with SIGKILL mid-job loses no sample: the ranks' real telemetry keeps what the
agent could not take and sends its replay window again to the restarted agent; the controller stores
each sample once.

Real processes: ``vigil controller`` (SQLite) and ``python -m agent`` as children; two ranks'
:class:`~vigil.telemetry.RankTelemetry` in this process send step and collective samples through
the agent's unix socket, 100 steps a second, while the agent is killed twice (once mid-stream, once
right after a batch left) and started again. Counts are read from the database.

Needs: loopback, a writable /tmp. About 20 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agent.crash_rig import counts
from tests.agent.crash_rig import submit_job as _submit
from tests.harness import REPO, ControllerProcess
from vigil.comm import CollectiveRecord
from vigil.contract.probe import wait_for
from vigil.contract.schemas import StepSample
from vigil.contract.settings import agent_socket_path
from vigil.telemetry import RankTelemetry

RANKS, CALLS, NODE = 2, 2, "node-k9"


class AgentProcess:
    def __init__(self, ctl: ControllerProcess, token: str, run_dir: Path) -> None:
        self.ctl, self.token, self.run_dir = ctl, token, run_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = dict(os.environ, VIGIL_AGENT_TOKEN=self.token, PYTHONPATH=str(REPO))
        log = (self.run_dir / f"agent-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "--node-id", NODE, "--controller", self.ctl.url, "--run-dir",
             str(self.run_dir), "--flush-interval", "0.3", "--no-commands"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        sock = agent_socket_path(self.run_dir, NODE)
        wait_for(lambda: sock.exists() and self.proc is not None and self.proc.poll() is None, 30, "agent socket")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.timeout(180)
def test_agent_kill9_mid_job_loses_no_sample(setup, db_url: str) -> None:  # type: ignore[no-untyped-def]
    ctl, tokens, run_dir = setup
    ctl.start()
    job = _submit(ctl, tokens)
    agent = AgentProcess(ctl, tokens["agent"], run_dir)
    agent.start()
    sock = agent_socket_path(run_dir, NODE)
    ranks = [RankTelemetry(sock) for _ in range(RANKS)]
    steps, t0 = 600, time.time()
    try:
        for step in range(1, steps + 1):
            for rank, tx in enumerate(ranks):
                now = time.time()
                records = [CollectiveRecord(step, q, "all_reduce", "world", "grads", 400, 400, 100, 0.001, now)
                           for q in range(CALLS)]
                tx.send_step(StepSample(job_id=job, rank=rank, world_size=RANKS, step=step, attempt=1, ts=now,
                                        loss=1.0, step_time_s=0.01, pid=os.getpid()), records)
            if step in (150, 400):
                agent.kill9()  # what it held in memory, and any batch in flight, is gone with it
            if step in (200, 430):
                agent.start()  # steps 151-200 / 401-430 waited in the ranks' backlogs
            time.sleep(max(0.0, t0 + step / 100 - time.time()))
        wait_for(lambda: all(tx.flush() >= 0 and tx._unsent == 0 for tx in ranks), 30, "backlogs delivered")
        want = steps * RANKS
        wait_for(lambda: counts(db_url, job)[0] >= want, 60, "every step stored", 0.2)
        time.sleep(1.0)  # anything still coming would be a duplicate
        n_steps, _, n_colls, _ = counts(db_url, job)
        assert (n_steps, n_colls) == (want, want * CALLS)
        assert all(tx.dropped_total == 0 for tx in ranks)
        # A new agent makes a rank send its window again. Each rank sees at least one; seeing both restarts is
        # not guaranteed on a loaded host (a clean-clone run under -n 2 counted 1 and 22: a rank can first
        # reach the new agent between its stat and its send); what matters is asserted above: nothing lost,
        # nothing stored twice
        assert all(tx.replays >= 1 for tx in ranks), [(tx.replays, tx.sent_total) for tx in ranks]
    finally:
        for tx in ranks:
            tx.close()
        agent.stop()
