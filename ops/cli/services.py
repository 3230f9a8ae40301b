"""Running Vigil: ``vigil up`` (a local multi-node Vigil with the demo job), ``vigil controller``,
``vigil agent``, ``vigil dashboard`` and ``vigil db``."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.cli.jobs import demo_job_spec, follow_job, load_job_file
from vigil.contract.client import VigilClient
from vigil.contract.schemas import FaultCreate, FaultKind
from vigil.contract.settings import Settings, admin_token_path, get_settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ops.localcluster import LocalCluster

log = logging.getLogger("vigil")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def remote_dashboard(host: str, settings: Any) -> dict[str, Any]:
    """Settings to change when the controller binds ``host``: reachable from other hosts, its mounted dashboard
    shows nothing before a browser signs in (no reads on the dashboard's own viewer token)."""
    if host in LOOPBACK_HOSTS or not settings.auth_enabled or settings.dashboard_token is not None:
        return {}
    log.warning("binding %s: the dashboard asks a browser to sign in (any reading token) before showing anything", host)
    return {"dashboard_open_reads": False}


def cmd_controller(args: argparse.Namespace) -> int:
    import uvicorn

    from controller.app import create_app
    from controller.http_protocol import HeaderDeadlineProtocol
    from ops.dashboard_mount import mount_dashboard

    settings = get_settings()
    host = args.host or settings.host
    port = args.port or settings.port
    hosts = [host, *(h for h in args.extra_host or [] if h != host)]
    for h in hosts:
        if h in LOOPBACK_HOSTS:
            continue
        if not args.allow_remote:
            print(f"vigil controller: refusing to bind {h} (reachable from other hosts) without --allow-remote",
                  file=sys.stderr)
            return 2
        log.warning("binding %s: the controller and its dashboard are reachable from other hosts", h)
        if not settings.auth_enabled:
            log.warning("VIGIL_AUTH_ENABLED=false on %s: ANYONE who reaches port %d can submit, cancel and read "
                        "everything", h, port)
    attach = {k: v for k, v in (("ray_address", args.ray_address), ("ray_gcs_address", args.ray_gcs_address),
                                ("deploy_agents", args.deploy_agents or None)) if v is not None}
    settings = settings.model_copy(update={"host": host, "port": port, **remote_dashboard(host, settings), **attach})
    if settings.deploy_agents and not settings.ray_gcs_address:
        print("vigil controller: --deploy-agents needs --ray-gcs-address (or VIGIL_RAY_GCS_ADDRESS): the Ray "
              "cluster whose nodes get agents", file=sys.stderr)
        return 2
    workers = getattr(args, "workers", 1) or 1
    if workers > 1:
        if len(hosts) > 1:
            print("vigil controller: --workers with --extra-host is not supported", file=sys.stderr)
            return 2
        return _run_workers(settings, workers)
    mounts = [mount_dashboard]  # the dashboard under /dashboard, where / redirects
    if len(hosts) == 1:
        uvicorn.run(create_app(settings, mounts=mounts), host=host, port=port, log_level="warning",
                    http=HeaderDeadlineProtocol)
        return 0
    # Several addresses (`vigil up --netns`: loopback for the user, the bridge for agents in namespaces).
    sockets = [_listen(h, port) for h in hosts]
    uvicorn.Server(uvicorn.Config(create_app(settings, mounts=mounts), log_level="warning", http=HeaderDeadlineProtocol)
                   ).run(sockets=sockets)
    return 0


#: The mounted dashboard's viewer token, shared by the workers (the parent makes it; never stored).
_WORKERS_DASHBOARD_SECRET = "VIGIL_WORKERS_DASHBOARD_SECRET"


def worker_app() -> FastAPI:
    """The app of one worker process (``--workers``): settings from the environment the parent set,
    migrations already run by the parent (workers starting together must not race on them).

    The mounted dashboard calls the API over HTTP and may reach any worker, so its in-process token
    (``mint_internal_token``) must be one that every worker knows: the parent's, from the environment.
    """
    import os

    from controller import tokens
    from controller.app import create_app
    from controller.tokens import Principal
    from ops.dashboard_mount import mount_dashboard
    from vigil.contract.schemas import Role

    settings = get_settings()
    secret = os.environ.get(_WORKERS_DASHBOARD_SECRET)
    shared = bool(secret) and settings.auth_enabled and settings.dashboard_token is None and settings.dashboard_open_reads
    if shared:
        settings = settings.model_copy(update={"dashboard_token": secret})
    app = create_app(settings, run_migrations=False, mounts=[mount_dashboard])
    if shared and secret:
        app.state.internal_tokens[tokens.hash_token(secret)] = Principal(token_id=None, role=Role.VIEWER,
                                                                          name="dashboard (mounted)")
    return app


def _run_workers(settings: Settings, workers: int) -> int:
    """``workers`` uvicorn worker processes sharing the listening sockets: telemetry ingest (decoding,
    validation) on as many cores. Each worker builds its own app (:func:`worker_app`); the leader
    lock (controller/leader.py: the advisory lock, or on SQLite a file lock) lets exactly one of them
    run the supervisor, the monitor and the aggregation."""
    import os

    import uvicorn

    from controller import migrate, tokens
    from controller.http_protocol import HeaderDeadlineProtocol

    migrate.upgrade(settings.resolved_database_url())
    os.environ[_WORKERS_DASHBOARD_SECRET] = tokens.new_secret()
    # The workers are new interpreters: they read their settings from the environment.
    os.environ["VIGIL_HOST"], os.environ["VIGIL_PORT"] = settings.host, str(settings.port)
    os.environ["VIGIL_DASHBOARD_OPEN_READS"] = "true" if settings.dashboard_open_reads else "false"
    uvicorn.run("ops.cli.services:worker_app", factory=True, workers=workers, host=settings.host,
                port=settings.port, log_level="warning", http=HeaderDeadlineProtocol)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # the proto: asyncio's TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def cmd_agent(args: argparse.Namespace, rest: list[str]) -> int:
    from agent.main import main as agent_main

    return agent_main(rest)


def cmd_dashboard(args: argparse.Namespace, rest: list[str]) -> int:
    from dashboard.app import main as dashboard_main

    return dashboard_main(rest)


def cmd_db(args: argparse.Namespace) -> int:
    from controller import migrate

    settings = get_settings()
    url = settings.resolved_database_url()
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision or "-1")
    elif args.action == "create-admin-token":
        return _create_admin_token(url, Path(settings.home))
    print(f"database at revision {migrate.current(url)}")
    return 0


def _create_admin_token(url: str, home: Path) -> int:
    """Straight on the database (the operator's way in when no admin token is at hand)."""
    from controller import migrate
    from controller.auth import ensure_admin_token
    from controller.db import make_engine, make_session_factory

    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        _token, created = ensure_admin_token(make_session_factory(engine), home)
    finally:
        engine.dispose()
    path = admin_token_path(home).resolve()
    print(f"{'created' if created else 'kept the valid'} admin token in {path} (mode 600); "
          "the CLI uses it when VIGIL_TOKEN is not set")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from controller.rankuser import RankUserError
    from ops.localcluster import start_local_cluster
    from ops.netns import LinkSpec, NetnsError

    settings = get_settings()
    home = Path(args.home or settings.home)
    try:
        link = LinkSpec(rate=args.link, latency=args.link_latency, jitter=args.link_jitter, loss=args.link_loss)
    except ValueError as exc:
        print(f"vigil up: {exc}", file=sys.stderr)
        return 2
    if args.standby < 0:
        print(f"vigil up --standby: must be >= 0, got {args.standby}", file=sys.stderr)
        return 2
    if args.standby and not (settings.database_url or "").startswith(("postgresql", "postgres:")):
        print("vigil up --standby: needs VIGIL_DATABASE_URL=postgresql+psycopg://... (controllers share a "
              "PostgreSQL database; SQLite serves one controller)", file=sys.stderr)
        return 2
    print(f"starting Vigil: Ray head + {args.nodes} worker node(s)" + (" in network namespaces" if args.netns else "")
          + f", agents, controller on port {args.port}"
          + (f" and {args.standby} standby controller(s)" if args.standby else "") + " ...", flush=True)
    try:
        cluster = start_local_cluster(home, nodes=args.nodes, cpus_per_node=args.cpus_per_node, port=args.port,
                                      database_url=settings.database_url, netns=args.netns, link=link,
                                      standby_controllers=args.standby)
    except NetnsError as exc:  # e.g. --link-latency on a kernel without sch_netem; nothing is left behind
        print(f"vigil up --netns: {exc}", file=sys.stderr)
        return 2
    except RankUserError as exc:  # root, but the ranks' user cannot be set up: nothing runs as root instead
        print(f"vigil up: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        _print_cluster(cluster, home)
        with VigilClient(cluster.controller_url, token=cluster.admin_token) as client:
            if not args.no_demo:
                _run_job(client, args, stop)
            if args.exit_after_job:
                return 0
            print("serving; Ctrl-C to stop", flush=True)
            while not stop.wait(1.0):
                pass
    finally:
        print("stopping Vigil ...", flush=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
        print("stopped", flush=True)
    return 0


def _print_cluster(cluster: LocalCluster, home: Path) -> None:
    """Where ``vigil up``'s cluster answers: the dashboard, the API, Ray, the standbys, the network, the token."""
    print(f"dashboard:  {cluster.controller_url}/dashboard/")
    print(f"REST API:   {cluster.controller_url}/api/v1/docs")
    print(f"Ray:        {cluster.dashboard_url}   logs: {home.resolve() / 'logs'}")
    if len(cluster.controller_urls) > 1:
        print(f"standby:    {', '.join(cluster.controller_urls[1:])} (take over when the leader dies)")
    if cluster.netns is not None:
        net = cluster.netns
        print(f"network:    bridge {net.bridge} {net.gateway}/{net.prefix_len}; "
              + ", ".join(f"{n.namespace} {n.address}" for n in net.nodes) + f"; link {net.link}")
    print(f"admin token: {cluster.admin_token_path} (the CLI reads it; or export VIGIL_TOKEN)")
    print(f"ranks:      run as {cluster.rank_user or 'this user (not root: cannot switch users)'}; "
          f"checkpoints in {cluster.storage}")


def _run_job(client: VigilClient, args: argparse.Namespace, stop: threading.Event) -> None:
    """Submit ``--job`` (or the demo, with its fault unless ``--no-fault``), follow it, report how it ended."""
    spec = load_job_file(Path(args.job)) if args.job else demo_job_spec()
    job = client.submit_job(spec)
    print(f"submitted {job.id} ({spec.name}); Ctrl-C stops everything")
    if not args.job and not args.no_fault:
        # The demo shows recovery too: a rank is killed (SIGKILL by its node's agent) midway;
        # Vigil names it, Ray Train restarts the ranks from the newest valid checkpoint.
        at = spec.steps // 2
        client.inject_fault(job.id, FaultCreate(kind=FaultKind.KILL_RANK, rank=1, step=at))
        print(f"fault injection: rank 1 will be killed at step {at} (--no-fault to skip)")
    job = follow_job(client, job.id, stop)
    if job.status.is_terminal():
        print(f"{job.id} {job.status.value}, loss {job.last_loss}" +
              (f": {job.message}" if job.message else ""), flush=True)
        for inc in client.job_incidents(job.id).data:
            print(f"incident {inc.id}: {inc.kind.value} node={inc.node_id} rank={inc.rank} "
                  f"{inc.status.value} - {inc.action}")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``up``, ``controller``, ``agent``, ``dashboard`` and ``db`` on ``sub``."""
    up = sub.add_parser("up", help="Start a local multi-node Vigil and run the demo job.")
    up.add_argument("--nodes", type=int, default=2, help="Worker nodes besides the head (default 2).")
    up.add_argument("--cpus-per-node", type=int, default=2,
                    help="Logical CPUs per worker node (the head runs no ranks; default 2).")
    up.add_argument("--port", type=int, default=8000, help="Controller and dashboard port (default 8000).")
    up.add_argument("--home", help="Working folder (default ./.vigil).")
    up.add_argument("--job", help="Job file to run instead of the bundled demo.")
    up.add_argument("--no-demo", action="store_true", help="Start the platform without submitting a job.")
    up.add_argument("--exit-after-job", action="store_true", help="Stop everything once the job has ended.")
    up.add_argument("--no-fault", action="store_true", help="Run the demo job without its injected fault.")
    up.add_argument("--standby", type=int, default=0, metavar="N",
                    help="N more controllers on the same PostgreSQL database (VIGIL_DATABASE_URL), on free ports; "
                         "one takes over when the leader dies (docs/RECOVERY.md, Two controllers).")
    up.add_argument("--netns", action="store_true",
                    help="Each worker node in its own network namespace with a shaped veth eth0 (Linux, root).")
    up.add_argument("--link", help="--netns: bandwidth of every node's link, each way (tc rate: 1gbit, 200mbit).")
    up.add_argument("--link-latency", help="--netns: added one-way delay (1ms; needs sch_netem in the kernel).")
    up.add_argument("--link-jitter", help="--netns: delay variation (0.2ms; with --link-latency).")
    up.add_argument("--link-loss", type=float, default=0.0, help="--netns: percent of packets lost on egress.")

    c = sub.add_parser("controller", help="Run the controller (REST API + dashboard).")
    c.add_argument("--host", help="Address to bind (default: VIGIL_HOST or 127.0.0.1).")
    c.add_argument("--port", type=int)
    c.add_argument("--allow-remote", action="store_true",
                   help="Allow binding an address other hosts can reach (e.g. --host 0.0.0.0).")
    c.add_argument("--extra-host", action="append", metavar="HOST",
                   help="Also listen on HOST (repeatable; same port, same --allow-remote rule).")
    c.add_argument("--ray-address", metavar="URL",
                   help="An existing Ray cluster's dashboard (job submission), e.g. http://head:8265 (VIGIL_RAY_ADDRESS).")
    c.add_argument("--ray-gcs-address", metavar="HOST:PORT",
                   help="Its GCS, e.g. head:6379: node list, draining, agents (VIGIL_RAY_GCS_ADDRESS).")
    c.add_argument("--deploy-agents", action="store_true",
                   help="Start an agent on every node of that cluster through Ray, and on every node that joins "
                        "(VIGIL_DEPLOY_AGENTS; docs/DEPLOY.md).")
    c.add_argument("--workers", type=int, default=1, metavar="N",
                   help="Worker processes serving the API (default 1): telemetry ingest on N cores; one of them "
                        "(the leader) runs the supervisor, monitor and aggregation.")

    sub.add_parser("agent", help="Run a node agent (see `vigil agent --help`).", add_help=False)
    sub.add_parser("dashboard", help="Run the dashboard on its own.", add_help=False)

    db = sub.add_parser("db", help="Database migrations.")
    db.add_argument("action", choices=["upgrade", "downgrade", "current", "create-admin-token"],
                    help="create-admin-token: write an admin token to <home>/admin-token (straight on the database).")
    db.add_argument("revision", nargs="?")
