"""The controller's FastAPI application: REST API under /api/v1, the dashboard under /dashboard."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
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
from controller.auth import authorize, mint_internal_token
from controller.background import BackgroundLoop
from controller.db import WalCheckpointer, make_engine, make_session_factory
from controller.fleet import agent_fleet
from controller.launcher import ClusterControl, JobLauncher, RayClusterControl, RayJobLauncher
from controller.leader import Leadership, default_controller_id, leader_lock, shared_database
from controller.limits import BodySizeLimit, validation_error_handler
from controller.prometheus import make_registry
from controller.recovery.monitor import Monitor
from controller.schemas import Health, Role
from controller.settings import (
    ENV_CONTROLLER_URL,
    ENV_RUN_DIR,
    ENV_STORAGE_PATH,
    Settings,
    get_settings,
)
from controller.supervisor import Supervisor
from controller.telemetry_guard import TelemetryGuard, ray_placement

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


def create_app(
    settings: Settings | None = None,
    launcher: JobLauncher | None = None,
    cluster: ClusterControl | None = None,
    *,
    run_migrations: bool = True,
    background: bool = True,
    mount_dashboard: bool = True,
) -> FastAPI:
    """Build the controller app.

    ``launcher`` defaults to Ray Job Submission at ``settings.ray_address`` (none: jobs stay PENDING).
    ``background`` starts the leadership loop, which runs the supervisor, the monitor and the telemetry
    maintainer while this controller holds the leader lock (controller/leader.py: always on SQLite; on
    PostgreSQL one controller of those sharing the database). Tests may leave it off and call
    ``supervisor.step()``; such an app is the leader on SQLite only.
    """
    settings = settings or get_settings()
    url = settings.resolved_database_url()
    if launcher is None and settings.ray_address:
        launcher = RayJobLauncher(settings.ray_address, packages_dir=settings.resolved_packages_dir())
    if cluster is None and settings.ray_gcs_address:
        cluster = RayClusterControl(settings.ray_gcs_address)

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

    if run_migrations:
        migrate.upgrade(url)
    engine = make_engine(url)
    app = FastAPI(
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
    # Only the leader runs them (one monitor per database, or incidents are opened twice).
    loops: list[BackgroundLoop] = [app.state.supervisor, app.state.monitor, app.state.telemetry]
    app.state.fleet = agent_fleet(settings, app.state.sessions)  # agents through Ray (VIGIL_DEPLOY_AGENTS)
    if app.state.fleet is not None:
        loops.append(app.state.fleet)
    if engine.dialect.name == "sqlite":  # its WAL, checkpointed here rather than in the ingest's commits
        loops.append(WalCheckpointer(app.state.sessions))
    app.state.leadership = Leadership(
        leader_lock(engine), loops, app.state.sessions,
        controller_id=settings.controller_id or default_controller_id(), interval=settings.leader_interval_s,
    )
    app.state.metrics_registry = make_registry(
        app.state.sessions, max_jobs=settings.metrics_max_jobs, max_ranks=settings.metrics_max_ranks
    )

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

    if mount_dashboard:
        _mount_dashboard(app, settings)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/" if mount_dashboard else "/api/v1/docs")

    return app


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


def _mount_dashboard(app: FastAPI, settings: Settings) -> None:
    from a2wsgi import WSGIMiddleware

    from dashboard.app import create_dash_app

    # The dashboard's callbacks run here, server side: its token never reaches a browser. No CORS
    # middleware is installed, so no other origin may read the API or the dashboard's answers.
    token = settings.dashboard_token
    if token is None and settings.auth_enabled and settings.dashboard_open_reads:
        token = mint_internal_token(app, Role.VIEWER, "dashboard (mounted)")
    dash_app = create_dash_app(settings.controller_url, token=token, requests_pathname_prefix="/dashboard/")
    app.mount("/dashboard", WSGIMiddleware(dash_app.server))
