"""Who may call what: the route policy, the one dependency that enforces it, and token bootstrap.

Every route of the app has an entry in :data:`ROUTE_POLICY`, keyed by (method, path template):
the roles that may call it, :data:`PUBLIC`, or :data:`METRICS` (open when ``VIGIL_METRICS_OPEN``,
else a reader's token). :func:`authorize` is a dependency of the whole app, so it runs for every
FastAPI route; it looks the matched route up in the table and refuses a route that has no entry
(fail closed). ``tests/controller/test_auth.py`` checks that the table and the app's routes are the
same set, so a new route cannot ship without a decision.

Answers: 401 (with ``WWW-Authenticate: Bearer``) without a token or with one that is unknown,
expired or revoked; 403 with a valid token whose role the route does not allow, or a ``job`` token
on another job's route.

Ownership, on top of the table: a ``user`` token may change (any method but GET) only the jobs it submitted
(``jobs.created_by``, the submitting token's id; an admin acts on any job), and may evict or readmit nodes
(:data:`NODE_ACTIONS`) only when the controller allows it (``VIGIL_USER_NODE_ACTIONS``). Reading stays open
to every reading role.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from controller import tokens
from controller.db import session_scope
from controller.tokens import Principal
from vigil.contract.schemas import Role, TokenCreate
from vigil.contract.settings import Settings, admin_token_path

log = logging.getLogger(__name__)

PUBLIC = "public"
"""Anyone, without a token."""
METRICS = "metrics"
"""Prometheus metrics: open when ``Settings.metrics_open``, else a token of a reading role."""

ADMIN = frozenset({Role.ADMIN})
READ = frozenset({Role.ADMIN, Role.USER, Role.VIEWER})
WRITE = frozenset({Role.ADMIN, Role.USER})
INGEST = frozenset({Role.ADMIN, Role.AGENT})
OWN_JOB = Role.JOB
"""In a route's roles, ``job`` means: a job token on the route of *its own* job (``{job_id}``)."""

API = "/api/v1"

ROUTE_POLICY: dict[tuple[str, str], frozenset[Role] | str] = {
    # -- REST API -----------------------------------------------------------------------------
    ("GET", f"{API}/healthz"): PUBLIC,
    ("POST", f"{API}/jobs"): WRITE,
    ("GET", f"{API}/jobs"): READ,
    ("GET", f"{API}/jobs/{{job_id}}"): READ | {OWN_JOB},
    ("POST", f"{API}/jobs/{{job_id}}/cancel"): WRITE,
    ("GET", f"{API}/jobs/{{job_id}}/metrics"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/logs"): READ,
    ("GET", f"{API}/nodes"): READ,
    ("GET", f"{API}/events"): READ,
    ("POST", f"{API}/telemetry"): INGEST,
    ("POST", f"{API}/telemetry/columnar"): INGEST,
    ("GET", f"{API}/jobs/{{job_id}}/steps"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/collectives"): READ,
    # derived views (controller/api/views.py)
    ("GET", f"{API}/jobs/{{job_id}}/overview"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/heatmap"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/goodput"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/stragglers"): READ,
    ("GET", f"{API}/nodes/{{node_id}}/history"): READ,
    # who am I: any valid token (the dashboard's sign-in checks a token's role with it)
    ("GET", f"{API}/whoami"): READ | INGEST,
    ("GET", "/metrics"): METRICS,  # Prometheus (controller/prometheus.py)
    # recovery (controller/api/recovery.py)
    ("POST", f"{API}/jobs/{{job_id}}/faults"): WRITE,
    ("GET", f"{API}/jobs/{{job_id}}/faults"): READ,
    # code packages (controller/api/packages.py): who may submit may upload; readers may look
    ("POST", f"{API}/packages"): WRITE,
    ("GET", f"{API}/packages/{{sha256}}"): READ,
    ("POST", f"{API}/jobs/{{job_id}}/faults/{{fault_id}}/clear"): WRITE,
    ("GET", f"{API}/incidents"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/incidents"): READ,
    ("GET", f"{API}/jobs/{{job_id}}/checkpoints"): READ | {OWN_JOB},
    ("GET", f"{API}/jobs/{{job_id}}/stacks"): READ,
    ("POST", f"{API}/jobs/{{job_id}}/recover"): WRITE,
    ("POST", f"{API}/nodes/{{node_id}}/evict"): WRITE,
    ("POST", f"{API}/nodes/{{node_id}}/readmit"): WRITE,
    ("GET", f"{API}/nodes/{{node_id}}/commands"): INGEST,
    ("POST", f"{API}/nodes/{{node_id}}/commands/{{command_id}}/result"): INGEST,
    ("POST", f"{API}/tokens"): ADMIN,
    ("GET", f"{API}/tokens"): ADMIN,
    ("POST", f"{API}/tokens/{{token_id}}/revoke"): ADMIN,
    # -- outside the API router -----------------------------------------------------------------
    # The API's description is no secret (it is in the source); Swagger UI asks for a token itself.
    ("GET", f"{API}/openapi.json"): PUBLIC,
    ("HEAD", f"{API}/openapi.json"): PUBLIC,
    ("GET", f"{API}/docs"): PUBLIC,
    ("HEAD", f"{API}/docs"): PUBLIC,
    ("GET", f"{API}/docs/oauth2-redirect"): PUBLIC,
    ("HEAD", f"{API}/docs/oauth2-redirect"): PUBLIC,
    ("GET", f"{API}/redoc"): PUBLIC,
    ("HEAD", f"{API}/redoc"): PUBLIC,
    ("GET", "/"): PUBLIC,  # a redirect to the dashboard
    # The mounted dashboard reads the API server side with its own viewer token (never sent to the
    # browser): whoever reaches the controller's port may look, read only. The controller binds
    # loopback unless told otherwise (`vigil controller --allow-remote`, which warns about this).
    ("*", "/dashboard"): PUBLIC,
}

_bearer = HTTPBearer(
    auto_error=False,
    description="A Vigil API token (`vigil token create`; after `vigil up` the admin token is in <home>/admin-token).",
)

_AUTH_DISABLED = Principal(token_id=None, role=Role.ADMIN, name="auth disabled")
_ANONYMOUS = Principal(token_id=None, role=None, name="anonymous")


def _unauthorized(detail: str, error: str | None = None) -> HTTPException:
    challenge = f'Bearer error="{error}"' if error else "Bearer"
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": challenge})


def principal_for(app: Any, token: str | None) -> Principal:
    """The principal of ``token`` for ``app`` (its in-process tokens, then the database); 401 if none."""
    if not token:
        raise _unauthorized("a bearer token is required (Authorization: Bearer vgl_...)")
    internal = app.state.internal_tokens.get(tokens.hash_token(token))
    if internal is not None:
        return internal
    with session_scope(app.state.sessions) as session:
        principal = tokens.authenticate(session, token)
    if principal is None:
        raise _unauthorized("the token is unknown, expired or revoked", "invalid_token")
    return principal


def iter_app_routes(app: Any) -> Iterator[tuple[BaseRoute, str, frozenset[str]]]:
    """Every route of ``app``: (the route object routing puts in ``scope["route"]``, its full path
    template, its methods). A mount has the methods ``{"*"}`` and its prefix as path.

    FastAPI >= 0.16x keeps included routers as they are (a route's own ``path_format`` lacks the
    prefixes it was included under) and lists the effective routes through ``iter_route_contexts``;
    earlier versions copied every included route, with its full path, into ``app.routes``.
    """
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # pragma: no cover - older FastAPI
        entries = [(r, r) for r in app.routes]
    else:
        entries = [(rc.original_route, rc) for rc in iter_route_contexts(app.routes)]
    for original, effective in entries:
        if isinstance(original, Mount):
            yield original, original.path, frozenset({"*"})
        else:
            yield original, effective.path_format, frozenset(effective.methods or ())


def _route_path(request: Request) -> str | None:
    """Full path template of the matched route, or None (no route, or one reachable under two paths)."""
    route = request.scope.get("route")
    if route is None:
        return None
    state = request.app.state
    paths: dict[int, set[str]] | None = getattr(state, "route_paths", None)
    if paths is None or id(route) not in paths:  # first request, or routes added since: (re)build
        paths = {}
        for r, path, _methods in iter_app_routes(request.app):
            paths.setdefault(id(r), set()).add(path)
        state.route_paths = paths
    found = paths.get(id(route), set())
    return next(iter(found)) if len(found) == 1 else None


def _bearer_token(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return credentials.credentials if credentials is not None else None


def check_metrics_access(request: Request) -> None:
    """Gate of Prometheus' ``/metrics``: open with ``VIGIL_METRICS_OPEN`` (or auth off), else a reader's token.

    Usable as a route dependency (``dependencies=[Depends(check_metrics_access)]``) or through
    :func:`guard_metrics_app` around a mounted ASGI app. Raises 401/403 like every other route.
    """
    settings: Settings = request.app.state.settings
    if settings.metrics_open or not settings.auth_enabled:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    principal = principal_for(request.app, token.strip() if scheme.lower() == "bearer" else None)
    if principal.role is None or principal.role not in READ:
        role = principal.role.value if principal.role else "none"
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=f"role {role} may not read metrics")


def guard_metrics_app(asgi_app: ASGIApp) -> ASGIApp:
    """Wrap a mounted metrics ASGI app (e.g. ``prometheus_client.make_asgi_app()``) in :func:`check_metrics_access`."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                await run_in_threadpool(check_metrics_access, Request(scope))
            except HTTPException as exc:
                await JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)(scope, receive, send)
                return
        await asgi_app(scope, receive, send)

    return guarded


def authorize(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """The app-wide dependency: look the matched route up in :data:`ROUTE_POLICY` and check the caller."""
    path = _route_path(request)
    rule = ROUTE_POLICY.get((request.method, path)) if path else None
    if rule is None:
        log.error("refused %s %s: the route has no entry in ROUTE_POLICY", request.method, path)
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="this route has no access rule")
    if rule == PUBLIC:
        return _ANONYMOUS
    if rule == METRICS:
        check_metrics_access(request)
        return _ANONYMOUS
    if not request.app.state.settings.auth_enabled:
        return _AUTH_DISABLED
    principal = principal_for(request.app, _bearer_token(credentials))
    assert isinstance(rule, frozenset) and principal.role is not None
    if principal.role not in rule:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail=f"role {principal.role.value} may not {request.method} {path}"
        )
    if principal.role == Role.JOB and request.path_params.get("job_id") != principal.job_id:
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="a job token may only touch its own job")
    if principal.role == Role.USER and request.method not in ("GET", "HEAD"):
        if "job_id" in request.path_params:
            check_job_owner(request.app, principal, request.path_params["job_id"])
        elif (request.method, path) in NODE_ACTIONS and not request.app.state.settings.user_node_actions:
            raise HTTPException(status.HTTP_403_FORBIDDEN, detail=(
                "a user token may not evict or readmit nodes (they move every job's ranks) unless the "
                "controller allows it (VIGIL_USER_NODE_ACTIONS=1); ask an admin"))
    if "node_id" in request.path_params:
        check_node_scope(principal, request.path_params["node_id"])
    return principal


NODE_ACTIONS = frozenset({("POST", f"{API}/nodes/{{node_id}}/evict"), ("POST", f"{API}/nodes/{{node_id}}/readmit")})
"""Node routes a ``user`` token may call only where the controller allows it (``Settings.user_node_actions``)."""


def check_job_owner(app: Any, principal: Principal, job_id: str) -> None:
    """403 unless the ``user`` token ``principal`` submitted job ``job_id`` (an unknown job: the route's 404)."""
    from controller.models import Job

    with session_scope(app.state.sessions) as s:
        job = s.get(Job, job_id)
        owner = job.created_by if job is not None else None
        if job is None:
            return
    if owner is None or owner != principal.token_id:
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=(
            f"job {job_id} was submitted by another token: a user token acts only on the jobs it submitted "
            "(an admin acts on any)"))


def check_node_scope(principal: Principal, node_id: str) -> None:
    """403 unless ``principal`` may act for ``node_id``: an agent token scoped to a node acts for it alone."""
    if principal.role == Role.AGENT and principal.node_id is not None and node_id != principal.node_id:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail=f"this agent token is scoped to node {principal.node_id}, not {node_id}",
        )


CurrentPrincipal = Annotated[Principal, Depends(authorize)]
"""The caller of the route (the same object :func:`authorize` checked; FastAPI caches it per request)."""


def mint_internal_token(app: Any, role: Role, name: str) -> str:
    """A token that lives only in this process (never stored): the mounted dashboard's viewer token.

    It dies with the process, so a controller restart leaves no orphan behind in the database,
    and two controllers on one database never revoke each other's.
    """
    secret = tokens.new_secret()
    app.state.internal_tokens[tokens.hash_token(secret)] = Principal(token_id=None, role=role, name=name)
    return secret


# ---------------------------------------------------------------------------------------------------
# Bootstrap (straight on the database: `vigil up`, `vigil db create-admin-token`)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootstrapTokens:
    admin: str
    admin_path: Path
    admin_created: bool
    agents: dict[str, str] = field(default_factory=dict, repr=False)
    """One agent token per node id, each scoped to its node."""
    agent_token_ids: tuple[str, ...] = ()


def ensure_admin_token(sessions: sessionmaker[Session], home: Path) -> tuple[str, bool]:
    """The admin token of ``<home>/admin-token``, creating it (file mode 0600) unless the file holds a valid one.

    Returns (token, created). A file whose token this database does not accept (revoked, expired,
    another database) is replaced.
    """
    path = admin_token_path(home)
    for _ in range(3):
        if path.exists():
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                log.warning("%s was readable by others (mode %o): now 600; revoke it if others could read it",
                            path, mode)
                path.chmod(0o600)
            existing = path.read_text().strip()
            with session_scope(sessions) as session:
                principal = tokens.authenticate(session, existing)
            if principal is not None and principal.role == Role.ADMIN:
                return existing, False
            log.warning("%s holds a token this database does not accept; writing a new admin token", path)
            path.unlink()
        with session_scope(sessions) as session:
            created = tokens.create_token(session, TokenCreate(role=Role.ADMIN, name="admin (bootstrap)"))
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another bootstrap won the race: use its token
            with session_scope(sessions) as session:
                tokens.revoke_token(session, created.id)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(created.token + "\n")
        log.info("admin token %s written to %s", created.id, path)
        return created.token, True
    raise RuntimeError(f"could not create {path}")


def bootstrap_tokens(sessions: sessionmaker[Session], home: Path, node_ids: Sequence[str] = ()) -> BootstrapTokens:
    """What ``vigil up`` needs: the admin token (file) and, for this run's agents, a fresh token per node,
    scoped to that node (an agent ingests and fetches commands for its own node only)."""
    admin, created = ensure_admin_token(sessions, home)
    with session_scope(sessions) as session:
        agents = {n: tokens.create_token(session, TokenCreate(role=Role.AGENT, name=f"agent {n} (vigil up)", node_id=n))
                  for n in node_ids}
    return BootstrapTokens(admin, admin_token_path(home), created, {n: t.token for n, t in agents.items()},
                           tuple(t.id for t in agents.values()))


def read_token_file(path: Path) -> str | None:
    """The token in ``path``, or None when there is no such file."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


__all__ = [
    "ADMIN",
    "INGEST",
    "METRICS",
    "PUBLIC",
    "READ",
    "ROUTE_POLICY",
    "WRITE",
    "CurrentPrincipal",
    "authorize",
    "bootstrap_tokens",
    "check_metrics_access",
    "check_node_scope",
    "ensure_admin_token",
    "guard_metrics_app",
    "iter_app_routes",
    "mint_internal_token",
    "principal_for",
    "read_token_file",
]
