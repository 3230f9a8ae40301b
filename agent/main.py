"""``vigil agent``: the per-node daemon, wired together.

The receiver thread takes rank datagrams off the node's socket, the collector thread samples
host / NIC / GPU metrics, the command thread polls the controller for commands and carries them
out (:mod:`agent.commands`), and the calling thread runs the shipper loop (batches, heartbeats,
spool). Stopping (``stop_event`` or SIGTERM/SIGINT) closes the socket, takes in what ranks had
already sent, makes a final flush, and leaves whatever the controller could not take in the
spool for the next run. After a ``kill_node`` command the agent stops without a final flush or
heartbeat: its node is lost.

Given several controllers (``--controller URL1,URL2``: controllers sharing one PostgreSQL database),
telemetry and commands each go to the one that answers and move on when it stops answering
(:mod:`agent.failover`).

This module must never import torch, ray or the trainer: agents run on nodes that need neither.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlparse

from pydantic import ValidationError

from agent import netfaults
from agent.collectors import (
    Collector,
    CollectorLoop,
    HostCollector,
    InfinibandCollector,
    NicCollector,
)
from agent.commands import (
    ClientCommandTransport,
    CommandExecutor,
    CommandLoop,
    CommandRunner,
    CommandTransport,
    ExecutorConfig,
)
from agent.commands.raylet import RayletLocator, discover_node_id
from agent.config import TOKEN_ENVS, AgentConfig
from agent.failover import FailoverClient
from agent.gpu import GpuCollector
from agent.ranksocket import SocketInUseError
from agent.receiver import ExitWatcher, RankTracker, Receiver, SampleBuffer
from agent.rundir import prepare_run_dir
from agent.senders import CachedRaylet, WorkerRoots
from agent.shipper import ClientTransport, Shipper, ShipperConfig, Transport
from agent.spool import Spool, SpoolLockedError
from vigil.contract.schemas import MAX_TELEMETRY_ITEMS, NAME_MAX, Heartbeat
from vigil.contract.settings import (
    DEFAULT_STORAGE_PATH,
    ENV_STORAGE_PATH,
)

log = logging.getLogger(__name__)



def local_address_towards(url: str) -> str:
    """The local IP address this host uses to reach ``url`` (no packet is sent)."""
    host = urlparse(url).hostname or "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return ""


def _executor_config(config: AgentConfig) -> ExecutorConfig:
    """What the commands need to know about this node, from the agent's config."""
    return ExecutorConfig(
        node_id=config.node_id,
        run_dir=Path(config.run_dir),
        storage_root=config.storage_root,
        raylet_pid=config.raylet_pid,
        ray_start_pid=config.ray_start_pid,
        ray_gcs_address=config.ray_gcs_address,
        ray_join_cmd=config.ray_join_cmd,
        rank_group=config.socket_group,
        pyspy_timeout_s=config.pyspy_timeout_s,
        raylet_stop_grace_s=config.raylet_stop_grace_s,
        raylet_start_wait_s=config.raylet_start_wait_s,
    )


def _default_collectors(config: AgentConfig) -> list[Collector]:
    """The node's collectors in production: host, NICs, InfiniBand, GPUs, and a ``--netns`` node's shaped link."""
    assert config.spool_dir is not None
    return [
        HostCollector(disk_paths=[*config.disk_paths, config.spool_dir.parent]),
        NicCollector(),
        InfinibandCollector(),
        GpuCollector(),
        *netfaults.node_collectors(),  # a --netns node's shaped link (rate, queues), from tc
    ]


def _shipper_config(config: AgentConfig) -> ShipperConfig:
    """The shipper's batching, heartbeat and backoff settings, from the agent's config."""
    return ShipperConfig(
        agent_id=config.agent_id,
        node_id=config.node_id,
        max_batch_items=config.max_batch_items,
        flush_interval_s=config.flush_interval_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
        backoff_initial_s=config.backoff_initial_s,
        backoff_max_s=config.backoff_max_s,
    )


class Agent:
    """The agent's parts, built from a config. ``start``/``step``/``stop`` for tests and run_agent."""

    def __init__(
        self,
        config: AgentConfig,
        transport: Transport | None = None,
        collectors: Sequence[Collector] | None = None,
        command_transport: CommandTransport | None = None,
    ) -> None:
        """``transport`` / ``command_transport``: fakes for tests. Commands are polled with a
        client of their own when neither transport is given (production), or through
        ``command_transport``; a test that fakes only the telemetry transport gets no commands."""
        assert config.socket_path is not None and config.spool_dir is not None
        self.config = config
        #: Set by a kill_node command: stop at once, no final flush (no last heartbeat).
        self.node_lost = threading.Event()
        self.address = config.address or local_address_towards(config.controller_url)
        self.buffer = SampleBuffer(capacity=config.max_buffered_samples, wake_at=config.max_batch_items)
        # Exact exit times of the ranks' processes: names the rank that died first (receiver.ExitWatcher).
        self.exits = ExitWatcher()
        prepare_run_dir(config.run_dir)  # before anything is put there: a folder made by someone else is refused
        # A sender's job is bound to its Ray worker (the raylet's child above it), found by its raylet.
        locator = RayletLocator(config.node_id, config.raylet_pid, gcs_address=config.ray_gcs_address)
        roots = WorkerRoots(CachedRaylet(lambda: getattr(locator.raylet(), "pid", None)))
        self.receiver = Receiver(config.socket_path, self.buffer, ranks=RankTracker(exits=self.exits),
                                 socket_group=config.socket_group, roots=roots)
        # The spool first: it refuses a folder another agent holds, before anything else is opened.
        self.spool = Spool(config.spool_dir, max_bytes=config.spool_max_bytes)
        self._client: FailoverClient | None = None
        self._command_client: FailoverClient | None = None
        self.commands: CommandRunner | None = None
        self._command_loop: CommandLoop | None = None
        if config.commands and (command_transport is not None or transport is None):
            self._build_commands(command_transport)
        if transport is None:
            self._client = FailoverClient.connect(
                config.controller_urls, token=config.token, timeout=config.http_timeout_s, purpose="telemetry"
            )
            transport = ClientTransport(self._client)
        if collectors is None:
            collectors = _default_collectors(config)
        self.collectors = CollectorLoop(collectors, interval_s=config.heartbeat_interval_s)
        self.shipper = Shipper(
            _shipper_config(config), buffer=self.buffer, spool=self.spool, transport=transport,
            heartbeat=self.heartbeat,
        )

    def _build_commands(self, command_transport: CommandTransport | None) -> None:
        """The command runner and its loop, polling through ``command_transport`` (None: a client of its own)."""
        config = self.config
        if command_transport is None:
            # Its own connection: a slow poll never waits behind a telemetry post, or the reverse.
            self._command_client = FailoverClient.connect(
                config.controller_urls, token=config.token, timeout=config.http_timeout_s, purpose="commands"
            )
            command_transport = ClientCommandTransport(self._command_client, config.node_id, config.command_wait_s)
        executor = CommandExecutor(_executor_config(config), rank_pids=self.receiver.ranks.pids)
        self.commands = CommandRunner(config.node_id, command_transport, executor, on_node_lost=self._lost)
        self._command_loop = CommandLoop(self.commands, interval_s=config.heartbeat_interval_s)

    def _lost(self) -> None:
        self.node_lost.set()
        self.buffer.wake.set()  # wake the shipper loop so it sees the loss now

    def heartbeat(self, ts: float, dropped_samples: int) -> Heartbeat:
        """The heartbeat: identity, rank processes, the latest node metrics, the agent's counters.

        ``host`` holds ``collected_at`` (unix time of the metrics), ``system`` (cpu, memory, disk,
        load), ``nics`` (``interfaces`` -> counters, rates, operstate, speed_mbps, ...), ``gpus``
        (``devices`` or ``available: false`` with a ``reason``) and ``agent`` (the counters of
        :meth:`agent_stats`). Metrics are absent until the collector thread's first pass.
        """
        host: dict[str, Any] = self.collectors.snapshot()
        if "ts" in host:
            host["collected_at"] = host.pop("ts")
        host["agent"] = self.agent_stats()
        return Heartbeat(
            ts=ts,
            hostname=self.config.hostname[:NAME_MAX],
            address=self.address[:NAME_MAX],
            ranks=self.receiver.ranks.processes(),
            host=host,
            dropped_samples=dropped_samples,
        )

    def agent_stats(self) -> dict[str, int]:
        r, s = self.receiver.stats, self.shipper.stats
        return {
            "datagrams": r.datagrams,
            "invalid_datagrams": r.invalid_datagrams,
            "invalid_samples": r.invalid_samples,
            "forged_samples": r.forged_samples,
            "received_samples": r.samples,
            "buffered_samples": len(self.buffer),
            "buffer_overflow": self.buffer.overflow,
            "sent_batches": s.sent_batches,
            "duplicate_batches": s.duplicate_batches,
            "rejected_batches": s.rejected_batches,
            "rejected_samples": s.rejected_samples,
            "failed_posts": s.failed_posts,
            "spooled_batches": len(self.spool),
            "spool_bytes": self.spool.size_bytes,
            "spool_dropped_batches": self.spool.dropped_batches,
            "spool_dropped_samples": self.spool.dropped_samples,
            **self.command_stats(),
        }

    def command_stats(self) -> dict[str, int]:
        if self.commands is None:
            return {}
        c = self.commands.stats
        return {
            "commands_executed": c.executed,
            "commands_failed": c.failed_commands,
            "command_polls_failed": c.failed_polls,
            "command_results_unposted": self.commands.unposted,
        }

    def start(self) -> None:
        """Bind the socket and start the threads; on failure (socket in use, ...) close and raise."""
        try:
            self.receiver.start()
        except BaseException:
            self.close()
            raise
        self.collectors.start()
        if self._command_loop is not None:
            self._command_loop.start()
        log.info(
            "agent %s (node %s) shipping to %s; spool %s",
            self.config.agent_id,
            self.config.node_id,
            ", ".join(self.config.controller_urls),
            self.config.spool_dir,
        )

    def step(self) -> float:
        return self.shipper.step()

    def stop(self) -> None:
        """Stop listening, final flush, close. Leftover batches stay in the spool.

        Throttled processes are left running. After kill_node there is no final flush: a lost
        node sends nothing more (samples still in memory are lost with it, like on a crash).
        """
        try:
            if self._command_loop is not None:
                self._command_loop.stop()
            self.receiver.stop()
            self.collectors.stop()
            if not self.node_lost.is_set():
                self.shipper.flush()
        finally:
            self.close()
        log.info("agent %s stopped (next batch number %d)", self.config.agent_id, self.spool.next_seq)

    def close(self) -> None:
        """Release the spool lock, the exit watcher and the HTTP client (no flush)."""
        self.spool.close()
        self.exits.close()
        for client in (self._client, self._command_client):
            if client is not None:
                client.close()


def run_agent(
    config: AgentConfig,
    stop_event: threading.Event,
    *,
    transport: Transport | None = None,
    command_transport: CommandTransport | None = None,
) -> bool:
    """Run the agent until ``stop_event`` is set (or SIGTERM/SIGINT when called on the main
    thread), or its node is killed by a kill_node command. Returns True in that last case."""
    agent = Agent(config, transport=transport, command_transport=command_transport)
    wake = agent.buffer.wake  # set by a full buffer, and by the signal handler

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            stop_event.set()
            wake.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        agent.start()
    except BaseException:
        for num, handler in previous.items():
            signal.signal(num, handler)
        raise
    try:
        while not stop_event.is_set() and not agent.node_lost.is_set():
            wait = agent.step()
            # Wake early for a full batch; never sleep past a flush so an external stop_event is
            # seen within one flush interval.
            wake.wait(min(wait, config.flush_interval_s))
    finally:
        agent.stop()
        for num, handler in previous.items():
            signal.signal(num, handler)
        if agent.node_lost.is_set() and agent.commands is not None:
            # A Ray-deployed agent lives under the raylet it killed: its own ancestors go last, now.
            kill = getattr(agent.commands.executor, "kill_own_ancestors", None)
            if kill is not None:
                kill()
    return agent.node_lost.is_set()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vigil agent", description="Per-node Vigil agent: rank telemetry, node metrics, heartbeats."
    )
    p.add_argument("--node-id", help="Node this agent watches: its Ray node name, or Ray node id (default: found "
                   "from this host's raylet, its --node-name or else its node id).")
    p.add_argument("--agent-id", help="Agent identity for batch numbering (default: HOSTNAME-NODEID).")
    p.add_argument(
        "--controller",
        dest="controller_url",
        help="Controller URL, or several comma-separated (controllers sharing one PostgreSQL database; "
        "the agent fails over between them). Default: VIGIL_CONTROLLER_URL.",
    )
    p.add_argument(
        "--token",
        default=next((os.environ[n] for n in TOKEN_ENVS if os.environ.get(n)), None),
        help="Agent bearer token (default: $VIGIL_AGENT_TOKEN, else $VIGIL_TOKEN; the environment keeps it out of `ps`).",
    )
    p.add_argument("--run-dir", type=Path, help="Node-local runtime folder (default: VIGIL_RUN_DIR).")
    p.add_argument("--socket", dest="socket_path", type=Path, help="Rank datagram socket path.")
    p.add_argument("--socket-group", type=int,
                   help="Group id of the rank socket (the ranks' user's group, when they run as another user).")
    p.add_argument("--spool-dir", type=Path, help="Disk spool folder.")
    p.add_argument("--spool-max-bytes", type=int, help="Spool bound in bytes (default 256 MiB).")
    p.add_argument("--flush-interval", dest="flush_interval_s", type=float, help="Seconds (default 0.5).")
    p.add_argument(
        "--heartbeat-interval", dest="heartbeat_interval_s", type=float, help="Seconds (default 1)."
    )
    p.add_argument(
        "--max-batch-items", type=int, help=f"Samples per batch (default 2000, max {MAX_TELEMETRY_ITEMS})."
    )
    p.add_argument("--address", help="Address to report in heartbeats (default: route to the controller).")
    p.add_argument(
        "--no-commands",
        dest="commands",
        action="store_const",
        const=False,
        help="Do not poll for commands (no kill / stop / py-spy / fault injection on this node).",
    )
    p.add_argument(
        "--storage-root",
        type=Path,
        help=f"Checkpoint storage; corrupt_files only writes under it (default ${ENV_STORAGE_PATH} or {DEFAULT_STORAGE_PATH}).",
    )
    p.add_argument(
        "--raylet-pid", type=int, help="This node's raylet pid (default: found by its --node-name)."
    )
    p.add_argument(
        "--ray-gcs-address",
        help="This node's Ray cluster (GCS host:port): only a raylet started for it is this node's, where "
        "several clusters on one host name their nodes alike (default: any raylet naming the node).",
    )
    p.add_argument(
        "--ray-start-pid", type=int, help="This node's `ray start --block` pid (killed with its session)."
    )
    p.add_argument(
        "--ray-join-cmd",
        type=_json_argv,
        help='argv as a JSON list (no shell) that starts this node\'s raylet again, e.g. \'["ray", "start", ...]\'.',
    )
    p.add_argument(
        "--pyspy-timeout", dest="pyspy_timeout_s", type=float, help="Seconds per py-spy dump (default 10)."
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _json_argv(text: str) -> list[str]:
    try:
        argv = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise argparse.ArgumentTypeError("must be a non-empty JSON list of strings")
    return argv


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    fields = {k: v for k, v in vars(args).items() if k != "log_level" and v is not None}
    if "node_id" not in fields:
        fields["node_id"] = discover_node_id(gcs_address=fields.get("ray_gcs_address"))  # ValueError naming why, for the caller to print
    return AgentConfig(**fields)


EXIT_NODE_KILLED = 3
"""Exit status after the agent killed its own node on command: whoever keeps agents alive (``vigil up``'s
keeper, a supervisor) must not start it again."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vigil agent`` (and ``python -m agent``). Returns the exit status (0; 1: could not
    start; 2: usage; :data:`EXIT_NODE_KILLED`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.token:
        print(
            "vigil agent: no token: set VIGIL_TOKEN (or pass --token) to a token with the agent role",
            file=sys.stderr,
        )
        return 2
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        parser.error(str(exc))
    except ValueError as exc:  # no --node-id, and no single raylet on this host to take it from
        parser.error(f"--node-id: {exc}")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        logging.getLogger("agent").setLevel(args.log_level)
    started = time.monotonic()
    try:
        lost = run_agent(config, threading.Event())
    except (SocketInUseError, SpoolLockedError, FileExistsError, PermissionError) as exc:
        log.error("agent cannot start: %s", exc)
        return 1
    log.info("agent ran %.1fs%s", time.monotonic() - started, "; its node was killed" if lost else "")
    return EXIT_NODE_KILLED if lost else 0
