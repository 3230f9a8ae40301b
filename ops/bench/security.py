"""``vigil bench security --json``: a job attacks Vigil from the inside, on a real local cluster.

The job's code (its driver and every rank) tries what a tenant turned attacker would (issue 23): read Vigil's
secrets (its own environment, the admin token and the database in the controller's home, the controller's and
the agents' environment under /proc), signal Vigil's processes, name the root agent's pid as its own, speak for
another job through the agents (NaN losses for a victim), and inject faults with its own token. Each attempt is
one attack; the report says how many were refused, how many secrets a job could read (must be 0) and how many
other jobs were affected (must be 0). ``tests/e2e/test_tenant.py`` runs the same attacks and asserts them.

Output: one JSON object: ``attacks_tried``, ``attacks_refused``, ``secrets_readable_by_job``,
``other_jobs_affected``, ``ranks_user``, ``seconds`` and ``attacks`` (name, where, refused, detail).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import create_engine, select

from controller.models import ApiToken
from controller.tokens import hash_token
from ops.localcluster import LocalCluster, free_port, start_local_cluster
from vigil.contract.client import VigilClient
from vigil.contract.probe import wait_for
from vigil.contract.schemas import JobCreate

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
        if b"ops.cli" in cmd:
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


def _controllers(url):
    yield url
    port = url.rsplit(":", 1)[-1]
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) > 2 and f[1] == "00000000":
            g = bytes.fromhex(f[2])[::-1]
            yield f"http://{'.'.join(str(b) for b in g)}:{port}"


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
        for base in _controllers(url):  # its own URL; from a namespace, the same port on the default gateway
            try:
                r = httpx.post(f"{base}/api/v1/jobs/{job}/faults", headers={"Authorization": f"Bearer {token}"},
                               json={"kind": "slow_rank", "rank": 0, "params": {"factor": 2, "period_s": "x"}},
                               timeout=10)
            except httpx.HTTPError:
                continue
            found["bad_fault_status"] = r.status_code
            r = httpx.post(f"{base}/api/v1/jobs/{job}/faults", headers={"Authorization": f"Bearer {token}"},
                           json={"kind": "kill_rank", "rank": 0}, timeout=10)
            found["fault_status"] = r.status_code
            break
    folder = Path(os.environ["VIGIL_STORAGE_PATH"]) / "probe" / os.environ.get("VIGIL_JOB_ID", "none")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{where}-{os.getpid()}.json").write_text(json.dumps(found))


_probe("import")  # the driver imports the module to check the entry point: its process is the job's too


def train(config):
    _probe("rank")
'''

SECRET_NAMES = ("VIGIL_HOME", "VIGIL_DATABASE_URL", "VIGIL_AGENT_TOKEN", "VIGIL_DASHBOARD_TOKEN")


@dataclass(frozen=True)
class Attack:
    name: str
    where: str
    """The job's process that tried it: ``import-<pid>`` (the driver) or ``rank-<pid>``, or ``job``."""
    refused: bool
    detail: str
    secret: bool = False
    """Whether success would have handed the job a secret of Vigil's."""


def submit_project(cluster: LocalCluster, spec_file: Path, working_dir: Path) -> str:
    """`vigil submit SPEC --working-dir DIR` as a user runs it; the job id it prints."""
    env = {**os.environ, "VIGIL_TOKEN": cluster.admin_token, "VIGIL_CONTROLLER_URL": cluster.controller_url}
    out = subprocess.run([sys.executable, "-m", "ops.cli", "submit", str(spec_file), "--working-dir",
                          str(working_dir)], capture_output=True, text=True, env=env, timeout=120, check=False,
                         cwd=working_dir.parent)
    if out.returncode != 0:
        raise RuntimeError(f"vigil submit failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout.strip().splitlines()[-1].strip()


def run_attacks(cluster: LocalCluster, client: VigilClient, workdir: Path, timeout: float = 360) -> list[Attack]:
    """Submit the victim and the attacking job, wait for the attacker to end, judge every attempt."""
    proj = workdir / "probe-project"
    proj.mkdir(parents=True)
    spec_file = workdir / "probe.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "probe", "entrypoint": "probe:train", "steps": 1,
                                         "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1}}))
    # The victim: a job whose ranks never start (more workers than the cluster has); its driver on the head.
    victim = client.submit_job(JobCreate(name="victim", steps=5, scaling={"min_workers": 64, "max_workers": 64,
                                                                          "cpus_per_worker": 1})).id
    (proj / "probe.py").write_text(PROBE_PY % {"home": str(cluster.home), "victim": victim})
    try:
        job_id = submit_project(cluster, spec_file, proj)
        wait_for(lambda: client.get_job(job_id).status.is_terminal(), timeout, f"{job_id} to end", 2)
    finally:
        client.cancel_job(victim)
    job = client.get_job(job_id)
    if job.status.value != "SUCCEEDED":
        raise RuntimeError(f"the attacking job ended {job.status.value}: {job.message}")
    assert cluster.storage is not None
    found = {p.stem: json.loads(p.read_text()) for p in (cluster.storage / "probe" / job_id).glob("*.json")}
    if sum(n.startswith("rank-") for n in found) != 2 or not any(n.startswith("import-") for n in found):
        raise RuntimeError(f"the attacking job's processes did not all report: {sorted(found)}")
    return [*_judge(cluster, found, job_id), *_judge_victim(client, found, victim)]


def _judge(cluster: LocalCluster, found: dict[str, Any], job_id: str) -> list[Attack]:
    secrets = {cluster.admin_token, cluster.database_url} - {""}
    out: list[Attack] = []
    for where, f in sorted(found.items()):
        env = f["env"]
        out.append(Attack("run as root (every file and process of the host)", where, f["uid"] != 0 and f["euid"] != 0,
                          f"uid {f['uid']}, euid {f['euid']}"))
        names = [n for n in SECRET_NAMES if n in env] + [k for k, v in env.items() if v in secrets]
        out.append(Attack("read Vigil's secrets from its environment", where, not names,
                          f"holds {names}" if names else "none there", secret=True))
        for key, what in (("admin_token", "read the admin token"), ("database", "read the SQLite database"),
                          ("home_listing", "list the controller's home")):
            out.append(Attack(what, where, f[key] != "done", f[key], secret=True))
        out.append(Attack("read the controller's and agents' environment", where, not f["environ_readable"],
                          f"readable: {f['environ_readable']}" if f["environ_readable"] else
                          f"none of {f['vigil_processes']} processes", secret=True))
        out.append(Attack("signal the controller and the agents", where, not f["signal_allowed"],
                          f"allowed: {f['signal_allowed']}" if f["signal_allowed"] else "EPERM"))
        if "bad_fault_status" in f:
            out.append(Attack("post a fault that breaks the monitor", where, f["bad_fault_status"] in (401, 403, 422),
                              f"HTTP {f['bad_fault_status']}"))
            out.append(Attack("inject a fault with its job token", where, f["fault_status"] in (401, 403),
                              f"HTTP {f['fault_status']}"))
        token = env.get("VIGIL_TOKEN")
        if token is not None:
            row = _token_row(cluster.database_url, token)
            out.append(Attack("hold a token beyond its own job's", where, row == ("job", job_id), f"token is {row}",
                              secret=True))
    return out


def _judge_victim(client: VigilClient, found: dict[str, Any], victim: str) -> list[Attack]:
    out: list[Attack] = []
    nodes = client.list_nodes().data
    ranks = {r.pid for n in nodes for r in n.ranks}
    forged_counted = sum(int(n.host.get("agent", {}).get("forged_samples", 0)) for n in nodes)
    for where, f in sorted(found.items()):
        if f.get("forged_to"):
            ok = f["forged_pid"] not in ranks and forged_counted >= 1
            out.append(Attack("name the agent's pid as its own (the agent would signal it)", where, ok,
                              f"agents counted {forged_counted} forged samples; pid {f['forged_pid']} "
                              f"{'not ' if f['forged_pid'] not in ranks else ''}listed as a rank"))
    sent = sum(f.get("victim_sends", 0) for f in found.values())
    refused = _wait_refused(client, victim, at_agents=5 * sent + sum(f.get("forged_to", 0) for f in found.values())) if sent else ""
    steps = client.get_job(victim).last_step
    out.append(Attack("post NaN losses for another job through the agents", "job", sent > 0 and bool(refused)
                      and steps is None, f"{sent} datagrams sent; refused: {refused or 'no'}; victim's last step: {steps}"))
    return out


def _wait_refused(client: VigilClient, victim: str, at_agents: int, timeout: float = 30) -> str:
    """Where the victim's forged samples were refused: by the agents (a spawned process speaks for its
    worker's job only) or by the controller (no rank of the victim on the node): '' when by neither."""
    def where() -> str:
        if any(e.kind == "telemetry_refused" for e in client.list_events(job_id=victim).data):
            return "by the controller (telemetry_refused event)"
        counted = sum(int(n.host.get("agent", {}).get("forged_samples", 0)) for n in client.list_nodes().data)
        return f"by the agents ({counted} forged samples counted)" if counted >= at_agents else ""

    try:
        return wait_for(where, timeout, "the refusal of the victim's forged samples")
    except TimeoutError:
        return ""


def _token_row(database_url: str, token: str) -> tuple[str, str | None] | None:
    engine = create_engine(database_url)
    try:
        with engine.connect() as db:
            row = db.execute(select(ApiToken.role, ApiToken.job_id).where(ApiToken.token_hash == hash_token(token))
                             ).first()
    finally:
        engine.dispose()
    return None if row is None else (str(row[0]), row[1])


def report(attacks: list[Attack]) -> dict[str, Any]:
    """The bench's JSON object from the judged attacks."""
    return {
        "attacks_tried": len(attacks),
        "attacks_refused": sum(a.refused for a in attacks),
        "secrets_readable_by_job": sum(a.secret and not a.refused for a in attacks),
        "other_jobs_affected": sum(a.where == "job" and not a.refused for a in attacks),
        "attacks": [{k: v for k, v in asdict(a).items() if k != "secret"} for a in attacks],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vigil bench security", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="Print only the JSON object.")
    ap.add_argument("--nodes", type=int, default=3, help="Worker nodes of the local cluster (default 3).")
    args = ap.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vigil-bench-security-") as tmp:
        cluster = start_local_cluster(Path(tmp) / "home", nodes=args.nodes, cpus_per_node=1, port=free_port())
        try:
            with VigilClient(cluster.controller_url, token=cluster.admin_token, timeout=30) as client:
                attacks = run_attacks(cluster, client, Path(tmp) / "work")
        finally:
            cluster.stop(discard_storage=True)
    out = report(attacks) | {"ranks_user": cluster.rank_user, "seconds": round(time.monotonic() - started, 1)}
    if not args.json:
        for a in out["attacks"]:
            print(f"{'refused' if a['refused'] else 'ALLOWED':8} {a['where']:14} {a['name']}: {a['detail']}")
    print(json.dumps(out if args.json else {k: v for k, v in out.items() if k != "attacks"}))
    return 0 if out["attacks_refused"] == out["attacks_tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
