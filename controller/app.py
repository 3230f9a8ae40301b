"""The controller's FastAPI application: the REST API under /api/v1 and /metrics.

What else it serves (the dashboard under /dashboard) the composition root mounts in: :data:`Mount`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from sqlalchemy import Engine, text

from controller import migrate
from controller.aggregation import TelemetryMaintainer
from controller.aggregation_process import AggregationProcess, MaintainerParams
from controller.api import jobs, nodes, packages, recovery, telemetry, tokens
from controller.api import metrics as metrics_routes
from controller.api import views as view_routes
from controller.api.deps import SessionDep
from controller.auth import authorize
from controller.db import WalCheckpointer, make_engine, make_session_factory
from controller.fleet import agent_fleet
from controller.launcher import ClusterControl, JobLauncher, RayClusterControl, RayJobLauncher
from controller.leader import Leadership, default_controller_id, leader_lock, shared_database
from controller.limits import BodySizeLimit, validation_error_handler
from controller.prometheus import make_registry
from controller.recovery.monitor import Monitor
from controller.supervisor import Supervisor
from controller.telemetry_guard import TelemetryGuard, ray_placement
from vigil.contract.background import BackgroundLoop
from vigil.contract.schemas import Health
from vigil.contract.settings import (
    ENV_CONTROLLER_URL,
    ENV_RUN_DIR,
    ENV_STORAGE_PATH,
    Settings,
    get_settings,
)

log = logging.getLogger(__name__)

try:
    VERSION = version("vigil")
except PackageNotFoundError:  # running from a source tree without install
    VERSION = "0.0.0"

health_router = APIRouter(tags=["health"])


@health_router.get("/healthz", response_model=Health)
def healthz(session: SessionDep, request: Request) -> Health:
    """Liveness, database reachability, and whether this controller is the leader (open to everyone)."""
    session.execute(text("SELECT 1"))
    return Health(status="ok", database=session.get_bind().dialect.name, version=VERSION,
                  leader=request.app.state.leadership.is_leader)


def job_env(settings: Settings) -> dict[str, str]:
    """Environment every launched job gets, so its ranks find their node's agent."""
    # Never VIGIL_HOME (the admin token and the SQLite database are there) nor anything secret: the job's
    # own token is added by the supervisor (docs/SECURITY.md).
    return {ENV_RUN_DIR: str(settings.run_dir), ENV_CONTROLLER_URL: settings.controller_url,
            ENV_STORAGE_PATH: str(settings.resolved_storage())}


Mount = Callable[[FastAPI, Settings], str | None]
"""Mounts another app under the controller's (the dashboard: :func:`ops.dashboard_mount.mount_dashboard`),
given the app once its API is in place and its settings; returns the path ``/`` should redirect to, or
None. The composition root (``vigil controller``) passes them in, so the server imports no user interface."""

API_HOME = "/api/v1/docs"
"""Where ``/`` redirects when no mount names another home."""


def create_app(
    settings: Settings | None = None,
    launcher: JobLauncher | None = None,
    cluster: ClusterControl | None = None,
    *,
    run_migrations: bool = True,
    background: bool = True,
    mounts: Sequence[Mount] = (),
) -> FastAPI:
    """Build the controller app.

    ``launcher`` defaults to Ray Job Submission at ``settings.ray_address`` (none: jobs stay PENDING).
    ``background`` starts the leadership loop, which runs the supervisor, the monitor and the telemetry
    maintainer while this controller holds the leader lock (controller/leader.py: always on SQLite; on
    PostgreSQL one controller of those sharing the database). Tests may leave it off and call
    ``supervisor.step()``; such an app is the leader on SQLite only. ``mounts`` (:data:`Mount`) run in
    order once the API is in place; the first home one of them returns is where ``/`` redirects.
    """
    settings = settings or get_settings()
    url = settings.resolved_database_url()
    if launcher is None and settings.ray_address:
        launcher = RayJobLauncher(settings.ray_address, packages_dir=settings.resolved_packages_dir())
    if cluster is None and settings.ray_gcs_address:
        cluster = RayClusterControl(settings.ray_gcs_address)
    if run_migrations:
        migrate.upgrade(url)
    app = _new_app(background)
    _attach_state(app, settings, make_engine(url), launcher, cluster)
    _include_api(app, settings)
    homes = [home for mount in mounts if (home := mount(app, settings)) is not None]
    home = homes[0] if homes else API_HOME

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(home)

    return app


def _new_app(background: bool) -> FastAPI:
    """The bare FastAPI app: its OpenAPI paths, authorization on every route, and a lifespan that runs
    the leadership loop (``background``) and releases the lock and the engine at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if background:
            app.state.leadership.start()
        try:
            yield
        finally:
            app.state.leadership.stop()  # the loops too, whoever started them; a standby takes over
            app.state.leadership.lock.close()
            app.state.engine.dispose()

    return FastAPI(
        title="Vigil controller",
        version=VERSION,
        description="Jobs, telemetry, nodes and recovery for distributed training on Ray.",
        lifespan=lifespan,
        docs_url="/api/v1/docs",
        openapi_url="/api/v1/openapi.json",
        redoc_url="/api/v1/redoc",
        swagger_ui_oauth2_redirect_url="/api/v1/docs/oauth2-redirect",
        # Authorization in one place: every route's (method, path) is looked up in ROUTE_POLICY.
        dependencies=[Depends(authorize)],
    )


def _attach_state(app: FastAPI, settings: Settings, engine: Engine, launcher: JobLauncher | None,
                  cluster: ClusterControl | None) -> None:
    """What the routes and the loops share, on ``app.state``: the settings, the database, the launcher,
    the telemetry guard, the background loops and the leadership that runs them, the metrics registry."""
    app.state.settings = settings
    app.state.internal_tokens = {}
    app.state.engine = engine
    app.state.sessions = make_session_factory(engine)
    app.state.launcher = launcher
    app.state.telemetry_guard = TelemetryGuard(str(settings.resolved_storage()), ray_placement(launcher, cluster))
    app.state.supervisor = Supervisor(app.state.sessions, launcher, job_env(settings), settings.supervisor_interval_s,
                                      settings.launch_retry_s)
    app.state.monitor = Monitor(app.state.sessions, launcher, cluster, settings.monitor_interval_s,
                                reconnect_grace_s=settings.monitor_reconnect_grace_s)
    # Per-step aggregates and the raw retention window (controller/aggregation.py).
    app.state.telemetry = TelemetryMaintainer(
        app.state.sessions, retention_s=settings.raw_retention_s, settle_s=settings.aggregate_settle_s,
        interval_s=settings.telemetry_interval_s, prune_interval_s=settings.raw_prune_interval_s,
        process=aggregation_process(settings, engine),
    )
    app.state.fleet = agent_fleet(settings, app.state.sessions)  # agents through Ray (VIGIL_DEPLOY_AGENTS)
    app.state.leadership = Leadership(
        leader_lock(engine), _leader_loops(app, engine), app.state.sessions,
        controller_id=settings.controller_id or default_controller_id(), interval=settings.leader_interval_s,
    )
    app.state.metrics_registry = make_registry(
        app.state.sessions, max_jobs=settings.metrics_max_jobs, max_ranks=settings.metrics_max_ranks
    )


def _leader_loops(app: FastAPI, engine: Engine) -> list[BackgroundLoop]:
    """The loops only the leader runs (one monitor per database, or incidents are opened twice)."""
    loops: list[BackgroundLoop] = [app.state.supervisor, app.state.monitor, app.state.telemetry]
    if app.state.fleet is not None:
        loops.append(app.state.fleet)
    if engine.dialect.name == "sqlite":  # its WAL, checkpointed here rather than in the ingest's commits
        loops.append(WalCheckpointer(app.state.sessions))
    return loops


def _include_api(app: FastAPI, settings: Settings) -> None:
    """The REST API under /api/v1, /metrics, the body size limits and the validation error handler."""
    api = APIRouter(prefix="/api/v1")
    api.include_router(health_router)
    api.include_router(jobs.router)
    api.include_router(nodes.router)
    api.include_router(telemetry.router)
    api.include_router(metrics_routes.router)
    api.include_router(view_routes.router)
    api.include_router(tokens.router)
    api.include_router(recovery.router)
    api.include_router(packages.router)
    app.include_router(api)
    app.include_router(metrics_routes.root_router)  # /metrics (Prometheus)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       per_path={"/api/v1/packages": settings.max_package_bytes})
    app.add_exception_handler(RequestValidationError, validation_error_handler)  # type: ignore[arg-type]
    if not settings.auth_enabled:
        log.warning("VIGIL_AUTH_ENABLED=false: every route is open to anyone who reaches the controller")


def aggregation_process(settings: Settings, engine: Engine) -> AggregationProcess | None:
    """The child process the leader's aggregation passes run in (``settings.aggregation_process``; by
    default wherever another process can open the database: :mod:`controller.aggregation_process`), or
    None for a thread (an in-memory SQLite database, or asked for)."""
    wanted = settings.aggregation_process
    if wanted is None:
        wanted = shared_database(engine)
    if not wanted:
        return None
    return AggregationProcess(engine.url.render_as_string(hide_password=False), MaintainerParams(
        retention_s=settings.raw_retention_s, settle_s=settings.aggregate_settle_s,
        interval_s=settings.telemetry_interval_s, prune_interval_s=settings.raw_prune_interval_s))

