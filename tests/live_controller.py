"""The REAL controller, live over HTTP, for tests of the parts that talk to it (dashboard, agent).

:class:`LiveController` is the controller of :func:`tests.harness.build_app` (SQLite in a test folder,
migrations, auth on) served by uvicorn in a thread on 127.0.0.1. Only the Ray seam is faked (``FakeLauncher``
of :mod:`tests.controller.fakes`: jobs are "launched" into it and their status set by hand), since
that is not what these tests claim to cover. The background loops are off: the tests run the
supervisor and the monitor one pass at a time (:meth:`LiveController.set_job_status`,
:meth:`LiveController.monitor_pass`), so nothing changes behind their back.

Data enters the way it does in production, through the REST API with tokens of the right role:
jobs through ``POST /api/v1/jobs``, steps and heartbeats through ``POST /api/v1/telemetry``
batches as agents send them (:meth:`LiveController.post_batch`, :meth:`LiveController.heartbeat`),
faults through ``POST /api/v1/jobs/{id}/faults``, whose firing queues real agent commands.
:meth:`LiveController.stop` / :meth:`LiveController.start` take the server away and bring a new
app on the same database back on the same port, as a controller restart does.

Needs: the controller's dependencies (FastAPI, SQLAlchemy, Alembic, uvicorn), loopback networking,
a writable folder. No Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import uvicorn
from sqlalchemy import func, select

from controller.db import session_scope
from controller.launcher import LaunchStatus
from controller.models import Node, NodeCommandRow, TelemetryBatchSeen
from tests.auth import issue_token
from tests.controller.fakes import FakeLauncher
from tests.harness import bind, build_app
from vigil.contract.client import VigilClient
from vigil.contract.probe import LOOPBACK, wait_for
from vigil.contract.schemas import (
    EventPublic,
    FaultCreate,
    FaultKind,
    FaultPublic,
    Heartbeat,
    JobCreate,
    JobPublic,
    JobStatus,
    NodeCommand,
    RankProcess,
    Role,
    StepSample,
    TelemetryAck,
    TelemetryBatch,
)
from vigil.contract.settings import Settings

__all__ = ["CommandRow", "LiveController", "step_sample"]


@dataclass(frozen=True)
class CommandRow:
    """A node command as the controller stored it, with the agent's answer (read from the database:
    the API lists pending commands only)."""

    id: int
    node_id: str
    kind: str
    args: dict[str, Any]
    status: str
    message: str | None
    result: dict[str, Any]


def step_sample(job_id: str, rank: int, step: int, **fields: Any) -> StepSample:
    """A rank's step as the trainer reports it; ``fields`` override the defaults."""
    values: dict[str, Any] = {
        "job_id": job_id, "rank": rank, "world_size": 1, "step": step, "ts": time.time(), "loss": 2.5,
        "step_time_s": 0.1, "tokens": 512, "tokens_per_s": 5120.0,
    }
    values.update(fields)
    return StepSample(**values)


class InFlight:
    """ASGI wrapper counting the requests being handled, handler and its session's commit included, but
    not an agent's long poll for commands (it may wait seconds for a command that only a settled write
    would queue: :meth:`LiveController.settle` would wait on it)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.count = 0
        self._lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        counted = scope["type"] == "http" and not (
            scope["path"].endswith("/commands") and b"wait_s=" in scope.get("query_string", b""))
        if counted:
            with self._lock:
                self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                with self._lock:
                    self.count -= 1


class LiveController:
    """The real controller app in a uvicorn thread, on SQLite in ``home``. ``stop()``/``start()`` keep the port.

    ``settings``: more :class:`~vigil.contract.settings.Settings` fields (``controller_url`` is always
    the server's own URL). ``mount_dashboard``: the controller mounts its dashboard itself, as ``vigil controller`` does
    (:func:`ops.dashboard_mount.mount_dashboard`).
    ``extend(app, url)`` runs on every app built, before it serves (the dashboard tests mount the
    dashboard their own way with it). The fake Ray launcher is :attr:`launcher`.
    """

    def __init__(
        self,
        home: Path,
        *,
        extend: Callable[[Any, str], None] | None = None,
        mount_dashboard: bool = False,
        **settings: Any,
    ) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.launcher = FakeLauncher()  # the Ray seam; it outlives controller restarts, as Ray does
        # No reconnect grace after a (re)start (production: 11 s for agents to retry): the tests drive the
        # monitor pass by pass, seconds after the start, with agents that never went away.
        self._settings = {"database_url": f"sqlite:///{self.home / 'vigil.db'}", "monitor_reconnect_grace_s": 0.0,
                          **settings}
        self._extend = extend
        self._mount_dashboard = mount_dashboard
        self.port = 0
        self.app: Any = None
        self._server: uvicorn.Server | None = None
        self._busy: InFlight | None = None
        self._thread: threading.Thread | None = None
        self._seq: dict[str, int] = {}
        self._tokens: dict[str, str] = {}

    # -- serving ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 60.0) -> Self:
        """Build a new app on the database and serve it (on the same port after a ``stop()``)."""
        assert self._server is None, "already serving"
        sock = bind(self.port)
        self.port = sock.getsockname()[1]
        settings = Settings(home=self.home, controller_url=self.url, **self._settings)
        app = build_app(settings, launcher=self.launcher, dashboard=self._mount_dashboard)
        if self._extend is not None:
            self._extend(app, self.url)
        self._busy = InFlight(app)
        config = uvicorn.Config(self._busy, log_level="warning", lifespan="on", access_log=False,
                                timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                  name=f"live controller {self.url}")
        thread.start()
        try:
            wait_for(lambda: server.started or not thread.is_alive(), timeout=timeout, interval=0.01,
                     what="controller up")
        finally:
            if not server.started:
                server.should_exit = True
                sock.close()
        assert server.started, "controller did not start"
        self.app, self._server, self._thread = app, server, thread
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """The controller goes away: listening socket and open connections closed."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)
        assert not thread.is_alive(), f"controller at {self.url} did not stop within {timeout} s"

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until no request is being handled. A route's database session commits *after* its
        response has been sent (FastAPI runs the exit of a request-scoped ``yield`` dependency then),
        so a client that got its 2xx may still find the write missing for a moment; the helpers
        below settle after writing and before reading."""
        busy = self._busy
        if self._server is not None and busy is not None:
            wait_for(lambda: not busy.count, timeout=timeout, interval=0.005, what="requests in flight to finish")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- credentials and clients -------------------------------------------------------------------
    def token(self, role: Role | str = Role.ADMIN, **kwargs: Any) -> str:
        """A token of ``role`` (one per role is kept and reused; ``kwargs`` always make a new one)."""
        role = Role(role)
        if kwargs:
            return issue_token(self.app, role, **kwargs)
        if role.value not in self._tokens:
            self._tokens[role.value] = issue_token(self.app, role)
        return self._tokens[role.value]

    def client(self, role: Role | str = Role.ADMIN, **kwargs: Any) -> VigilClient:
        """A :class:`VigilClient` with a token of ``role`` (close it, or use it in a ``with``)."""
        return VigilClient(self.url, token=self.token(role), **kwargs)

    def _call(self, role: Role | str, fn: Callable[[VigilClient], Any]) -> Any:
        with self.client(role) as c:
            return fn(c)

    # -- seeding through the API -----------------------------------------------------------------
    def submit_job(self, name: str = "demo", **spec: Any) -> JobPublic:
        """``POST /jobs`` (admin token); ``spec`` fields as in a job YAML (``steps``, ``optimizer``...)."""
        return self._call(Role.ADMIN, lambda c: c.submit_job(JobCreate.model_validate({"name": name, **spec})))

    def set_job_status(self, job_id: str, status: JobStatus) -> JobPublic:
        """Make the (fake) Ray job reach ``status`` and let the supervisor follow it, one pass each."""
        supervisor = self.app.state.supervisor
        supervisor.step()  # launches every PENDING job into the fake launcher
        self.launcher.statuses[f"fake-{job_id}"] = LaunchStatus(status)
        supervisor.step()
        return self._call(Role.ADMIN, lambda c: c.get_job(job_id))

    def post_batch(
        self,
        node_id: str,
        samples: Iterable[Any] = (),
        heartbeat: Heartbeat | None = None,
        agent_id: str | None = None,
    ) -> TelemetryAck:
        """One ``POST /telemetry`` batch as ``node_id``'s agent sends it (agent token, next seq)."""
        agent_id = agent_id or f"agent-{node_id}"
        seq = self._seq.get(agent_id, 0)
        self._seq[agent_id] = seq + 1
        batch = TelemetryBatch(agent_id=agent_id, node_id=node_id, seq=seq, sent_at=time.time(),
                               samples=list(samples), heartbeat=heartbeat)
        ack = self._call(Role.AGENT, lambda c: c.post_telemetry(batch))
        assert ack.accepted and not ack.duplicate, ack
        return ack

    def heartbeat(
        self,
        node_id: str,
        ranks: Iterable[RankProcess | tuple[str, int, int]] = (),
        samples: Iterable[Any] = (),
        **fields: Any,
    ) -> TelemetryAck:
        """A batch with a heartbeat of ``node_id`` naming ``ranks`` ((job_id, rank, pid) or
        :class:`RankProcess`); ``fields``: hostname, address, host, dropped_samples."""
        procs = [r if isinstance(r, RankProcess) else RankProcess(job_id=r[0], rank=r[1], pid=r[2]) for r in ranks]
        fields.setdefault("hostname", f"host-{node_id}")
        hb = Heartbeat(ts=time.time(), ranks=procs, **fields)
        return self.post_batch(node_id, samples, heartbeat=hb)

    def inject_fault(self, job_id: str, kind: FaultKind | str, **fields: Any) -> FaultPublic:
        """``POST /jobs/{id}/faults`` (admin token)."""
        spec = FaultCreate.model_validate({"kind": FaultKind(kind), **fields})
        fault = self._call(Role.ADMIN, lambda c: c.inject_fault(job_id, spec))
        self.settle()
        return fault

    def clear_fault(self, job_id: str, fault_id: int) -> FaultPublic:
        fault = self._call(Role.ADMIN, lambda c: c.clear_fault(job_id, fault_id))
        self.settle()
        return fault

    def monitor_pass(self, after_s: float = 0.0) -> None:
        """One pass of the controller's monitor (fires due faults into agent commands, runs the
        detectors), as if ``after_s`` more seconds had passed (``after_s`` > 4: heartbeats are lost)."""
        self.settle()
        monitor = self.app.state.monitor
        clock = monitor.clock
        monitor.clock = lambda: clock() + after_s
        try:
            monitor.step()
        finally:
            monitor.clock = clock

    def fire(self, job_id: str, kind: FaultKind | str, **fields: Any) -> list[CommandRow]:
        """Inject a fault and run one monitor pass: the agent commands that pass queued."""
        before = set(self.command_rows())
        self.inject_fault(job_id, kind, **fields)
        self.monitor_pass()
        return [row for cid, row in self.command_rows().items() if cid not in before]

    # -- reading back --------------------------------------------------------------------------------
    def pending_commands(self, node_id: str) -> list[NodeCommand]:
        """``GET /nodes/{id}/commands`` (agent token): what the node's agent would fetch now."""
        self.settle()
        return list(self._call(Role.AGENT, lambda c: c.node_commands(node_id).data))

    def command_rows(self, ids: Iterable[int] | None = None) -> dict[int, CommandRow]:
        """Stored commands with their answers, by id (all, or ``ids``)."""
        self.settle()
        q = select(NodeCommandRow).order_by(NodeCommandRow.id)
        if ids is not None:
            q = q.where(NodeCommandRow.id.in_(list(ids)))
        with session_scope(self.app.state.sessions) as s:
            return {r.id: CommandRow(r.id, r.node_id, r.kind, dict(r.args), r.status, r.message, dict(r.result or {}))
                    for r in s.scalars(q).all()}

    def events(self, job_id: str | None = None, kind: str | None = None, limit: int = 1000) -> list[EventPublic]:
        """``GET /events``, oldest first; only ``kind`` when given."""
        self.settle()
        data = self._call(Role.ADMIN, lambda c: c.list_events(job_id=job_id, limit=limit).data)
        return [e for e in reversed(data) if kind is None or e.kind == kind]

    def answered(self) -> list[int]:
        """Command ids in the order their first answer was stored (from the ``command_result`` events)."""
        return [int(e.data["command_id"]) for e in self.events(kind="command_result")]

    def batches_seen(self, agent_id: str | None = None) -> int:
        """How many distinct telemetry batches (of ``agent_id``, or of any agent) the controller stored."""
        self.settle()
        q = select(func.count()).select_from(TelemetryBatchSeen)
        if agent_id is not None:
            q = q.where(TelemetryBatchSeen.agent_id == agent_id)
        with session_scope(self.app.state.sessions) as s:
            return int(s.scalar(q) or 0)

    def node_dropped_samples(self, node_id: str) -> int:
        """The ``dropped_samples`` of the node's latest heartbeat (kept, not in ``GET /nodes``)."""
        self.settle()
        with session_scope(self.app.state.sessions) as s:
            node = s.get(Node, node_id)
            assert node is not None, f"node {node_id} unknown"
            return int(node.dropped_samples)


def checkpoint_path(app: Any, job_id: str, step: int) -> str:
    """Where job ``job_id``'s checkpoint of ``step`` lives in the storage of the controller ``app`` (the only
    place its checkpoint records are accepted from: controller/telemetry_guard.py)."""
    from vigil.contract.checkpoint_layout import job_checkpoint_root

    return str(job_checkpoint_root(app.state.telemetry_guard.storage, job_id) / f"step-{step}")
