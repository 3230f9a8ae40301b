"""deploy/kuberay/raycluster.yaml: a KubeRay RayCluster with a Vigil agent sidecar in every pod.

Parsed as Kubernetes would take it, then its sidecar's command line run for real: in a PID namespace of its
own (as a pod with ``shareProcessNamespace`` gives it) beside a stand-in raylet named as ``ray start`` names
it, with the variables of the manifest, against a real controller. The agent must find its node by itself
and heartbeat as that node.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vigil.contract.probe import wait_for

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay" / "raycluster.yaml"
POD_IP = "10.42.0.7"


def pod_specs() -> list[dict[str, Any]]:
    doc = yaml.safe_load(MANIFEST.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    spec = doc["spec"]
    return [spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"])]


def agent_of(pod: dict[str, Any]) -> dict[str, Any]:
    (agent,) = [c for c in pod["containers"] if c["name"] == "vigil-agent"]
    return agent


def test_every_pod_has_an_agent_sidecar_that_sees_the_raylet_and_shares_the_socket_folder() -> None:
    for pod in pod_specs():
        assert pod["shareProcessNamespace"] is True  # the sidecar sees the raylet and the ranks
        agent = agent_of(pod)
        assert agent["command"][:2] == ["vigil", "agent"] and "--node-id" not in agent["command"]
        env = {e["name"]: e for e in agent["env"]}
        assert env["VIGIL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "vigil-agent-token", "key": "token"}
        assert "value" not in env["VIGIL_TOKEN"]  # never in the manifest itself
        caps = agent["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"] and {"KILL", "SYS_PTRACE"} <= set(caps["add"])
        run_dir = agent["command"][agent["command"].index("--run-dir") + 1]
        (ray,) = [c for c in pod["containers"] if c["name"] != "vigil-agent"]
        mounts = {m["name"]: m["mountPath"] for m in ray["volumeMounts"]}
        assert {m["name"]: m["mountPath"] for m in agent["volumeMounts"]} == mounts == {"vigil-run": run_dir}
        assert {"name": "vigil-run", "emptyDir": {}} in pod["volumes"]


STANDIN_RAYLET = "#!{python}\nimport time; time.sleep(600)\n"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root")
def test_the_sidecar_command_line_finds_its_node_and_reports(tmp_path: Path, live_controller) -> None:
    agent = agent_of(pod_specs()[1])
    env = {e["name"]: e.get("value", "") for e in agent["env"]}
    env.update(VIGIL_CONTROLLER_URL=live_controller.url, VIGIL_TOKEN=live_controller.token("agent"))
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in agent["command"]]  # as Kubernetes does
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "ops.cli", *argv[1:]]  # `vigil`, from this checkout
    argv[argv.index("--run-dir") + 1] = str(run_dir)
    argv += ["--spool-dir", str(tmp_path / "spool"), "--heartbeat-interval", "0.2"]
    raylet = tmp_path / "bin" / "raylet"
    raylet.parent.mkdir()
    raylet.write_text(STANDIN_RAYLET.replace("{python}", sys.executable))
    raylet.chmod(0o755)
    # The pod: a PID namespace with the raylet (`ray start` names the node by its IP) and the sidecar.
    pod = (f"{raylet} --node_id=ab12 --node-name={POD_IP} --node_ip_address={POD_IP} & "
           f"exec {subprocess.list2cmdline(argv)}")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", pod],
                            env=dict(os.environ, **env), start_new_session=True)
    try:
        def heard() -> bool:
            with live_controller.client("viewer") as c:
                return any(n.id == POD_IP and n.last_heartbeat is not None for n in c.list_nodes().data)

        wait_for(heard, 60, f"a heartbeat from node {POD_IP}", 0.5)
        assert (run_dir / "agents" / f"{POD_IP}.sock").exists()  # where the pod's ranks look for it
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(10)
