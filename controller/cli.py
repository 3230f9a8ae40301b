"""The ``vigil`` command line."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path

from controller.client import ApiError, VigilClient
from controller.schemas import JobCreate, JobPublic, JobStatus, Role, TokenCreate
from controller.settings import admin_token_path, get_settings

log = logging.getLogger("vigil")

DEMO_JOB = "demo.yaml"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def cli_token() -> str | None:
    """The CLI's bearer token: ``VIGIL_TOKEN``, else the admin token ``vigil up`` wrote to <home>/admin-token."""
    from controller.auth import read_token_file

    settings = get_settings()
    return settings.token or read_token_file(admin_token_path(settings.home))


def _client(args: argparse.Namespace) -> VigilClient:
    return VigilClient(args.controller or get_settings().controller_url, token=cli_token())


_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """``7d``, ``24h``, ``30m``, ``2w``, ``90s`` from now, or an ISO 8601 time (UTC unless it says otherwise)."""
    now = now or datetime.now(UTC)
    m = _DURATION.match(text)
    if m:
        return now + timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--expires: {text!r} is neither a duration (7d, 24h, 30m) nor an ISO 8601 time") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def load_job_file(path: Path, overrides: dict[str, object] | None = None) -> JobCreate:
    """Read and validate a job spec file (YAML or JSON), with ``overrides`` set over its top-level
    fields (``working_dir`` from ``--working-dir``); ``ValueError`` names the field and the rule."""
    import yaml
    from pydantic import ValidationError

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read job spec ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a job spec must be a mapping, got {type(raw).__name__}")
    try:
        return JobCreate.model_validate({**raw, **(overrides or {})})
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc'])) or '<spec>'}: {e['msg']}" for e in exc.errors()]
        raise ValueError(f"{path}: invalid job spec\n  " + "\n  ".join(lines)) from None


def demo_job_spec() -> JobCreate:
    text = resources.files("controller").joinpath("examples", DEMO_JOB).read_text()
    import yaml

    return JobCreate.model_validate(yaml.safe_load(text))


def follow_job(client: VigilClient, job_id: str, stop: threading.Event | None = None, interval: float = 1.0) -> JobPublic:
    """Show a progress bar of the job's steps until it ends (or ``stop`` is set); returns the last view."""
    from tqdm import tqdm

    import httpx

    job = client.get_job(job_id)
    with tqdm(total=job.spec.steps, desc=f"{job.name} [{job.status.value}]", unit="step", dynamic_ncols=True) as bar:
        while True:
            try:
                job = client.get_job(job_id)
            except httpx.TransportError as exc:  # a busy or restarting controller: keep following
                bar.set_postfix_str(f"controller unreachable ({type(exc).__name__}), retrying")
                if stop is not None and stop.wait(interval):
                    return job
                time.sleep(0 if stop is not None else interval)
                continue
            done = job.last_step or 0  # steps are numbered 1..steps
            bar.set_description(f"{job.name} [{job.status.value}]")
            if job.last_loss is not None:
                bar.set_postfix(loss=f"{job.last_loss:.3f}")
            bar.update(max(0, min(done, job.spec.steps) - bar.n))
            if job.status.is_terminal() or (stop is not None and stop.is_set()):
                return job
            time.sleep(interval)


# ---------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------


def cmd_controller(args: argparse.Namespace) -> int:
    import uvicorn

    from controller.app import create_app

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
        log.warning("binding %s: the controller, and its read-only dashboard, are reachable from other hosts", h)
        if not settings.auth_enabled:
            log.warning("VIGIL_AUTH_ENABLED=false on %s: ANYONE who reaches port %d can submit, cancel and read "
                        "everything", h, port)
    settings = settings.model_copy(update={"host": host, "port": port})
    if len(hosts) == 1:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
        return 0
    # Several addresses (`vigil up --netns`: loopback for the user, the bridge for agents in namespaces).
    sockets = [_listen(h, port) for h in hosts]
    uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning")).run(sockets=sockets)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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


def cmd_token(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            if args.action == "create":
                expires = parse_expiry(args.expires) if args.expires else None
                spec = TokenCreate(role=Role(args.role), name=args.name or "", job_id=args.job, node_id=args.node,
                                   expires_at=expires)
                tok = client.create_token(spec)
                print(f"created {tok.id} (role {tok.role.value}" + (f", job {tok.job_id}" if tok.job_id else "") +
                      (f", node {tok.node_id}" if tok.node_id else "") +
                      f", expires {tok.expires_at.isoformat() if tok.expires_at else 'never'}); "
                      "it is shown this once, keep it now:")
                print(tok.token)  # alone on the last line, so `| tail -1` captures it
            elif args.action == "list":
                toks = client.list_tokens(limit=args.limit, include_inactive=args.all)
                print(f"{'ID':<21} {'ROLE':<7} {'STATE':<8} {'HINT':<13} {'EXPIRES':<20} {'LAST USED':<20} NAME")
                for t in toks.data:
                    state = "active" if t.active else ("revoked" if t.revoked_at else "expired")
                    exp = t.expires_at.strftime("%Y-%m-%d %H:%M") if t.expires_at else "never"
                    used = t.last_used_at.strftime("%Y-%m-%d %H:%M") if t.last_used_at else "-"
                    name = t.name + (f" [job {t.job_id}]" if t.job_id else "") + (f" [node {t.node_id}]" if t.node_id else "")
                    print(f"{t.id:<21} {t.role.value:<7} {state:<8} {t.hint + '...':<13} {exp:<20} {used:<20} {name}")
            else:
                tok = client.revoke_token(args.token_id)
                print(f"{tok.id} revoked at {tok.revoked_at.isoformat() if tok.revoked_at else '?'}")
        except ApiError as exc:
            print(f"token {args.action}: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # a bad --expires, or a spec the schema refuses
            print(f"token {args.action}: {exc}", file=sys.stderr)
            return 2
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    package = None
    overrides: dict[str, object] = {}
    if args.working_dir:  # packed first: the spec names the package by its hash, and is checked with it
        from controller.packages import REF_PREFIX, PackageError, pack_directory

        try:
            package = pack_directory(Path(args.working_dir), args.exclude or (),
                                     max_bytes=get_settings().max_package_bytes)
        except (PackageError, OSError) as exc:
            print(f"submit: {exc}", file=sys.stderr)
            return 2
        overrides["working_dir"] = REF_PREFIX + hashlib.sha256(package).hexdigest()
    try:
        spec = load_job_file(Path(args.file), overrides)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    with _client(args) as client:
        try:
            if package is not None:
                uploaded = client.upload_package(package)
                print(f"uploaded {args.working_dir} as {uploaded.ref} ({uploaded.files} files, {uploaded.size} bytes)",
                      file=sys.stderr)
            job = client.submit_job(spec)
        except ApiError as exc:
            print(f"submit refused: {exc}", file=sys.stderr)
            return 2
        print(job.id)
        if args.follow:
            job = follow_job(client, job.id)
            print(f"{job.id} {job.status.value}" + (f": {job.message}" if job.message else ""))
            return 0 if job.status == JobStatus.SUCCEEDED else 1
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        jobs = client.list_jobs(limit=args.limit)
    if args.json:
        print(json.dumps([j.model_dump(mode="json") for j in jobs.data], indent=2))
        return 0
    print(f"{'ID':<18} {'STATUS':<10} {'STEP':>11} {'LOSS':>8}  {'OPTIMIZER':<16} NAME")
    for j in jobs.data:
        step = f"{j.last_step or 0}/{j.spec.steps}"
        loss = f"{j.last_loss:.4f}" if j.last_loss is not None else "-"
        print(f"{j.id:<18} {j.status.value:<10} {step:>11} {loss:>8}  {j.spec.optimizer.kind:<16} {j.name}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            print(client.job_logs(args.job).logs, end="")
        except ApiError as exc:
            print(exc, file=sys.stderr)
            return 1
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            job = client.cancel_job(args.job)
        except ApiError as exc:
            print(exc, file=sys.stderr)
            return 1
    print(f"{job.id} {job.status.value}")
    return 0


def _call(args: argparse.Namespace, method: str, path: str, **kwargs: object) -> object | None:
    """One REST call for the recovery commands; prints the API's refusal and returns None on error."""
    with _client(args) as client:
        try:
            return client._request(method, f"/api/v1{path}", **kwargs)
        except ApiError as exc:
            print(exc, file=sys.stderr)
            return None


def cmd_recover(args: argparse.Namespace) -> int:
    body = {"reason": args.reason, **({"evict_node": args.evict} if args.evict else {})}
    inc = _call(args, "POST", f"/jobs/{args.job}/recover", json=body)
    if inc is None:
        return 1
    print(f"incident {inc['id']}: {inc['action']}")  # type: ignore[index]
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    out = _call(args, "POST", f"/nodes/{args.node}/evict", params={"deadline_s": args.deadline})
    if out is None:
        return 1
    print(f"{args.node} EVICTED: {out['outcome']}")  # type: ignore[index]
    return 0


def cmd_readmit(args: argparse.Namespace) -> int:
    if _call(args, "POST", f"/nodes/{args.node}/readmit") is None:
        return 1
    print(f"{args.node} readmitted (its agent starts a fresh raylet)")
    return 0


def cmd_fault(args: argparse.Namespace) -> int:
    params: dict[str, object] = {}
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--param: expected KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        try:
            params[key] = float(value) if "." in value else int(value)
        except ValueError:
            params[key] = value
    body: dict[str, object] = {"kind": args.kind, "step": args.step, "params": params}
    if args.rank is not None:
        body["rank"] = args.rank
    if args.node:
        body["node_id"] = args.node
    f = _call(args, "POST", f"/jobs/{args.job}/faults", json=body)
    if f is None:
        return 1
    print(f"fault {f['id']}: {f['kind']} {f['status']} (fires at step {f['step']})")  # type: ignore[index]
    return 0


def cmd_incidents(args: argparse.Namespace) -> int:
    out = _call(args, "GET", "/incidents", params={"job_id": args.job} if args.job else {})
    if out is None:
        return 1
    print(f"{'ID':>4} {'KIND':<12} {'STATUS':<10} {'JOB':<18} {'NODE':<14} {'RANK':>4}  ACTION")
    for i in out["data"]:  # type: ignore[index]
        print(f"{i['id']:>4} {i['kind']:<12} {i['status']:<10} {i['job_id'] or '-':<18} {i['node_id'] or '-':<14} "
              f"{'-' if i['rank'] is None else i['rank']:>4}  {i['action'] or ''}")
    return 0


# `vigil bench NAME ...` runs `python -m MODULE ...`; trainer benchmarks stay out of the controller's imports.
BENCHMARKS = {
    "comm": "trainer.bench.comm",
    "kernels": "trainer.bench.kernels",
    "convergence": "trainer.bench.convergence",
    "overhead": "trainer.bench.overhead",
    "speedup": "trainer.bench.speedup",
    "ingest": "controller.bench.ingest",
    "recovery": "controller.bench.recovery",
}


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    # The controller never imports the trainer: benchmarks of trainer code run as their own process.
    module = BENCHMARKS.get(args.what)
    if module is None:
        print(f"bench: unknown benchmark {args.what!r}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", module, *rest])


def cmd_up(args: argparse.Namespace) -> int:
    from controller.localcluster import start_local_cluster
    from controller.netns import LinkSpec, NetnsError

    settings = get_settings()
    home = Path(args.home or settings.home)
    try:
        link = LinkSpec(rate=args.link, latency=args.link_latency, jitter=args.link_jitter, loss=args.link_loss)
    except ValueError as exc:
        print(f"vigil up: {exc}", file=sys.stderr)
        return 2
    print(f"starting Vigil: Ray head + {args.nodes} worker node(s)" + (" in network namespaces" if args.netns else "")
          + f", agents, controller on port {args.port} ...", flush=True)
    try:
        cluster = start_local_cluster(home, nodes=args.nodes, cpus_per_node=args.cpus_per_node, port=args.port,
                                      database_url=settings.database_url, netns=args.netns, link=link)
    except NetnsError as exc:  # e.g. --link-latency on a kernel without sch_netem; nothing is left behind
        print(f"vigil up --netns: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        print(f"dashboard:  {cluster.controller_url}/dashboard/")
        print(f"REST API:   {cluster.controller_url}/api/v1/docs")
        print(f"Ray:        {cluster.dashboard_url}   logs: {home.resolve() / 'logs'}")
        if cluster.netns is not None:
            net = cluster.netns
            print(f"network:    bridge {net.bridge} {net.gateway}/{net.prefix_len}; "
                  + ", ".join(f"{n.namespace} {n.address}" for n in net.nodes) + f"; link {net.link}")
        print(f"admin token: {cluster.admin_token_path} (the CLI reads it; or export VIGIL_TOKEN)")
        with VigilClient(cluster.controller_url, token=cluster.admin_token) as client:
            if not args.no_demo:
                spec = load_job_file(Path(args.job)) if args.job else demo_job_spec()
                job = client.submit_job(spec)
                print(f"submitted {job.id} ({spec.name}); Ctrl-C stops everything")
                if not args.job and not args.no_fault:
                    # The demo shows recovery too: a rank is killed (SIGKILL by its node's agent) midway;
                    # Vigil names it, Ray Train restarts the ranks from the newest valid checkpoint.
                    at = spec.steps // 2
                    client._request("POST", f"/api/v1/jobs/{job.id}/faults",
                                    json={"kind": "kill_rank", "rank": 1, "step": at})
                    print(f"fault injection: rank 1 will be killed at step {at} (--no-fault to skip)")
                job = follow_job(client, job.id, stop)
                if job.status.is_terminal():
                    print(f"{job.id} {job.status.value}, loss {job.last_loss}" +
                          (f": {job.message}" if job.message else ""), flush=True)
                    for inc in client._request("GET", f"/api/v1/jobs/{job.id}/incidents")["data"]:
                        print(f"incident {inc['id']}: {inc['kind']} node={inc['node_id']} rank={inc['rank']} "
                              f"{inc['status']} - {inc['action']}")
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


# ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vigil", description="Observability and fault tolerance for training on Ray.")
    p.add_argument("--controller", help="Controller URL (default: VIGIL_CONTROLLER_URL or http://127.0.0.1:8000).")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

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

    sub.add_parser("agent", help="Run a node agent (see `vigil agent --help`).", add_help=False)
    sub.add_parser("dashboard", help="Run the dashboard on its own.", add_help=False)

    db = sub.add_parser("db", help="Database migrations.")
    db.add_argument("action", choices=["upgrade", "downgrade", "current", "create-admin-token"],
                    help="create-admin-token: write an admin token to <home>/admin-token (straight on the database).")
    db.add_argument("revision", nargs="?")

    tk = sub.add_parser("token", help="API tokens (admin): create, list, revoke.")
    tks = tk.add_subparsers(dest="action", required=True)
    tc = tks.add_parser("create", help="Issue a token; prints it alone on the last line (shown only once).")
    tc.add_argument("--role", required=True, choices=[r.value for r in Role])
    tc.add_argument("--expires", help="7d, 24h, 30m, or an ISO 8601 time (default: never).")
    tc.add_argument("--name", help="What it is for.")
    tc.add_argument("--job", help="The job a `job` token is scoped to.")
    tc.add_argument("--node", help="The node an `agent` token is scoped to (its agent may act for that node only).")
    tl = tks.add_parser("list", help="List tokens (never their secrets).")
    tl.add_argument("--limit", type=int, default=100)
    tl.add_argument("--active", dest="all", action="store_false", help="Only tokens that still work.")
    tr = tks.add_parser("revoke", help="Revoke a token by id (tok_...).")
    tr.add_argument("token_id")

    s = sub.add_parser("submit", help="Submit a job file (YAML); prints the job id.")
    s.add_argument("file")
    s.add_argument("--working-dir", help="Your code: this folder is packed (minus .git/, __pycache__/, .venv/ and "
                   "what its .vigilignore lists), uploaded, and shipped to the driver and every rank.")
    s.add_argument("--exclude", action="append", metavar="PATTERN",
                   help="Leave matching files out of the package (gitignore syntax; repeatable).")
    s.add_argument("--follow", action="store_true", help="Show a progress bar until the job ends.")

    j = sub.add_parser("jobs", help="List jobs.")
    j.add_argument("--limit", type=int, default=50)
    j.add_argument("--json", action="store_true")

    lg = sub.add_parser("logs", help="Print a job's driver logs.")
    lg.add_argument("job")

    cn = sub.add_parser("cancel", help="Cancel a job.")
    cn.add_argument("job")

    rc = sub.add_parser("recover", help="Restart a job's ranks from its newest valid checkpoint.")
    rc.add_argument("job")
    rc.add_argument("--evict", metavar="NODE", help="Evict this node first.")
    rc.add_argument("--reason", default="manual recovery")

    ev = sub.add_parser("evict", help="Drain a node in Ray; it stays out until readmitted.")
    ev.add_argument("node")
    ev.add_argument("--deadline", type=float, default=5.0, help="Seconds the node's ranks get to checkpoint.")

    ra = sub.add_parser("readmit", help="Take an evicted node back.")
    ra.add_argument("node")

    fa = sub.add_parser("fault", help="Inject a fault into a running job (kill_rank, hang_rank, ...).")
    fa.add_argument("job")
    fa.add_argument("kind")
    fa.add_argument("--rank", type=int)
    fa.add_argument("--node")
    fa.add_argument("--step", type=int, default=0, help="Fire once the job reaches this step.")
    fa.add_argument("--param", action="append", metavar="KEY=VALUE", help="Kind-specific parameter (repeatable).")

    ic = sub.add_parser("incidents", help="List incidents (of one job with --job).")
    ic.add_argument("--job")

    b = sub.add_parser("bench", help="Benchmarks (comm, kernels, convergence, overhead, ingest, recovery, speedup).",
                       add_help=False)
    b.add_argument("what")
    return p


PASSTHROUGH = {"agent": cmd_agent, "dashboard": cmd_dashboard, "bench": cmd_bench}
COMMANDS = {"controller": cmd_controller, "db": cmd_db, "submit": cmd_submit, "jobs": cmd_jobs, "logs": cmd_logs,
            "cancel": cmd_cancel, "up": cmd_up, "token": cmd_token, "recover": cmd_recover, "evict": cmd_evict,
            "readmit": cmd_readmit, "fault": cmd_fault, "incidents": cmd_incidents}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        for noisy in ("httpx", "httpcore", "alembic"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command in PASSTHROUGH:
        return PASSTHROUGH[args.command](args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return COMMANDS[args.command](args)
    except ApiError as exc:
        if exc.status_code == 401:
            print(f"vigil: the controller wants a valid token ({exc.detail}): set VIGIL_TOKEN, or run where "
                  f"{admin_token_path(get_settings().home)} is (vigil up writes it)", file=sys.stderr)
        elif exc.status_code == 403:
            print(f"vigil: this token may not do that ({exc.detail})", file=sys.stderr)
        else:
            raise
        return 1


if __name__ == "__main__":
    sys.exit(main())
