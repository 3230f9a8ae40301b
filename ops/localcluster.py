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

from controller.checkpoint_layout import is_uri
from controller.probe import free_port, wait_for
from controller.rankuser import isolate
from controller.settings import SECRET_ENVS, Settings, agent_socket_path, child_env
from ops.agentkeeper import AgentKeeper, raylet_running
from ops.netns import LinkSpec, NetnsCluster
from ops.netns import cleanup_stale as cleanup_stale_netns
from ops.processes import Child, ProcessGroup, clean_stale, kill_session  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


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
    """
    if standby_controllers < 0:
        raise ValueError(f"standby_controllers must be >= 0, got {standby_controllers}")
    if standby_controllers and not (database_url or "").startswith(("postgresql", "postgres:")):
        raise ValueError("standby_controllers needs a PostgreSQL database_url (controllers share a database and "
                         "take turns under its advisory lock; SQLite serves one controller)")
    home = home.resolve()
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="vigil-run-", dir="/tmp"))
    run_dir.chmod(0o755)  # the ranks reach their agent's socket in it (the agent refuses it writable by others)
    log_dir = home / "logs"
    pid_file = home / "run" / "pids.json"
    clean_stale(pid_file)
    cleanup_stale_netns(home)  # a crashed run's namespaces, veths and bridge (whether or not this one uses them)
    ensure_ray_token()
    # Short, private temp dir: Ray's unix socket paths must stay under 108 bytes.
    ray_temp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    # As root, every raylet (so every rank and job driver) runs as an unprivileged user of its own; the
    # home, 0700, keeps the admin token and the database from it (controller/rankuser.py).
    settings = Settings(home=home)
    try:
        uri = settings.resolved_storage() if is_uri(settings.storage_path) else None
        iso = isolate(home, ray_temp, uri or settings.storage_path, home / "storage" if uri else settings.resolved_storage_path())
    except BaseException:
        shutil.rmtree(ray_temp, ignore_errors=True)
        raise
    net = _create_netns(home, nodes, link) if netns else None
    db_url = database_url or f"sqlite:///{home / 'vigil.db'}"
    tokens = _bootstrap(home, db_url, [node_name(i) for i in range(nodes + 1)])
    auth = {"Authorization": f"Bearer {tokens.admin}"}

    procs = ProcessGroup(pid_file)
    gcs_port, dash_port = free_port(), free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    base = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **iso.env)
    for name in SECRET_ENVS:  # from the user's shell: each child gets exactly the token it needs
        base.pop(name, None)
    # The raylets' environment (their workers are the jobs' ranks) from an allowlist, never a copy of the
    # operator's: no VIGIL_HOME, database URL or token reaches a rank (docs/SECURITY.md).
    env = child_env(base)
    dashboard_url = f"http://{LOOPBACK}:{dash_port}"
    controller_url = f"http://{LOOPBACK}:{port}"
    ports = [port, *(free_port() for _ in range(standby_controllers))]
    controller_urls = [f"http://{LOOPBACK}:{p}" for p in ports]
    controller_names = ["controller", *(f"controller-{i}" for i in range(1, len(ports)))]
    # Where the nodes reach the head and the controllers: loopback, or the bridge from a namespace.
    head_ip = net.gateway if net else LOOPBACK
    node_controller_urls = ",".join(f"http://{head_ip}:{p}" for p in ports)
    join_cmds: dict[str, list[str]] = {}
    try:
        common = ["--block", f"--object-store-memory={object_store_bytes}", "--disable-usage-stats"]
        # The head runs no ranks (as Ray advises for real clusters): it holds the GCS, every job's driver
        # and Ray Train controller, and is the one node Vigil never evicts (recovery/actions.py).
        head_cpus = 0
        procs.start("ray-head", [*iso.drop, ray_bin, "start", "--head", f"--port={gcs_port}", f"--temp-dir={ray_temp}",
                                 "--include-dashboard=true", f"--dashboard-host={LOOPBACK}",
                                 f"--dashboard-port={dash_port}", "--resources", json.dumps({"vigil_node_0": 1}),
                                 f"--node-name={node_name(0)}", f"--num-cpus={head_cpus}",
                                 f"--node-ip-address={head_ip}", *common, *_agent_port(),
                                 # Not Ray's fixed 10001: another head on the host, run by another user, holds it.
                                 f"--ray-client-server-port={free_port()}"], env, log_dir)
        wait_for(lambda: _ray_nodes(dashboard_url).get(node_name(0)), timeout, "the Ray head", 0.5, (Exception,))
        # One node at a time: Ray gives a raylet 30 s to register with the GCS, which an overloaded
        # machine can miss; a node whose `ray start` gave up is started again.
        for i in range(1, nodes + 1):
            argv = [*iso.drop, ray_bin, "start", f"--address={head_ip}:{gcs_port}", f"--node-name={node_name(i)}",
                    "--resources", json.dumps({f"vigil_node_{i}": 1}), f"--num-cpus={cpus_per_node}", *common,
                    *_agent_port()]
            node_env = env
            if net:
                # Its own address and temp dir (a second raylet sharing the head's does not register);
                # gloo on its eth0 (Ray's workers, the ranks, inherit the raylet's environment).
                argv += [f"--node-ip-address={net.node(i).address}", f"--temp-dir={ray_temp}/n{i}"]
                node_env = dict(env, GLOO_SOCKET_IFNAME=net.node(i).iface)
            else:
                argv.append(f"--node-ip-address={LOOPBACK}")
            join_cmds[node_name(i)] = argv  # the agent runs it from inside the node's namespace
            _start_node_with_retries(procs, f"ray-node-{i}", net.node(i).exec_argv(argv) if net else argv,
                                     node_env, log_dir, dashboard_url, timeout)
        node_ids = [node_name(i) for i in range(nodes + 1)]

        vigil_env = dict(base, VIGIL_HOME=str(home), VIGIL_RAY_ADDRESS=dashboard_url, VIGIL_PORT=str(port),
                         VIGIL_CONTROLLER_URL=controller_url, VIGIL_RUN_DIR=str(run_dir),
                         VIGIL_RAY_GCS_ADDRESS=f"{head_ip}:{gcs_port}",
                         VIGIL_STORAGE_PATH=str(iso.storage))
        if database_url:
            vigil_env["VIGIL_DATABASE_URL"] = database_url
        vigil = [sys.executable, "-m", "ops.cli"]
        listen = ["--extra-host", head_ip, "--allow-remote"] if net else []
        # The first controller alone until it answers: it takes the leader lock before its API is up,
        # so it leads and the standbys started after it wait.
        for name, p, url in zip(controller_names, ports, controller_urls, strict=True):
            procs.start(name, [*vigil, "controller", "--port", str(p), *listen],
                        dict(vigil_env, VIGIL_PORT=str(p), VIGIL_CONTROLLER_URL=url), log_dir)
            wait_for(partial(_answers, url), timeout, f"the controller on {url}", 0.5, (Exception,))
        agents_url = ",".join(controller_urls)
        for i, node_id in enumerate(node_ids):
            # Each agent its own node's token, by env: a --token would show in `ps`.
            agent_env = dict(vigil_env, VIGIL_TOKEN=tokens.agents[node_id], VIGIL_CONTROLLER_URL=agents_url)
            url = node_controller_urls if net and i > 0 else agents_url
            argv = [*vigil, "agent", "--node-id", node_id, "--controller", url,
                    "--ray-gcs-address", f"{head_ip}:{gcs_port}",  # another cluster here may name its nodes alike
                    "--socket", str(agent_socket_path(run_dir, node_id)),
                    "--spool-dir", str(home / "spool" / node_id), *agent_extra_args(node_id, join_cmds, iso.storage, procs)]
            if iso.user is not None:
                argv += ["--socket-group", str(iso.user.gid)]  # its ranks (the rank user) may write to its socket
            if net and i > 0:
                # Inside the node's namespace: its heartbeats carry that node's eth0 counters, and its
                # network faults shape that eth0 (agent/netfaults.py), restoring `link` on clear.
                procs.start(f"agent-{i}", net.node(i).exec_argv(argv),
                            dict(agent_env, VIGIL_CONTROLLER_URL=url, VIGIL_NIC_IFACE=net.node(i).iface,
                                 VIGIL_NIC_LINK=net.link.to_json(),
                                 # The raylet it starts again on readmission (and so the ranks there) use
                                 # gloo on eth0 like the first one, not loopback, which the peers cannot reach.
                                 GLOO_SOCKET_IFNAME=net.node(i).iface), log_dir)
            else:
                procs.start(f"agent-{i}", argv, agent_env, log_dir)
        wait_for(lambda: httpx.get(f"{controller_url}/api/v1/nodes", headers=auth, timeout=2).json()["count"]
                 >= nodes + 1, timeout, "every agent's first heartbeat", 0.5, (Exception,))
    except BaseException:
        procs.stop_all()
        if net is not None:
            net.destroy()
        shutil.rmtree(ray_temp, ignore_errors=True)
        _revoke(db_url, tokens.agent_token_ids)
        raise
    keeper = AgentKeeper(procs, {f"agent-{i}": node_id for i, node_id in enumerate(node_ids)},
                         raylet_alive=partial(raylet_running, gcs_address=f"{head_ip}:{gcs_port}"))
    keeper.start()
    return LocalCluster(home, controller_url, f"{head_ip}:{gcs_port}", dashboard_url, node_ids, procs, ray_temp,
                        run_dir, controller_urls=controller_urls, controller_names=controller_names,
                        admin_token=tokens.admin, admin_token_path=tokens.admin_path, database_url=db_url,
                        agent_token_ids=tokens.agent_token_ids, netns=net, storage=iso.storage,
                        rank_user=iso.user.name if iso.user else None, keeper=keeper)


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
