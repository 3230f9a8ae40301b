"""A Ray cluster built the way an operator builds one (``ray start``, no ``vigil up``) with Vigil attached.

:func:`start_attached_cluster` starts a head (no CPUs) and ``nodes`` worker raylets on this machine with
``ray start`` (Ray's token authentication on), writes the admin token with ``vigil db create-admin-token``,
and runs ``vigil controller --ray-address ... --ray-gcs-address ... --deploy-agents``: the agents come
through Ray (controller/fleet.py), nothing else is started for Vigil. Checkpoints go to ``storage`` (a URI:
the S3-compatible server of :func:`start_s3`). Nodes are ``attached-node-<i>`` (not ``vigil up``'s names:
its raylets may run beside), their processes ``ray-node-<i>`` as ``vigil up``'s, so the fault benches run on
it unchanged. Used by ``vigil bench recovery --attached`` and tests/e2e/test_attach.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.localcluster import RAY_ENV, ensure_ray_token
from ops.processes import ProcessGroup
from vigil.contract.probe import free_port, wait_for
from vigil.contract.settings import child_env

RAY = str(Path(sys.executable).parent / "ray")
PREFIX = "attached-node"
"""Its nodes' names, ``attached-node-<i>`` (0: the head): not ``vigil up``'s, whose raylets may run beside."""


def _name(i: int) -> str:
    return f"{PREFIX}-{i}"


@dataclass
class S3:
    """A local S3-compatible server (moto's) and one bucket."""

    endpoint_url: str
    bucket: str
    env: dict[str, str]
    server: Any = field(repr=False)

    def stop(self) -> None:
        self.server.stop()


def start_s3(bucket: str = "vigil", address: str = "127.0.0.1") -> S3:
    """moto's S3 server on a free port of ``address`` with ``bucket`` (needs ``moto[server]``: the test extra)."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise RuntimeError("a local S3 server needs moto[server] (pip install 'vigil[test]')") from exc
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
    return S3(env["AWS_ENDPOINT_URL"], bucket, env, server)


@dataclass
class AttachedCluster:
    home: Path
    procs: ProcessGroup
    controller_url: str
    admin_token: str
    dashboard_url: str
    gcs: str
    env: dict[str, str] = field(repr=False)
    log_dir: Path
    node_ids: list[str]
    storage: str | None = None

    def add_node(self, i: int, cpus: int = 1) -> None:
        """``ray start --address`` of one more worker, ``attached-node-<i>`` (the fleet gives it an agent)."""
        self.procs.start(f"ray-node-{i}", [RAY, "start", f"--address={self.gcs}", f"--node-name={_name(i)}",
                                           f"--num-cpus={cpus}", "--node-ip-address=127.0.0.1",
                                           # one log monitor per host (the head's), as Ray asks
                                           "--include-log-monitor=false", *_common()],
                         self.env, self.log_dir)
        self.node_ids.append(_name(i))

    def ray_alive(self) -> set[str]:
        from ray.util.state import list_nodes

        return {n.node_name for n in list_nodes(address=self.dashboard_url, raise_on_missing_output=False)
                if n.state == "ALIVE"}

    def stop(self, discard_storage: bool = False) -> None:
        self.procs.stop_all()
        # Detached actors die with the cluster; checkpoints on object storage are the caller's.


def _common() -> list[str]:
    return ["--block", "--disable-usage-stats", f"--object-store-memory={150 << 20}",
            f"--dashboard-agent-listen-port={free_port()}"]


def start_attached_cluster(root: Path, nodes: int = 3, cpus_per_node: int = 1, storage: str | None = None,
                           extra_env: dict[str, str] | None = None, timeout: float = 120.0) -> AttachedCluster:
    """Start it (module docstring); ``extra_env`` (the object store's ``AWS_*``) reaches the raylets and Vigil."""
    ensure_ray_token()
    home, logs, run_dir = root / "home", root / "logs", root / "run"
    run_dir.mkdir(mode=0o755, parents=True)
    procs = ProcessGroup(root / "pids.json")
    gcs_port, dash_port, port = free_port(), free_port(), free_port()
    env = child_env({**RAY_ENV, **os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})})
    dashboard = f"http://127.0.0.1:{dash_port}"
    cluster = AttachedCluster(home, procs, f"http://127.0.0.1:{port}", "", dashboard, f"127.0.0.1:{gcs_port}", env,
                              logs, [_name(0)], storage)
    try:
        procs.start("ray-head", [RAY, "start", "--head", f"--port={gcs_port}", f"--temp-dir={root / 'ray'}",
                                 "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={dash_port}", "--num-cpus=0", f"--node-name={_name(0)}",
                                 "--node-ip-address=127.0.0.1", f"--ray-client-server-port={free_port()}",
                                 *_common()], env, logs)
        wait_for(lambda: _name(0) in cluster.ray_alive(), timeout, "the Ray head", 0.5, (Exception,))
        for i in range(1, nodes + 1):
            cluster.add_node(i, cpus_per_node)
            wait_for(lambda i=i: _name(i) in cluster.ray_alive(), timeout, f"{_name(i)} in Ray", 0.5,
                     (Exception,))
        venv = dict(os.environ, **(extra_env or {}), VIGIL_HOME=str(home), VIGIL_RUN_DIR=str(run_dir),
                    VIGIL_CONTROLLER_URL=cluster.controller_url)
        if storage:
            venv["VIGIL_STORAGE_PATH"] = storage
        subprocess.run([sys.executable, "-m", "ops.cli", "db", "create-admin-token"], env=venv, check=True,
                       capture_output=True, timeout=120)
        cluster.admin_token = (home / "admin-token").read_text().strip()
        procs.start("controller", [sys.executable, "-m", "ops.cli", "controller", "--port", str(port),
                                   "--ray-address", dashboard, "--ray-gcs-address", cluster.gcs, "--deploy-agents"],
                    venv, logs)
        import httpx

        def every_agent() -> bool:
            nodes_seen = httpx.get(f"{cluster.controller_url}/api/v1/nodes", timeout=5,
                                   headers={"Authorization": f"Bearer {cluster.admin_token}"}).json()["data"]
            return {n["id"] for n in nodes_seen if n.get("last_heartbeat")} >= set(cluster.node_ids)

        wait_for(every_agent, 3 * timeout, "an agent on every node (deployed through Ray)", 1, (Exception,))
    except BaseException:
        procs.stop_all()
        raise
    return cluster
