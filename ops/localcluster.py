"""``vigil up``: a real multi-node Vigil on one machine.

A Ray head plus N worker raylets (``ray start --block``, each its own node id and a
``vigil_node_<i>`` resource), one ``vigil agent`` per node, and the controller (with the dashboard)
as child processes. Every child runs in its own session so that stopping it stops its whole process
tree; the pids are written to ``<home>/run/pids.json`` so that a crashed run's leftovers are
cleaned by the next ``vigil up``.

On PostgreSQL, ``standby_controllers`` more controllers run on other ports against the same database:
the first one started holds the leader lock (controller/leader.py), the others take over when it dies,
and every agent is given all their URLs and fails over between them (agent/failover.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Self

import httpx

from controller.rankuser import Isolation, isolate
from ops.agentkeeper import AgentKeeper, raylet_running
from ops.netns import LinkSpec, NetnsCluster
from ops.netns import cleanup_stale as cleanup_stale_netns
from ops.processes import Child, ProcessGroup, clean_stale, kill_session  # noqa: F401 - re-exported
from vigil.contract.checkpoint_layout import is_uri
from vigil.contract.probe import free_port, wait_for
from vigil.contract.settings import SECRET_ENVS, Settings, agent_socket_path, child_env

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Below this many files Ray's log monitor lists the session's log folder again on every 0.1 s pass; at 0
    # it does so every 0.5 s (its LOG_NAME_UPDATE_INTERVAL_S): new workers' output still reaches their
    # driver, for a fraction of the CPU (docs/BENCHMARKS.md, "Local cluster footprint").
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}
"""Ray's settings for a cluster of several raylets on one machine (vigil up, the attached test clusters); the
operator's environment wins over them."""


def ensure_ray_token() -> None:
    """Turn on Ray token authentication for this process and its children, creating a token if none exists."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        log.warning("RAY_AUTH_MODE=disabled: the Ray cluster runs without token authentication")
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.exists():
        import secrets

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        log.info("created Ray auth token at %s", path)


@dataclass
class LocalCluster:
    """Handles on a running local Vigil (what tests and ``vigil up`` need)."""

    home: Path
    controller_url: str
    ray_address: str
    dashboard_url: str
    node_ids: list[str]
    procs: ProcessGroup
    ray_temp_dir: Path
    run_dir: Path
    controller_urls: list[str] = field(default_factory=list)
    """Every controller (the first started, the leader at start, first; then the standbys); the agents know them all."""
    controller_names: list[str] = field(default_factory=list)
    """Their children's names in :attr:`procs`, in the same order (``controller``, ``controller-1``, ...)."""
    admin_token: str = field(default="", repr=False)
    """The admin token (also in :attr:`admin_token_path`, mode 0600)."""
    admin_token_path: Path | None = None
    database_url: str = ""
    agent_token_ids: tuple[str, ...] = ()
    """The agents' tokens (one per node), revoked when the cluster stops."""
    netns: NetnsCluster | None = None
    """The namespaces of ``vigil up --netns`` (None: every node on the host's own network)."""
    storage: Path | str | None = None
    """The jobs' checkpoint storage (``VIGIL_STORAGE_PATH`` of every process): a folder or a URI."""
    rank_user: str | None = None
    """The user the ranks run as (controller/rankuser.py); None: this process's own."""
    keeper: AgentKeeper | None = None
    """Starts a dead agent again while its node's raylet runs (ops/agentkeeper.py)."""

    def stop(self, discard_storage: bool = False) -> None:
        """Stop every process; ``discard_storage``: also remove the checkpoints (tests)."""
        if self.keeper is not None:
            self.keeper.stop()
        self.procs.stop_all()
        if discard_storage and self.storage is not None and not is_uri(self.storage):
            shutil.rmtree(self.storage, ignore_errors=True)
        if self.netns is not None:
            self.netns.destroy()  # namespaces, veths, bridge, qdiscs, and any process left inside
        shutil.rmtree(self.ray_temp_dir, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.database_url:
            _revoke(self.database_url, self.agent_token_ids)  # its agents are gone

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _revoke(database_url: str, token_ids: Sequence[str]) -> None:
    from sqlalchemy.exc import SQLAlchemyError

    from controller.db import make_engine, make_session_factory, session_scope
    from controller.tokens import revoke_token

    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            for token_id in token_ids:
                revoke_token(session, token_id)
    except (SQLAlchemyError, OSError) as exc:  # the database may be gone; the tokens then are too
        log.warning("could not revoke the agents' tokens %s: %s", ", ".join(token_ids), exc)
    finally:
        engine.dispose()


def _bootstrap(home: Path, database_url: str, node_ids: Sequence[str]):  # type: ignore[no-untyped-def]
    """Schema and tokens before any process starts: the admin token file and this run's agent tokens."""
    from controller import migrate
    from controller.auth import bootstrap_tokens
    from controller.db import make_engine, make_session_factory

    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        return bootstrap_tokens(make_session_factory(engine), home, node_ids)
    finally:
        engine.dispose()


def node_name(i: int) -> str:
    """The Ray node name (and Vigil node id) of local node ``i``; the head is node 0."""
    return f"vigil-node-{i}"


def _ray_nodes(dashboard_url: str) -> dict[str, str]:
    """Node name -> Ray node id, for Vigil's nodes that are alive."""
    from ray.util.state import list_nodes

    return {n.node_name: n.node_id for n in list_nodes(address=dashboard_url, raise_on_missing_output=False)
            if n.state == "ALIVE" and n.node_name.startswith("vigil-node-")}


def _start_node_with_retries(
    procs: ProcessGroup, name: str, argv: list[str], env: dict[str, str], log_dir: Path, dashboard_url: str,
    timeout: float, attempts: int = 3,
) -> None:
    resource = name.replace("ray-node-", "vigil-node-")
    for attempt in range(1, attempts + 1):
        child = procs.start(name, argv, env, log_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                break
            try:
                if resource in _ray_nodes(dashboard_url):
                    return
            except Exception as exc:  # noqa: BLE001 - the dashboard busy or still starting: ask again
                log.debug("%s: Ray's dashboard did not answer (%s)", name, exc)
            time.sleep(0.5)
        log.warning("%s did not register (attempt %d/%d); see %s", name, attempt, attempts, child.log_path)
        procs.stop_child(child)
    raise TimeoutError(f"{name} did not join the Ray cluster after {attempts} attempts; see {log_dir}")


def agent_extra_args(node_id: str, join_cmds: dict[str, list[str]], storage: Path | str,
                     procs: ProcessGroup) -> list[str]:
    """Flags for the agent's recovery commands: where checkpoints live (a local folder: on object storage
    the agent touches no checkpoint), its raylet, how it rejoins."""
    extra = [] if is_uri(storage) else ["--storage-root", str(storage)]
    if node_id in join_cmds:
        extra += ["--ray-join-cmd", json.dumps(join_cmds[node_id])]
    ray_start = next((c for c in procs.children if c.name == f"ray-node-{node_id.rsplit('-', 1)[1]}"), None)
    if ray_start is not None:
        extra += ["--ray-start-pid", str(ray_start.proc.pid)]
    return extra


def start_local_cluster(
    home: Path,
    *,
    nodes: int = 2,
    cpus_per_node: int = 2,
    port: int = 8000,
    database_url: str | None = None,
    object_store_bytes: int = 150 * 1024 * 1024,
    run_dir: Path | None = None,
    timeout: float = 120.0,
    netns: bool = False,
    link: LinkSpec | None = None,
    standby_controllers: int = 0,
    ray_defaults: bool = False,
) -> LocalCluster:
    """Start head + ``nodes`` worker raylets, the controller and one agent per node; wait until all are up.

    ``standby_controllers``: that many more controllers, on free ports, against the same database, which
    must then be PostgreSQL (``database_url``); they wait for the leader lock while the first one holds
    it. The agents get every controller's URL (``VIGIL_CONTROLLER_URL`` and ``--controller``, comma-separated).

    ``netns``: every worker node (raylet and agent) in its own network namespace with a veth ``eth0``
    shaped as ``link`` (ops/netns.py); the head, the controller and the dashboard stay in the
    host's namespace, on 127.0.0.1 for the user and on the bridge address for the nodes. The head has
    no CPUs either way, so ranks run only on worker nodes (namespaced: where gloo uses ``eth0``).
    Without root (or ``ip``/``tc``) it says why in one line and starts the plain cluster.

    ``ray_defaults``: Ray as it starts by default, without :data:`RAY_ENV` and with a log monitor on every
    raylet: the baseline of ``vigil bench footprint``.
    """
    _check_standbys(standby_controllers, database_url)
    home = home.resolve()
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="vigil-run-", dir="/tmp"))
    run_dir.chmod(0o755)  # the ranks reach their agent's socket in it (the agent refuses it writable by others)
    pid_file = home / "run" / "pids.json"
    clean_stale(pid_file)
    cleanup_stale_netns(home)  # a crashed run's namespaces, veths and bridge (whether or not this one uses them)
    ensure_ray_token()
    # Short, private temp dir: Ray's unix socket paths must stay under 108 bytes.
    ray_temp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    iso = _isolate(home, ray_temp)
    net = _create_netns(home, nodes, link) if netns else None
    db_url = database_url or f"sqlite:///{home / 'vigil.db'}"
    tokens = _bootstrap(home, db_url, [node_name(i) for i in range(nodes + 1)])
    c = _Launch.plan(home, run_dir, ProcessGroup(pid_file), iso, net, ray_temp, port, standby_controllers,
                     timeout, ray_env={} if ray_defaults else RAY_ENV)
    node_ids = [node_name(i) for i in range(nodes + 1)]
    try:
        _start_ray(c, nodes, cpus_per_node, object_store_bytes, one_log_monitor=not ray_defaults)
        vigil_env = _vigil_env(c, database_url)
        _start_controllers(c, vigil_env)
        _start_agents(c, vigil_env, node_ids, tokens.agents)
        auth = {"Authorization": f"Bearer {tokens.admin}"}
        wait_for(lambda: httpx.get(f"{c.controller_url}/api/v1/nodes", headers=auth, timeout=2).json()["count"]
                 >= nodes + 1, timeout, "every agent's first heartbeat", 0.5, (Exception,))
    except BaseException:
        c.procs.stop_all()
        if net is not None:
            net.destroy()
        shutil.rmtree(ray_temp, ignore_errors=True)
        _revoke(db_url, tokens.agent_token_ids)
        raise
    keeper = AgentKeeper(c.procs, {f"agent-{i}": node_id for i, node_id in enumerate(node_ids)},
                         raylet_alive=partial(raylet_running, gcs_address=c.gcs_address))
    keeper.start()
    return LocalCluster(home, c.controller_url, c.gcs_address, c.dashboard_url, node_ids, c.procs, ray_temp,
                        run_dir, controller_urls=c.controller_urls, controller_names=c.controller_names,
                        admin_token=tokens.admin, admin_token_path=tokens.admin_path, database_url=db_url,
                        agent_token_ids=tokens.agent_token_ids, netns=net, storage=iso.storage,
                        rank_user=iso.user.name if iso.user else None, keeper=keeper)


def _check_standbys(standby_controllers: int, database_url: str | None) -> None:
    if standby_controllers < 0:
        raise ValueError(f"standby_controllers must be >= 0, got {standby_controllers}")
    if standby_controllers and not (database_url or "").startswith(("postgresql", "postgres:")):
        raise ValueError("standby_controllers needs a PostgreSQL database_url (controllers share a database and "
                         "take turns under its advisory lock; SQLite serves one controller)")


def _isolate(home: Path, ray_temp: Path) -> Isolation:
    """As root, every raylet (so every rank and job driver) runs as an unprivileged user of its own; the
    home, 0700, keeps the admin token and the database from it (controller/rankuser.py)."""
    settings = Settings(home=home)
    try:
        uri = settings.resolved_storage() if is_uri(settings.storage_path) else None
        return isolate(home, ray_temp, uri or settings.storage_path,
                       home / "storage" if uri else settings.resolved_storage_path())
    except BaseException:
        shutil.rmtree(ray_temp, ignore_errors=True)
        raise


@dataclass
class _Launch:
    """What starting the cluster's processes shares: where they log, their environment, ports and URLs."""

    home: Path
    run_dir: Path
    log_dir: Path
    procs: ProcessGroup
    iso: Isolation
    net: NetnsCluster | None
    ray_temp: Path
    timeout: float
    base: dict[str, str]
    """This process's environment, less the secrets, plus the rank user's: the Vigil processes'."""
    env: dict[str, str]
    """The raylets' environment (their workers are the jobs' ranks)."""
    gcs_port: int
    dash_port: int
    port: int
    ports: list[int]
    controller_names: list[str]
    head_ip: str
    """Where the nodes reach the head and the controllers: loopback, or the bridge from a namespace."""
    join_cmds: dict[str, list[str]] = field(default_factory=dict)
    ray_bin: str = field(default_factory=lambda: str(Path(sys.executable).parent / "ray"))

    @classmethod
    def plan(cls, home: Path, run_dir: Path, procs: ProcessGroup, iso: Isolation, net: NetnsCluster | None,
             ray_temp: Path, port: int, standby_controllers: int, timeout: float,
             ray_env: dict[str, str] = RAY_ENV) -> _Launch:
        gcs_port, dash_port = free_port(), free_port()
        base = {**ray_env, **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **iso.env}
        for name in SECRET_ENVS:  # from the user's shell: each child gets exactly the token it needs
            base.pop(name, None)
        # The raylets' environment from an allowlist, never a copy of the operator's: no VIGIL_HOME,
        # database URL or token reaches a rank (docs/SECURITY.md).
        env = child_env(base)
        ports = [port, *(free_port() for _ in range(standby_controllers))]
        names = ["controller", *(f"controller-{i}" for i in range(1, len(ports)))]
        return cls(home, run_dir, home / "logs", procs, iso, net, ray_temp, timeout, base, env, gcs_port, dash_port,
                   port, ports, names, net.gateway if net else LOOPBACK)

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.dash_port}"

    @property
    def controller_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def controller_urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{p}" for p in self.ports]

    @property
    def node_controller_urls(self) -> str:
        return ",".join(f"http://{self.head_ip}:{p}" for p in self.ports)

    @property
    def gcs_address(self) -> str:
        return f"{self.head_ip}:{self.gcs_port}"


def _start_ray(c: _Launch, nodes: int, cpus_per_node: int, object_store_bytes: int, one_log_monitor: bool = True) -> None:
    """The Ray head, then the worker raylets one by one (their ``ray start`` in ``c.join_cmds``)."""
    common = ["--block", f"--object-store-memory={object_store_bytes}", "--disable-usage-stats"]
    # The head runs no ranks (as Ray advises for real clusters): it holds the GCS, every job's driver
    # and Ray Train controller, and is the one node Vigil never evicts (recovery/actions.py).
    head_cpus = 0
    c.procs.start("ray-head", [*c.iso.drop, c.ray_bin, "start", "--head", f"--port={c.gcs_port}",
                               f"--temp-dir={c.ray_temp}", "--include-dashboard=true", f"--dashboard-host={LOOPBACK}",
                               f"--dashboard-port={c.dash_port}", "--resources", json.dumps({"vigil_node_0": 1}),
                               f"--node-name={node_name(0)}", f"--num-cpus={head_cpus}",
                               f"--node-ip-address={c.head_ip}", *common, *_agent_port(),
                               # Not Ray's fixed 10001: another head on the host, run by another user, holds it.
                               f"--ray-client-server-port={free_port()}"], c.env, c.log_dir)
    wait_for(lambda: _ray_nodes(c.dashboard_url).get(node_name(0)), c.timeout, "the Ray head", 0.5, (Exception,))
    # One node at a time: Ray gives a raylet 30 s to register with the GCS, which an overloaded
    # machine can miss; a node whose `ray start` gave up is started again.
    for i in range(1, nodes + 1):
        argv = [*c.iso.drop, c.ray_bin, "start", f"--address={c.gcs_address}", f"--node-name={node_name(i)}",
                "--resources", json.dumps({f"vigil_node_{i}": 1}), f"--num-cpus={cpus_per_node}", *common,
                *_agent_port()]
        node_env = c.env
        if c.net:
            # Its own address and temp dir (a second raylet sharing the head's does not register);
            # gloo on its eth0 (Ray's workers, the ranks, inherit the raylet's environment).
            argv += [f"--node-ip-address={c.net.node(i).address}", f"--temp-dir={c.ray_temp}/n{i}"]
            node_env = dict(c.env, GLOO_SOCKET_IFNAME=c.net.node(i).iface)
        else:
            # One log monitor per host, the head's, as Ray asks: every raylet here writes to the head's
            # session folder, and each monitor would hand every worker's output to its driver again (a
            # job's log showed each rank's line once per node).
            argv += [f"--node-ip-address={LOOPBACK}", *(["--include-log-monitor=false"] if one_log_monitor else [])]
        c.join_cmds[node_name(i)] = argv  # the agent runs it from inside the node's namespace
        _start_node_with_retries(c.procs, f"ray-node-{i}", c.net.node(i).exec_argv(argv) if c.net else argv,
                                 node_env, c.log_dir, c.dashboard_url, c.timeout)


def _vigil_env(c: _Launch, database_url: str | None) -> dict[str, str]:
    """The environment of the controllers and the agents."""
    vigil_env = dict(c.base, VIGIL_HOME=str(c.home), VIGIL_RAY_ADDRESS=c.dashboard_url, VIGIL_PORT=str(c.port),
                     VIGIL_CONTROLLER_URL=c.controller_url, VIGIL_RUN_DIR=str(c.run_dir),
                     VIGIL_RAY_GCS_ADDRESS=c.gcs_address,
                     VIGIL_STORAGE_PATH=str(c.iso.storage))
    if database_url:
        vigil_env["VIGIL_DATABASE_URL"] = database_url
    return vigil_env


VIGIL = [sys.executable, "-m", "ops.cli"]
"""The ``vigil`` command, from this interpreter."""


def _start_controllers(c: _Launch, vigil_env: dict[str, str]) -> None:
    """The first controller alone until it answers: it takes the leader lock before its API is up, so it
    leads and the standbys started after it wait."""
    listen = ["--extra-host", c.head_ip, "--allow-remote"] if c.net else []
    for name, p, url in zip(c.controller_names, c.ports, c.controller_urls, strict=True):
        c.procs.start(name, [*VIGIL, "controller", "--port", str(p), *listen],
                      dict(vigil_env, VIGIL_PORT=str(p), VIGIL_CONTROLLER_URL=url), c.log_dir)
        wait_for(partial(_answers, url), c.timeout, f"the controller on {url}", 0.5, (Exception,))


def _start_agents(c: _Launch, vigil_env: dict[str, str], node_ids: list[str], tokens: dict[str, str]) -> None:
    """One agent per node, each with its own node's token (by env: a --token would show in `ps`)."""
    agents_url = ",".join(c.controller_urls)
    for i, node_id in enumerate(node_ids):
        agent_env = dict(vigil_env, VIGIL_TOKEN=tokens[node_id], VIGIL_CONTROLLER_URL=agents_url)
        url = c.node_controller_urls if c.net and i > 0 else agents_url
        argv = [*VIGIL, "agent", "--node-id", node_id, "--controller", url,
                "--ray-gcs-address", c.gcs_address,  # another cluster here may name its nodes alike
                "--socket", str(agent_socket_path(c.run_dir, node_id)),
                "--spool-dir", str(c.home / "spool" / node_id),
                *agent_extra_args(node_id, c.join_cmds, c.iso.storage, c.procs)]
        if c.iso.user is not None:
            argv += ["--socket-group", str(c.iso.user.gid)]  # its ranks (the rank user) may write to its socket
        if c.net and i > 0:
            # Inside the node's namespace: its heartbeats carry that node's eth0 counters, and its
            # network faults shape that eth0 (agent/netfaults.py), restoring `link` on clear.
            c.procs.start(f"agent-{i}", c.net.node(i).exec_argv(argv),
                          dict(agent_env, VIGIL_CONTROLLER_URL=url, VIGIL_NIC_IFACE=c.net.node(i).iface,
                               VIGIL_NIC_LINK=c.net.link.to_json(),
                               # The raylet it starts again on readmission (and so the ranks there) use
                               # gloo on eth0 like the first one, not loopback, which the peers cannot reach.
                               GLOO_SOCKET_IFNAME=c.net.node(i).iface), c.log_dir)
        else:
            c.procs.start(f"agent-{i}", argv, agent_env, c.log_dir)


def _answers(url: str) -> bool:
    """Whether the controller at ``url`` answers its health check."""
    return httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200


def _agent_port() -> list[str]:
    """A free port for the node's Ray dashboard agent. Its default (52365) is one per host: a second
    cluster's head then gets no agent HTTP server (its agent also binds 127.0.0.1), and Ray refuses
    every job submission with "No available agent to submit job"."""
    return [f"--dashboard-agent-listen-port={free_port()}"]


def _create_netns(home: Path, nodes: int, link: LinkSpec | None) -> NetnsCluster | None:
    """The namespaces of ``vigil up --netns``, or None (with one line saying why) where they cannot be made."""
    from ops import netns

    reason = netns.unavailable_reason()
    if reason:
        log.warning("--netns: %s; starting the plain local cluster instead", reason)
        return None
    return netns.create(home, nodes, link)
