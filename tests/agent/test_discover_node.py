"""``vigil agent`` with no ``--node-id`` takes its node from the host's raylet (agent/commands/raylet.py).

Stand-in raylets: executables named ``raylet`` with Ray's flags (real processes; only these are shown to
the discovery, so a real Ray on the machine does not interfere)."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from agent.commands.errors import CommandError
from agent.commands.raylet import RayletLocator, discover_node_id
from agent.main import build_parser, config_from_args
from ops.agentkeeper import raylet_running
from vigil.contract.probe import wait_for

STANDIN = "#!{python}\nimport time; time.sleep(600)\n"


@pytest.fixture
def raylets(tmp_path: Path):
    exe = tmp_path / "raylet"
    exe.write_text(STANDIN.replace("{python}", sys.executable))
    exe.chmod(0o755)
    started: list[subprocess.Popen] = []

    def start(*flags: str) -> psutil.Process:
        p = subprocess.Popen([str(exe), "--raylet_socket_name=/tmp/x", *flags])
        started.append(p)
        proc = psutil.Process(p.pid)
        # Started: the exec done (its name) and its command line readable (a busy machine takes a while).
        wait_for(lambda: proc.name() == "raylet" and flags[-1] in proc.cmdline(), 30, "the stand-in raylet",
                 0.05, (psutil.Error,))
        return proc

    yield start
    for p in started:
        p.kill()
        p.wait(10)


def test_the_node_name_where_ray_has_one_else_the_node_id(raylets) -> None:
    named = raylets("--node_id=ab12cd", "--node-name=gpu-7")
    assert discover_node_id(lambda: [named]) == "gpu-7"
    plain = raylets("--node_id=ab12cd34")  # `ray start` without --node-name (KubeRay, the cluster launcher)
    assert discover_node_id(lambda: [plain]) == "ab12cd34"
    other = psutil.Process()  # not a raylet: ignored
    assert discover_node_id(lambda: [other, plain]) == "ab12cd34"


def test_none_or_several_raylets_say_so(raylets) -> None:
    with pytest.raises(ValueError, match="no Ray raylet runs on this host"):
        discover_node_id(lambda: [psutil.Process()])
    a, b = raylets("--node_id=aa"), raylets("--node_id=bb")
    with pytest.raises(ValueError, match="2 raylets run on this host .*pass --node-id"):
        discover_node_id(lambda: [a, b])


def test_the_agent_without_node_id_uses_it(raylets, monkeypatch) -> None:
    only = raylets("--node_id=ab12cd34")
    monkeypatch.setattr("agent.main.discover_node_id",
                        lambda gcs_address=None: discover_node_id(lambda: [only], gcs_address))
    cfg = config_from_args(build_parser().parse_args(["--token", "t", "--controller", "http://127.0.0.1:1"]))
    assert cfg.node_id == "ab12cd34"
    cfg = config_from_args(build_parser().parse_args(["--node-id", "given", "--token", "t"]))
    assert cfg.node_id == "given"


def test_two_clusters_naming_their_nodes_alike_are_told_apart_by_their_gcs_address(raylets) -> None:
    """Two ``vigil up`` clusters on one host (or a test cluster beside an operator's) both have a
    ``vigil-node-3``: an agent told its cluster's GCS address takes only that cluster's raylet, for its
    commands (kill_node, readmission), its senders' binding and discovery; the keeper likewise."""
    node = f"vigil-node-{uuid.uuid4().hex[:8]}"  # no real raylet on this machine names it
    mine = raylets(f"--node-name={node}", "--gcs-address=192.0.2.2:41000")
    theirs = raylets(f"--node-name={node}", "--gcs-address=192.0.2.2:42000")
    with pytest.raises(CommandError, match=f"2 raylets name node '{node}'"):
        RayletLocator(node).raylet()  # without the cluster: refuses to guess
    assert RayletLocator(node, gcs_address="192.0.2.2:41000").raylet().pid == mine.pid
    assert RayletLocator(node, gcs_address="192.0.2.2:42000").raylet().pid == theirs.pid
    assert RayletLocator(node, gcs_address="192.0.2.2:43000").raylet() is None
    elsewhere = raylets(f"--node-name={node}-b", "--gcs-address=192.0.2.2:42000")
    with pytest.raises(ValueError, match="2 raylets"):
        discover_node_id(lambda: [mine, elsewhere])
    assert discover_node_id(lambda: [mine, elsewhere], "192.0.2.2:42000") == f"{node}-b"
    assert discover_node_id(lambda: [mine, elsewhere], "192.0.2.2:41000") == node
    assert raylet_running(node, "192.0.2.2:41000")
    assert not raylet_running(node, "192.0.2.2:43000")
    theirs.kill()
    theirs.wait(10)
    assert RayletLocator(node).raylet().pid == mine.pid


def test_the_agent_takes_its_clusters_gcs_address_and_refuses_a_malformed_one() -> None:
    base = ["--node-id", "n", "--token", "t", "--controller", "http://127.0.0.1:1"]
    cfg = config_from_args(build_parser().parse_args([*base, "--ray-gcs-address", "10.0.0.5:6379"]))
    assert cfg.ray_gcs_address == "10.0.0.5:6379"
    with pytest.raises(ValidationError, match="ray_gcs_address"):
        config_from_args(build_parser().parse_args([*base, "--ray-gcs-address", "no port here"]))


def test_a_cluster_given_by_loopback_matches_the_raylets_ray_wrote_with_the_hosts_address(raylets) -> None:
    """``vigil up`` starts its head as 127.0.0.1:<port>; Ray writes the raylets' --gcs-address with the host's
    own address (seen in CI: the agent then found no raylet of its own, readmission waited 60 s for nothing
    and the keeper never started a dead agent). Same port and two addresses of this host: the same cluster;
    another port, or a host that is not this one: not."""
    node = f"vigil-node-{uuid.uuid4().hex[:8]}"
    local = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")), "127.0.0.1")
    mine = raylets(f"--node-name={node}", f"--gcs-address={local}:41001")
    raylets(f"--node-name={node}-far", "--gcs-address=203.0.113.9:41001")  # another machine's cluster, same port
    assert RayletLocator(node, gcs_address="127.0.0.1:41001").raylet().pid == mine.pid
    assert RayletLocator(node, gcs_address="127.0.0.1:41002").raylet() is None
    assert RayletLocator(f"{node}-far", gcs_address="127.0.0.1:41001").raylet() is None
    assert raylet_running(node, "127.0.0.1:41001") and not raylet_running(node, "127.0.0.1:41002")
    assert not raylet_running(f"{node}-far", "127.0.0.1:41001")
