"""``vigil agent`` with no ``--node-id`` takes its node from the host's raylet (agent/commands/raylet.py).

Stand-in raylets: executables named ``raylet`` with Ray's flags (real processes; only these are shown to
the discovery, so a real Ray on the machine does not interfere)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent.commands.raylet import discover_node_id
from agent.main import build_parser, config_from_args
from controller.probe import wait_for

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
    monkeypatch.setattr("agent.main.discover_node_id", lambda: discover_node_id(lambda: [only]))
    cfg = config_from_args(build_parser().parse_args(["--token", "t", "--controller", "http://127.0.0.1:1"]))
    assert cfg.node_id == "ab12cd34"
    cfg = config_from_args(build_parser().parse_args(["--node-id", "given", "--token", "t"]))
    assert cfg.node_id == "given"
