"""End to end: several machines for real, built as an operator builds them, without ``vigil up``.

Each Ray node (the head and every worker) in a network namespace of its own, reached over a bridge, and with
a private folder for everything local (a tmpfs of its own mount namespace: Ray's session, the agent's socket,
the job's unpacked code; nothing shared between nodes but the network). Checkpoints go only to an
S3-compatible server (moto's, on the bridge). The controller and its database on the head's side (in the
head's namespace, with `--deploy-agents`). Checked: an agent appears on every node through Ray; a job
submitted with `--working-dir` (scaling 1 to 2 workers) survives the death of a whole worker node, resuming
on the other node from its S3 checkpoint; a fresh node that joins gets an agent and takes work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from ops import netns
from ops.localcluster import RAY_ENV, ensure_ray_token
from ops.netns import NetnsCluster
from ops.processes import ProcessGroup
from tests.e2e.user_project import FUNCTION_PY, MODEL_PY
from tests.s3server import S3Server, start_s3_server, stop_s3_server
from vigil.contract.client import VigilClient
from vigil.contract.probe import free_port, wait_for
from vigil.contract.schemas import JobStatus
from vigil.contract.settings import child_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or bool(netns.unavailable_reason()), reason="needs root and netns")]

RAY = str(Path(sys.executable).parent / "ray")
LOCAL = "/var/tmp/vigil-node"
"""Every node's private folder (a tmpfs in its own mount namespace)."""
STEPS, CKPT = 320, 20  # 0.04 s a step: still running when the machine that joins is ready


def private(argv: list[str]) -> list[str]:
    """``argv`` with a private tmpfs at :data:`LOCAL` (its own mount namespace)."""
    script = f"mkdir -p {LOCAL} && mount -t tmpfs -o size=2g tmpfs {LOCAL} && mkdir -p {LOCAL}/run && exec \"$0\" \"$@\""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, *argv]


@dataclass
class Machines:
    net: NetnsCluster
    procs: ProcessGroup
    s3: S3Server
    logs: Path
    env: dict[str, str]
    gcs: str = ""
    url: str = ""
    token: str = ""
    names: dict[int, str] = field(default_factory=dict)

    def start_node(self, i: int, head: bool = False) -> None:
        n = self.net.node(i)
        name = self.names[i] = f"m{i}"
        common = [f"--node-name={name}", f"--node-ip-address={n.address}", f"--temp-dir={LOCAL}/ray", "--block",
                  "--disable-usage-stats", f"--object-store-memory={150 << 20}",
                  f"--dashboard-agent-listen-port={free_port()}"]
        argv = ([RAY, "start", "--head", f"--port={self.gcs.split(':')[1]}", "--num-cpus=0", "--include-dashboard=true",
                 f"--dashboard-host={n.address}", "--dashboard-port=8265", f"--ray-client-server-port={free_port()}",
                 *common] if head
                else [RAY, "start", f"--address={self.gcs}", "--num-cpus=1", *common])
        self.procs.start(f"node-{i}", n.exec_argv(private(argv)), dict(self.env, GLOO_SOCKET_IFNAME=n.iface), self.logs)

    def kill_node(self, i: int) -> None:
        """The machine dies: every process in its namespace, at once."""
        for pid in netns._namespace_pids(self.net.node(i).namespace):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ray_alive(self) -> set[str]:
        from ray.util.state import list_nodes

        dash = f"http://{self.net.node(1).address}:8265"
        return {n.node_name for n in list_nodes(address=dash, raise_on_missing_output=False) if n.state == "ALIVE"}


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machines]:
    ensure_ray_token()
    root = tmp_path_factory.mktemp("multihost")
    net = netns.create(root / "home", 4)
    s3 = start_s3_server(address=net.gateway)
    env = child_env({**RAY_ENV, **os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": LOCAL, **s3.env})
    m = Machines(net, ProcessGroup(root / "pids.json"), s3, root / "logs", env)
    head = net.node(1).address
    m.gcs = f"{head}:{free_port()}"
    try:
        m.start_node(1, head=True)
        wait_for(lambda: "m1" in m.ray_alive(), 120, "the head", 1, (Exception,))
        for i in (2, 3):
            m.start_node(i)
            wait_for(lambda i=i: f"m{i}" in m.ray_alive(), 120, f"m{i} in Ray", 1, (Exception,))
        # The controller on the head's side: its namespace, its database, its admin token.
        port = free_port()
        m.url = f"http://{head}:{port}"
        home = root / "home"
        venv = dict(os.environ, **s3.env, VIGIL_HOME=str(home), VIGIL_RUN_DIR=f"{LOCAL}/run",
                    VIGIL_STORAGE_PATH=f"s3://{s3.bucket}/multihost", VIGIL_CONTROLLER_URL=m.url)
        subprocess.run([sys.executable, "-m", "ops.cli", "db", "create-admin-token"], env=venv, check=True,
                       capture_output=True, timeout=120)
        m.token = (home / "admin-token").read_text().strip()
        # On the head machine: its network and its files (its fleet driver is a Ray driver beside the head's raylet).
        head_pid = m.procs.child("node-1").proc.pid
        m.procs.start("controller", [
            "nsenter", f"--target={head_pid}", "--mount", "--net",
            sys.executable, "-m", "ops.cli", "controller", "--host", head, "--allow-remote", "--port", str(port),
            "--ray-address", f"http://{head}:8265", "--ray-gcs-address", m.gcs, "--deploy-agents"], venv, m.logs)
        yield m
    finally:
        m.procs.stop_all()
        net.destroy()
        stop_s3_server(s3)


def _project(tmp: Path) -> tuple[Path, Path]:
    proj = tmp / "my-project"
    proj.mkdir()
    (proj / "mymodel.py").write_text(textwrap.dedent(MODEL_PY))
    (proj / "mytrain.py").write_text(FUNCTION_PY)
    spec = {"name": "multihost", "optimizer": {"kind": "adamw", "lr": 0.01}, "entrypoint": "mytrain:train_func",
            "config": {"width": 32, "log_dir": LOCAL}, "steps": STEPS,
            "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
            "checkpoint": {"interval_steps": CKPT, "keep_last": 3},
            "recovery": {"policy": "evict_restart", "max_restarts": 3}}
    spec_file = tmp / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return proj, spec_file


def _ranks_on(client: VigilClient, job_id: str) -> dict[str, list[int]]:
    return {n.id: [r.rank for r in n.ranks if r.job_id == job_id and r.alive] for n in client.list_nodes().data}


def _starts(m: Machines, i: int) -> list[int]:
    """The steps the ranks on machine ``i`` started from (the code writes them to the machine's private folder,
    read here through its raylet's view of the file system)."""
    pids = [p for p in netns._namespace_pids(m.net.node(i).namespace) if Path(f"/proc/{p}/comm").read_text().strip() == "raylet"]
    folder = Path(f"/proc/{pids[0]}/root{LOCAL}")
    return [int(x) for f in sorted(folder.glob("starts-*.txt")) for x in f.read_text().split()]


def test_a_job_survives_a_dead_machine_from_s3_and_a_new_machine_takes_work(machines: Machines,
                                                                           tmp_path: Path) -> None:
    m = machines
    with VigilClient(m.url, token=m.token, timeout=30) as client:
        wait_for(lambda: {"m1", "m2", "m3"} <= {n.id for n in client.list_nodes().data if n.last_heartbeat},
                 180, "an agent on every machine", 1, (Exception,))
        proj, spec_file = _project(tmp_path)
        env = {**os.environ, "VIGIL_TOKEN": m.token, "VIGIL_CONTROLLER_URL": m.url}
        out = subprocess.run([sys.executable, "-m", "ops.cli", "submit", str(spec_file), "--working-dir",
                              str(proj)], check=False, capture_output=True, text=True, env=env, timeout=120,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        job_id = out.stdout.strip().splitlines()[-1].strip()
        wait_for(lambda: (client.get_job(job_id).last_step or 0) >= 2 * CKPT + 5, 300, "two checkpoints", 0.5)
        assert any("/checkpoints/step-" in k for k in m.s3.objects("multihost/"))  # on S3, nowhere else
        m.kill_node(3)
        wait_for(lambda: client.get_job(job_id).status.is_terminal() or _ranks_on(client, job_id).get("m2"), 60,
                 "the ranks on m2")
        m.start_node(4)  # a fresh machine joins: it gets an agent, and the job grows onto it
        wait_for(lambda: "m4" in {n.id for n in client.list_nodes().data if n.last_heartbeat}, 180,
                 "an agent on the new machine", 1, (Exception,))
        took: list[int] = []

        def on_m4() -> bool:
            took.extend(_ranks_on(client, job_id).get("m4") or [])
            return bool(took) or client.get_job(job_id).status.is_terminal()

        wait_for(on_m4, 300, "a rank of the job on the new machine", 0.5)
        assert took, "the job ended without ever running on the machine that joined"
        wait_for(lambda: client.get_job(job_id).status.is_terminal(), 600, "the job to end", 0.5)
        job = client.get_job(job_id)
        assert job.status == JobStatus.SUCCEEDED and job.last_step == STEPS, (job.message, json.dumps(
            [(i.kind, i.node_id, i.action) for i in client.job_incidents(job_id).data]))
        starts = _starts(m, 2) + _starts(m, 4)
        assert 1 in starts and any(s > 1 and (s - 1) % CKPT == 0 for s in starts), starts  # resumed from S3
        assert any(i.kind.value == "node_lost" and i.node_id == "m3" for i in client.job_incidents(job_id).data)
