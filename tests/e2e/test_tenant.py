"""End to end: a job is a tenant (issue 23). Its code, in its driver and in every rank on `vigil up`, tries
what an attacker would: read Vigil's secrets (its environment, the admin token and the database in the
controller's home, the agents' and the controller's environment under /proc), signal Vigil's processes,
point the root agent at a process that is not its own, and inject a fault with its own token. Everything
is refused; the results are written by the job itself and checked here. Slow: shares the cluster of
tests/e2e/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from sqlalchemy import create_engine, select

from controller.client import VigilClient
from controller.localcluster import LocalCluster
from controller.models import ApiToken
from controller.probe import wait_for
from controller.schemas import JobCreate
from controller.tokens import hash_token
from tests.e2e.user_project import finish, vigil_submit

pytestmark = pytest.mark.slow

PROBE_PY = '''
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HOME = Path(%(home)r)
VICTIM = %(victim)r
# A new process (not the rank the agent knows) speaking for another job: NaN losses, as if the victim diverged.
FORGER = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
items = [{"kind": "step", "job_id": sys.argv[2], "rank": 0, "step": i, "attempt": 0, "ts": time.time(),
          "loss": None, "step_time_s": 0.1} for i in range(1, 6)]
s.sendto(json.dumps(items).encode(), sys.argv[1])
"""


def _vigil_processes():
    """Vigil's own processes (controller, agents), as any process finds them: /proc/<pid>/cmdline."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\\0")
        except (OSError, ValueError):
            continue
        if b"controller.cli" in cmd:
            out.append((int(d.name), b" ".join(cmd[2:4]).decode()))
    return out


def _try(fn):
    try:
        fn()
        return "done"
    except Exception as exc:
        return type(exc).__name__


def _sockets():
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        path = line.split()[-1] if len(line.split()) >= 8 else ""
        if path.endswith(".sock") and "/agents/" in path:
            yield path


def _forge(agent_pid):
    """A step sample that names the agent's pid as this rank's, to every agent socket on the host."""
    sent = 0
    item = {"kind": "step", "job_id": os.environ.get("VIGIL_JOB_ID", ""), "rank": 0, "step": 0, "attempt": 0,
            "ts": time.time(), "loss": 1.0, "step_time_s": 0.1, "pid": agent_pid}
    for path in _sockets():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.sendto(json.dumps([item]).encode(), path)
            sent += 1
        except OSError:
            pass
    return sent


def _probe(where):
    procs = _vigil_processes()
    found = {"uid": os.getuid(), "euid": os.geteuid(), "env": dict(os.environ), "vigil_processes": len(procs)}
    found["admin_token"] = _try(lambda: (HOME / "admin-token").read_text())
    found["database"] = _try(lambda: (HOME / "vigil.db").read_bytes())
    found["home_listing"] = _try(lambda: os.listdir(HOME))
    found["environ_readable"] = [c for p, c in procs if _try(lambda p=p: Path(f"/proc/{p}/environ").read_bytes()) == "done"]
    found["signal_allowed"] = [c for p, c in procs if _try(lambda p=p: os.kill(p, 0)) == "done"]
    agents = [p for p, c in procs if "agent" in c]
    found["forged_to"] = _forge(agents[0]) if agents else 0
    found["forged_pid"] = agents[0] if agents else None
    found["victim_sends"] = sum(subprocess.run([sys.executable, "-c", FORGER, path, VICTIM]).returncode == 0
                                for path in _sockets())
    url, token, job = (os.environ.get(k) for k in ("VIGIL_CONTROLLER_URL", "VIGIL_TOKEN", "VIGIL_JOB_ID"))
    if url and token and job:
        r = httpx.post(f"{url}/api/v1/jobs/{job}/faults", headers={"Authorization": f"Bearer {token}"},
                       json={"kind": "slow_rank", "rank": 0, "params": {"factor": 2, "period_s": "x"}}, timeout=10)
        found["bad_fault_status"] = r.status_code
        r = httpx.post(f"{url}/api/v1/jobs/{job}/faults", headers={"Authorization": f"Bearer {token}"},
                       json={"kind": "kill_rank", "rank": 0}, timeout=10)
        found["fault_status"] = r.status_code
    folder = Path(os.environ["VIGIL_STORAGE_PATH"]) / "probe" / os.environ.get("VIGIL_JOB_ID", "none")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{where}-{os.getpid()}.json").write_text(json.dumps(found))


_probe("import")  # the driver imports the module to check the entry point: its process is the job's too


def train(config):
    _probe("rank")
'''

SECRET_NAMES = {"VIGIL_HOME", "VIGIL_DATABASE_URL", "VIGIL_AGENT_TOKEN", "VIGIL_DASHBOARD_TOKEN"}


def test_a_jobs_code_reaches_no_secret_and_no_process_of_vigils(
    shared_cluster: LocalCluster, shared_client: VigilClient, tmp_path: Path
) -> None:
    cluster, client = shared_cluster, shared_client
    proj = tmp_path / "probe-project"
    proj.mkdir()
    spec_file = tmp_path / "probe.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "probe", "entrypoint": "probe:train", "steps": 1,
                                         "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1}}))
    # The victim: a job whose ranks never start (more workers than the cluster has), its driver on the head.
    victim = client.submit_job(JobCreate(name="victim", steps=5, scaling={"min_workers": 8, "max_workers": 8,
                                                                          "cpus_per_worker": 1})).id
    (proj / "probe.py").write_text(PROBE_PY % {"home": str(cluster.home), "victim": victim})
    try:
        job_id = vigil_submit(cluster, spec_file, proj)
        finish(client, job_id)
    finally:
        client.cancel_job(victim)
    assert cluster.storage is not None
    found = {p.name: json.loads(p.read_text()) for p in (cluster.storage / "probe" / job_id).glob("*.json")}
    assert sum(n.startswith("rank-") for n in found) == 2 and any(n.startswith("import-") for n in found), sorted(found)
    secrets = {cluster.admin_token, cluster.database_url} - {""}
    for name, f in found.items():
        env = f["env"]
        assert not SECRET_NAMES & set(env), f"{name} sees {sorted(SECRET_NAMES & set(env))}"
        assert not [k for k, v in env.items() if v in secrets], f"{name} holds the admin token or database URL"
        assert f["vigil_processes"] >= 2, f  # it did find the controller and the agents to attack
        if cluster.rank_user is not None:  # vigil up as root (this machine, CI): ranks are not root
            assert f["uid"] != 0 and f["euid"] != 0, f
            assert f["admin_token"] == f["database"] == f["home_listing"] == "PermissionError", f
            assert f["environ_readable"] == [] and f["signal_allowed"] == [], f
        if name.startswith("rank-"):
            assert f["bad_fault_status"] == 403 and f["fault_status"] == 403, f  # a job token only reads
        token = env.get("VIGIL_TOKEN")
        if token is not None:  # its own job's token, nothing more (revoked once the job ended: looked up)
            engine = create_engine(cluster.database_url)
            try:
                with engine.connect() as db:
                    row = db.execute(select(ApiToken.role, ApiToken.job_id)
                                     .where(ApiToken.token_hash == hash_token(token))).one()
            finally:
                engine.dispose()
            assert tuple(row) == ("job", job_id), (name, tuple(row))
    # The samples naming an agent's pid reached the agents and were refused: no node lists that pid as a rank.
    forged = {f["forged_pid"] for f in found.values() if f.get("forged_to")}
    assert forged, "the job found no agent socket to send to"
    nodes = client.list_nodes().data
    assert not forged & {r.pid for n in nodes for r in n.ranks}, forged
    assert sum(int(n.host.get("agent", {}).get("forged_samples", 0)) for n in nodes) >= 1
    # The victim's NaN losses, sent by a new process through its node's agent, reached the controller and were
    # refused there: no node of the probe ran any of the victim's processes.
    assert all(f["victim_sends"] >= 1 for n, f in found.items() if n.startswith("rank-")), found
    wait_for(lambda: any(e.kind == "telemetry_refused" for e in client.list_events(job_id=victim).data), 30,
             "the refusal of the victim's forged samples")
    assert client.get_job(victim).last_step is None
    assert client.job_metrics(victim).ranks == []
