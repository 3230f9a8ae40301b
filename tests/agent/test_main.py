"""Agent wiring: AgentConfig validation and defaults, the CLI flags, the heartbeat's content,
and the rule that the agent never imports torch, ray or the trainer.

The agent's heartbeat and the "commands off" switch are checked against the REAL controller
(fixture ``live_controller``: ``create_app()`` served live, see :mod:`tests.live_controller`): what
the agent sent is read back from what the controller stored.

Needs: Linux (unix datagram socket), a writable /tmp, a Python interpreter for one subprocess,
loopback networking and the controller's dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent.main import Agent, AgentConfig, build_parser, config_from_args, main
from tests.agent.doubles import FakeTransport, datagram, send_datagrams, step_dict, wait_for
from tests.live_controller import LiveController, step_sample
from vigil.contract.schemas import MAX_TELEMETRY_ITEMS, RankProcess
from vigil.contract.settings import agent_socket_path, get_settings

REPO = Path(__file__).resolve().parents[2]


def test_agent_imports_neither_torch_nor_ray_nor_the_trainer():
    """The contract (``vigil.contract``, and so the ``vigil`` package itself, whose ``__init__`` loads
    nothing) is allowed; the rank runtime, torch and ray are not."""
    code = (
        "import agent.main, agent.commands, agent.receiver, agent.collectors, agent.shipper, agent.spool, sys; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'vigil', 'controller') "
        "and m != 'vigil' and m != 'vigil.contract' and not m.startswith('vigil.contract.')); "
        "assert 'vigil.contract.schemas' in sys.modules and not bad, bad"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_config_defaults_are_derived(tmp_path):
    cfg = AgentConfig(
        node_id="0123456789abcdef",
        hostname="gpu-host",
        run_dir=tmp_path,
        controller_url="http://c:8000",
        token="vgl_test",
    )
    assert cfg.agent_id == "gpu-host-0123456789abcdef"
    assert cfg.socket_path == agent_socket_path(tmp_path, "0123456789abcdef")
    assert cfg.spool_dir == tmp_path / "spool" / "0123456789abcdef"
    assert (cfg.flush_interval_s, cfg.heartbeat_interval_s, cfg.max_batch_items) == (0.5, 1.0, 2000)
    assert cfg.token == "vgl_test" and "vgl_test" not in repr(cfg)  # kept out of logs


def test_a_token_is_required(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValidationError, match="token"):
        AgentConfig(node_id="n1", run_dir=tmp_path, controller_url="http://c:1")
    for name in ("VIGIL_TOKEN", "VIGIL_AGENT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--node-id", "n1", "--run-dir", str(tmp_path), "--controller", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "VIGIL_TOKEN" in err and "--token" in err
    assert not (tmp_path / "spool").exists()  # refused before opening anything


def test_token_from_vigil_token_when_no_agent_token(monkeypatch):
    monkeypatch.delenv("VIGIL_AGENT_TOKEN", raising=False)
    monkeypatch.setenv("VIGIL_TOKEN", "vgl_general")
    assert build_parser().parse_args(["--node-id", "n"]).token == "vgl_general"
    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "vgl_agent")
    assert build_parser().parse_args(["--node-id", "n"]).token == "vgl_agent"


def test_config_reads_process_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("VIGIL_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("VIGIL_CONTROLLER_URL", "http://10.0.0.1:9000")
    get_settings.cache_clear()
    try:
        cfg = AgentConfig(node_id="n1", token="t")
    finally:
        get_settings.cache_clear()
    assert cfg.controller_url == "http://10.0.0.1:9000" and cfg.run_dir == tmp_path


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("node_id", "../etc", "node_id"),
        ("node_id", "", "node_id"),
        ("controller_url", "ftp://x", "controller_url"),
        ("max_batch_items", MAX_TELEMETRY_ITEMS + 1, "max_batch_items"),
        ("flush_interval_s", 0, "flush_interval_s"),
        ("spool_max_bytes", 10, "spool_max_bytes"),
        ("backoff_initial_s", 99.0, "backoff_initial_s"),
        ("surprise", 1, "surprise"),
    ],
)
def test_config_rejects_bad_values(tmp_path, field, value, message):
    kwargs = {"node_id": "n1", "run_dir": tmp_path, "controller_url": "http://c:1", "token": "t", field: value}
    with pytest.raises(ValidationError, match=message):
        AgentConfig(**kwargs)


def test_cli_flags_map_onto_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "s3cret")
    args = build_parser().parse_args(
        [
            "--node-id", "abc",
            "--controller", "http://127.0.0.1:8123",
            "--socket", str(tmp_path / "a.sock"),
            "--spool-dir", str(tmp_path / "spool"),
            "--flush-interval", "0.25",
            "--heartbeat-interval", "2",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.node_id == "abc" and cfg.controller_url == "http://127.0.0.1:8123"
    assert cfg.socket_path == tmp_path / "a.sock" and cfg.spool_dir == tmp_path / "spool"
    assert cfg.flush_interval_s == 0.25 and cfg.heartbeat_interval_s == 2.0
    assert cfg.token == "s3cret"  # from the environment, so it never shows in `ps`


def test_command_flags_map_onto_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "t")
    monkeypatch.setenv("VIGIL_STORAGE_PATH", str(tmp_path / "from-env"))
    cfg = config_from_args(build_parser().parse_args(["--node-id", "vigil-node-1"]))
    assert cfg.commands and cfg.storage_root == (tmp_path / "from-env").resolve()
    assert (cfg.ray_join_cmd, cfg.raylet_pid, cfg.ray_start_pid, cfg.pyspy_timeout_s) == (None, None, None, 10.0)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    join = ["ray", "start", "--address=127.0.0.1:6379", "--node-name=vigil-node-1", "--block"]
    args = build_parser().parse_args(
        [
            "--node-id", "vigil-node-1",
            "--storage-root", str(tmp_path / "link"),
            "--ray-join-cmd", json.dumps(join),
            "--raylet-pid", "4321",
            "--ray-start-pid", "4320",
            "--pyspy-timeout", "3",
            "--no-commands",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.storage_root == (tmp_path / "real").resolve()  # resolved once, at the edge
    assert cfg.ray_join_cmd == join and (cfg.raylet_pid, cfg.ray_start_pid) == (4321, 4320)
    assert cfg.pyspy_timeout_s == 3.0 and cfg.commands is False


@pytest.mark.parametrize("bad", ["ray start", "[]", '["ray", 3]', '{"a": 1}'])
def test_join_command_must_be_a_json_argv(bad, capsys, monkeypatch):
    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "t")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--node-id", "n", "--ray-join-cmd", bad])
    assert e.value.code == 2 and "--ray-join-cmd" in capsys.readouterr().err


def test_an_agent_with_commands_off_polls_nothing(short_dir, live_controller: LiveController):
    live = live_controller
    job = live.submit_job("commands-off", steps=10).id
    live.heartbeat("n-off", [(job, 0, 4242)], [step_sample(job, 0, 0)])  # where the rank runs
    (cmd,) = live.fire(job, "nan_loss", rank=0)  # a command waits for the node's agent
    cfg = AgentConfig(node_id="n-off", run_dir=short_dir, controller_url=live.url, token=live.token("agent"),
                      commands=False, flush_interval_s=0.05, heartbeat_interval_s=0.05)
    agent = Agent(cfg)
    agent.start()
    try:
        assert agent.commands is None and "commands_executed" not in agent.agent_stats()

        def heard() -> bool:
            agent.step()
            return live.batches_seen(cfg.agent_id) >= 3

        wait_for(heard, timeout=10, what="three batches of the agent")
    finally:
        agent.stop()
    assert [c.id for c in live.pending_commands("n-off")] == [cmd.id]  # never fetched, never answered


def test_cli_requires_node_id_and_rejects_bad_values(capsys, monkeypatch):
    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "t")
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--node-id", "n", "--flush-interval", "-1"])
    assert e.value.code == 2
    assert "flush_interval_s" in capsys.readouterr().err


def test_heartbeat_reports_rank_processes_host_metrics_and_counters(short_dir, live_controller: LiveController):
    live = live_controller
    job = live.submit_job("heartbeat", steps=10).id  # the controller stores samples of known jobs only
    cfg = AgentConfig(
        node_id="node-hb",
        hostname="test-host",
        address="198.18.0.7",
        run_dir=short_dir,
        controller_url=live.url,
        token=live.token("agent"),
        flush_interval_s=0.05,
        heartbeat_interval_s=0.05,
    )
    agent = Agent(cfg)
    agent.start()

    def node() -> Any:
        with live.client("viewer") as c:
            return {n.id: n for n in c.list_nodes().data}.get("node-hb")

    try:
        wait_for(lambda: "system" in agent.collectors.snapshot(), timeout=10, what="first metrics")
        send_datagrams(str(cfg.socket_path), [datagram([step_dict(0, job_id=job, rank=3, pid=os.getpid())]),
                                              b"garbage"])

        def shipped() -> bool:
            agent.step()
            n = node()
            with live.client("viewer") as c:
                stored = c.job_metrics(job).ranks
            return bool(stored) and n is not None and bool(n.ranks)

        wait_for(shipped, timeout=10, what="the step stored and a heartbeat naming the rank")
    finally:
        agent.stop()
    hb = node()  # as the last heartbeat (the one of the final flush) left it
    assert hb.hostname == "test-host" and hb.address == "198.18.0.7"
    assert hb.ranks == [RankProcess(job_id=job, rank=3, pid=os.getpid(), alive=True)]
    assert hb.host["system"]["cpu"]["available"] is True
    assert hb.host["nics"]["available"] is True
    assert "available" in hb.host["gpus"]
    assert hb.host["agent"]["invalid_datagrams"] == 1 and hb.host["agent"]["received_samples"] == 1
    assert live.node_dropped_samples("node-hb") == 0
    assert hb.agent_id == "test-host-node-hb"
    assert live.batches_seen() == live.batches_seen("test-host-node-hb") >= 2  # every batch under that id
    assert not cfg.socket_path.exists()  # removed on stop


def test_a_second_agent_for_the_same_node_refuses_to_start(short_dir, monkeypatch):
    monkeypatch.setenv("VIGIL_AGENT_TOKEN", "t")
    cfg = AgentConfig(node_id="node-dup", run_dir=short_dir, controller_url="http://127.0.0.1:9", token="t")
    first = Agent(cfg, transport=FakeTransport())
    first.start()
    try:
        base = ["--node-id", "node-dup", "--run-dir", str(short_dir), "--controller", "http://127.0.0.1:9"]
        assert main(base) == 1  # same spool: locked
        assert main([*base, "--spool-dir", str(short_dir / "other-spool")]) == 1  # same socket: in use
        assert socket_is_bound(cfg.socket_path)  # the first agent's socket was left alone
    finally:
        first.stop()


def socket_is_bound(path: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def test_agents_of_nodes_sharing_a_prefix_get_distinct_ids() -> None:
    """Ingest is idempotent on (agent_id, seq): two agents must never share an id."""
    ids = {AgentConfig(node_id=f"vigil-node-{i}", hostname="h", controller_url="http://127.0.0.1:1",
                       token="t").agent_id
           for i in range(12)}
    assert len(ids) == 12
