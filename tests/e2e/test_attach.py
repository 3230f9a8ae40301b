"""End to end: Vigil attached to a Ray cluster it did not start, its agents deployed through Ray.

The cluster is built the way an operator builds one, without `vigil up`: `ray start --head` and `ray start
--address` for each worker (Ray's token authentication on), then `vigil db create-admin-token` and `vigil
controller --ray-address ... --ray-gcs-address ... --deploy-agents`. Nothing else is started by hand.
Checked: every node gets an agent (a Ray actor pinned to it), a node that joins later gets one, an agent
killed with `kill -9` mid-job is back within 10 s with no incident, no restart and every step of every rank
stored, and an agent's actor killed is started again by Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from controller.client import VigilClient
from controller.localcluster import ensure_ray_token
from controller.probe import free_port, wait_for
from controller.processes import ProcessGroup
from controller.schemas import JobCreate, JobStatus
from controller.settings import child_env

pytestmark = pytest.mark.slow

STEPS = 120
RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class Attached:
    procs: ProcessGroup
    gcs: str
    dashboard: str
    url: str
    token: str
    env: dict[str, str]
    logs: Path

    def add_node(self, name: str) -> None:
        self.procs.start(f"ray-{name}", [RAY, "start", f"--address={self.gcs}", f"--node-name={name}", "--num-cpus=1",
                                         "--node-ip-address=127.0.0.1", *_common()], self.env, self.logs)


def _common() -> list[str]:
    return ["--block", "--disable-usage-stats", f"--object-store-memory={150 << 20}",
            f"--dashboard-agent-listen-port={free_port()}"]


def _ray_names(dashboard: str) -> set[str]:
    from ray.util.state import list_nodes

    return {n.node_name for n in list_nodes(address=dashboard, raise_on_missing_output=False) if n.state == "ALIVE"}


@pytest.fixture(scope="module")
def attached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Attached]:
    ensure_ray_token()
    root = tmp_path_factory.mktemp("attach")
    home, logs, run_dir, storage = root / "home", root / "logs", root / "run", root / "storage"
    run_dir.mkdir(mode=0o755)
    procs = ProcessGroup(root / "pids.json")
    gcs_port, dash_port, port = free_port(), free_port(), free_port()
    env = child_env(dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1"))
    dashboard = f"http://127.0.0.1:{dash_port}"
    cluster = Attached(procs, f"127.0.0.1:{gcs_port}", dashboard, f"http://127.0.0.1:{port}", "", env, logs)
    try:
        procs.start("ray-head", [RAY, "start", "--head", f"--port={gcs_port}", f"--temp-dir={root / 'ray'}",
                                 "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
                                 "--num-cpus=0", "--node-name=head", "--node-ip-address=127.0.0.1", *_common()], env, logs)
        wait_for(lambda: "head" in _ray_names(dashboard), 120, "the Ray head", 0.5, (Exception,))
        for name in ("w1", "w2"):
            cluster.add_node(name)
            wait_for(lambda name=name: name in _ray_names(dashboard), 120, f"{name} in Ray", 0.5, (Exception,))
        venv = dict(os.environ, VIGIL_HOME=str(home), VIGIL_RUN_DIR=str(run_dir), VIGIL_STORAGE_PATH=str(storage),
                    VIGIL_CONTROLLER_URL=cluster.url)
        subprocess.run([sys.executable, "-m", "controller.cli", "db", "create-admin-token"], env=venv, check=True,
                       capture_output=True, timeout=120)
        cluster.token = (home / "admin-token").read_text().strip()
        procs.start("controller", [sys.executable, "-m", "controller.cli", "controller", "--port", str(port),
                                   "--ray-address", dashboard, "--ray-gcs-address", cluster.gcs, "--deploy-agents"],
                    venv, logs)
        yield cluster
    finally:
        procs.stop_all()


def _agents(name: str) -> list[int]:
    """Pids of the `python -m agent --node-id <name>` processes on this host."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if "agent" in argv and "-m" in argv and f"{name}" in argv and "--node-id" in argv:
            out.append(p.pid)
    return out


def _heard(client: VigilClient) -> set[str]:
    return {n.id for n in client.list_nodes().data if n.state.value == "ALIVE" and n.last_heartbeat is not None}


def test_agents_on_every_node_through_ray_and_back_after_kill_9(attached: Attached) -> None:
    with VigilClient(attached.url, token=attached.token, timeout=30) as client:
        wait_for(lambda: {"head", "w1", "w2"} <= _heard(client), 180, "an agent heartbeat from every node", 1,
                 (Exception,))
        kinds = [e.node_id for e in client.list_events(limit=200).data if e.kind == "agent_deployed"]
        assert sorted(kinds) == ["head", "w1", "w2"]

        job = client.submit_job(JobCreate.model_validate({
            "name": "attached", "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
            "data": {"max_bytes": 100_000}, "optimizer": {"kind": "adamw", "lr": 0.01},
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1}, "steps": STEPS, "batch_size": 4,
            "checkpoint": {"interval_steps": 40, "keep_last": 2}, "recovery": {"policy": "evict_restart"}}))
        wait_for(lambda: (client.get_job(job.id).last_step or 0) >= 20, 300, "step 20", 1)
        (old,) = _agents("w1")
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: [p for p in _agents("w1") if p != old], 10, "w1's agent started again", 0.2)
        wait_for(lambda: client.get_job(job.id).status.is_terminal(), 420, "the job to end", 2)
        done = client.get_job(job.id)
        assert done.status == JobStatus.SUCCEEDED and done.last_step == STEPS, done.message
        assert client.job_incidents(job.id).data == []

        def every_step() -> bool:
            m = client.job_metrics(job.id, max_points=100_000)
            return len(m.ranks) == 2 and all(set(range(1, STEPS + 1)) <= set(s.step) for s in m.ranks)

        wait_for(every_step, 30, "every step of every rank stored", 1)

        # The actor itself killed: Ray starts it again on its node, and it starts a new agent.
        (agent,) = _agents("w2")
        host = psutil.Process(agent).parent()
        host.kill()
        wait_for(lambda: [p for p in _agents("w2") if p != agent], 60, "w2's agent host restarted by Ray", 0.5)

        # A node that joins later gets its agent.
        attached.add_node("w3")
        wait_for(lambda: "w3" in _heard(client), 120, "an agent on the node that joined", 1, (Exception,))
