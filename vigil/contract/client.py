"""Typed HTTP client for the controller's REST API.

Used by the CLI, the agents, the dashboard and the tests. Only depends on httpx and the wire
schemas, so every package may import it.
"""

from __future__ import annotations

from typing import Any, Self

import httpx

from vigil.contract.lenient import parse
from vigil.contract.schemas import (
    CheckpointsPublic,
    CommandResult,
    EventsPublic,
    FaultCreate,
    FaultPublic,
    FaultsPublic,
    GoodputPublic,
    Health,
    IncidentPublic,
    IncidentsPublic,
    JobCollectivesPublic,
    JobCreate,
    JobMetrics,
    JobOverviewPublic,
    JobPublic,
    JobsPublic,
    JobStepsPublic,
    LogsPublic,
    NodeActionPublic,
    NodeCommandsPublic,
    NodeHistoryPublic,
    NodesPublic,
    PackagePublic,
    RecoverRequest,
    SecondsLostPublic,
    StacksPublic,
    StepHeatmapPublic,
    TelemetryAck,
    TelemetryBatch,
    TokenCreate,
    TokenCreated,
    TokenPublic,
    TokensPublic,
    WhoAmI,
)
from vigil.contract.schemas.columnar import COLUMNAR_PATH
from vigil.contract.schemas.columnar import CONTENT_TYPE as COLUMNAR_CONTENT_TYPE

API = "/api/v1"


class ApiError(RuntimeError):
    """The controller answered with an error status; ``detail`` is its explanation."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def _check_path(path: str) -> None:
    """Refuse a request path an id could have bent (ids come from URLs, files and other processes): a ``.``
    or ``..`` segment (httpx resolves ``jobs/../tokens`` to ``tokens``: another route, asked with this
    client's token), or a ``?`` or ``#`` (the rest of the path would become a query or be cut off). The
    client's own paths have none; an id holding one reaches no route but an ``ApiError`` 400, sent nowhere."""
    segments = path.split("/")
    if "?" in path or "#" in path or any(seg in (".", "..") for seg in segments):
        raise ApiError(400, f"refused to send {path[:200]!r}: an id in it holds '.', '..', '?' or '#'")


class VigilClient:
    """Synchronous client. ``transport`` lets tests pass an ASGI transport instead of real HTTP."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        _check_path(path)
        resp = self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise ApiError(resp.status_code, detail)
        return resp.json()

    # -- code packages ------------------------------------------------------------------------
    def upload_package(self, data: bytes) -> PackagePublic:
        """Store a code package (a zip, e.g. :func:`controller.packages.pack_directory`'s); a job names
        it by the answer's ``ref`` in ``working_dir``. Uploads take longer than other calls: no timeout
        shorter than a minute."""
        timeout = max(60.0, self._http.timeout.read or 0.0)
        return parse(PackagePublic, self._request(
            "POST", f"{API}/packages", content=data, headers={"Content-Type": "application/zip"}, timeout=timeout))

    def get_package(self, sha256: str) -> PackagePublic:
        return parse(PackagePublic, self._request("GET", f"{API}/packages/{sha256}"))

    # -- health -------------------------------------------------------------------------------
    def health(self) -> Health:
        return parse(Health, self._request("GET", f"{API}/healthz"))

    # -- jobs ---------------------------------------------------------------------------------
    def submit_job(self, spec: JobCreate) -> JobPublic:
        return parse(JobPublic, self._request("POST", f"{API}/jobs", json=spec.model_dump(mode="json")))

    def list_jobs(self, limit: int = 100, offset: int = 0) -> JobsPublic:
        return parse(JobsPublic, self._request("GET", f"{API}/jobs", params={"limit": limit, "offset": offset}))

    def get_job(self, job_id: str) -> JobPublic:
        return parse(JobPublic, self._request("GET", f"{API}/jobs/{job_id}"))

    def cancel_job(self, job_id: str) -> JobPublic:
        return parse(JobPublic, self._request("POST", f"{API}/jobs/{job_id}/cancel"))

    def job_metrics(self, job_id: str, since_step: int | None = None, max_points: int | None = None) -> JobMetrics:
        params: dict[str, int] = {"since_step": since_step} if since_step is not None else {}
        if max_points is not None:
            params["max_points"] = max_points
        return parse(JobMetrics, self._request("GET", f"{API}/jobs/{job_id}/metrics", params=params))

    def job_logs(self, job_id: str, tail_bytes: int | None = None) -> LogsPublic:
        params = {"tail_bytes": tail_bytes} if tail_bytes is not None else {}
        return parse(LogsPublic, self._request("GET", f"{API}/jobs/{job_id}/logs", params=params))

    # -- nodes and events ---------------------------------------------------------------------
    def list_nodes(self) -> NodesPublic:
        return parse(NodesPublic, self._request("GET", f"{API}/nodes"))

    def list_events(self, job_id: str | None = None, limit: int = 100) -> EventsPublic:
        params: dict[str, Any] = {"limit": limit}
        if job_id:
            params["job_id"] = job_id
        return parse(EventsPublic, self._request("GET", f"{API}/events", params=params))

    # -- telemetry ----------------------------------------------------------------------------
    def post_telemetry(self, batch: TelemetryBatch) -> TelemetryAck:
        return self.post_telemetry_raw(batch.model_dump_json().encode())

    def post_telemetry_raw(self, body: bytes, encoding: str | None = None) -> TelemetryAck:
        """Post an already-serialised batch (``encoding='gzip'`` when ``body`` is gzip-compressed)."""
        headers = {"Content-Type": "application/json"}
        if encoding:
            headers["Content-Encoding"] = encoding
        return parse(TelemetryAck, self._request("POST", f"{API}/telemetry", content=body, headers=headers))

    def post_telemetry_columnar(self, body: bytes, encoding: str | None = None) -> TelemetryAck:
        """Post a columnar batch (:mod:`vigil.contract.schemas.columnar`; ``encoding='gzip'`` when compressed)."""
        headers = {"Content-Type": COLUMNAR_CONTENT_TYPE}
        if encoding:
            headers["Content-Encoding"] = encoding
        return parse(TelemetryAck, self._request("POST", f"{API}{COLUMNAR_PATH}", content=body, headers=headers))

    # -- tokens (admin) -----------------------------------------------------------------------
    def create_token(self, spec: TokenCreate) -> TokenCreated:
        return parse(TokenCreated, self._request("POST", f"{API}/tokens", json=spec.model_dump(mode="json")))

    def list_tokens(self, limit: int = 100, offset: int = 0, include_inactive: bool = True) -> TokensPublic:
        params = {"limit": limit, "offset": offset, "include_inactive": include_inactive}
        return parse(TokensPublic, self._request("GET", f"{API}/tokens", params=params))

    def revoke_token(self, token_id: str) -> TokenPublic:
        return parse(TokenPublic, self._request("POST", f"{API}/tokens/{token_id}/revoke"))

    def whoami(self) -> WhoAmI:
        """Who this client's token is: id, role, name and scope (``GET /whoami``; any valid token)."""
        return parse(WhoAmI, self._request("GET", f"{API}/whoami"))

    # -- fault injection ------------------------------------------------------------------------
    def inject_fault(self, job_id: str, spec: FaultCreate) -> FaultPublic:
        """Cause ``spec.kind`` in a running job once it reaches ``spec.step`` (``POST /jobs/{id}/faults``)."""
        return parse(FaultPublic,
            self._request("POST", f"{API}/jobs/{job_id}/faults", json=spec.model_dump(mode="json")))

    def list_faults(self, job_id: str) -> FaultsPublic:
        """The job's faults, oldest first (``GET /jobs/{id}/faults``)."""
        return parse(FaultsPublic, self._request("GET", f"{API}/jobs/{job_id}/faults"))

    def clear_fault(self, job_id: str, fault_id: int) -> FaultPublic:
        """Undo a fault: a stopped rank continues, a throttle or a NIC fault ends (409 once cleared or failed)."""
        return parse(FaultPublic, self._request("POST", f"{API}/jobs/{job_id}/faults/{fault_id}/clear"))

    # -- incidents, checkpoints, stacks ---------------------------------------------------------
    def list_incidents(self, job_id: str | None = None, limit: int = 100) -> IncidentsPublic:
        """Incidents, newest first, of one job with ``job_id`` (``GET /incidents``)."""
        params = _drop_none(job_id=job_id, limit=limit)
        return parse(IncidentsPublic, self._request("GET", f"{API}/incidents", params=params))

    def job_incidents(self, job_id: str) -> IncidentsPublic:
        """All of one job's incidents, oldest first (``GET /jobs/{id}/incidents``)."""
        return parse(IncidentsPublic, self._request("GET", f"{API}/jobs/{job_id}/incidents"))

    def job_checkpoints(self, job_id: str) -> CheckpointsPublic:
        """Checkpoints the job reported, oldest first (``GET /jobs/{id}/checkpoints``)."""
        return parse(CheckpointsPublic, self._request("GET", f"{API}/jobs/{job_id}/checkpoints"))

    def job_stacks(self, job_id: str) -> StacksPublic:
        """The newest py-spy stacks of the job's ranks, grouped (``GET /jobs/{id}/stacks``)."""
        return parse(StacksPublic, self._request("GET", f"{API}/jobs/{job_id}/stacks"))

    # -- manual recovery and eviction -------------------------------------------------------------
    def recover_job(self, job_id: str, request: RecoverRequest) -> IncidentPublic:
        """Restart a RUNNING job's ranks from its newest valid checkpoint (``POST /jobs/{id}/recover``);
        the answer is the incident that records it."""
        return parse(IncidentPublic,
            self._request("POST", f"{API}/jobs/{job_id}/recover", json=request.model_dump(mode="json")))

    def evict_node(self, node_id: str, deadline_s: float = 5.0) -> NodeActionPublic:
        """Drain a node in Ray, its ranks get ``deadline_s`` to checkpoint; it stays out until readmitted
        (``POST /nodes/{id}/evict``)."""
        return parse(NodeActionPublic,
            self._request("POST", f"{API}/nodes/{node_id}/evict", params={"deadline_s": deadline_s}))

    def readmit_node(self, node_id: str) -> NodeActionPublic:
        """Take an evicted node back: its agent starts a fresh raylet (``POST /nodes/{id}/readmit``)."""
        return parse(NodeActionPublic, self._request("POST", f"{API}/nodes/{node_id}/readmit"))

    # -- node commands (agent role) -------------------------------------------------------------
    def node_commands(self, node_id: str, status: str | None = "PENDING", wait_s: float = 0.0) -> NodeCommandsPublic:
        """Commands for ``node_id``'s agent (``GET /nodes/{id}/commands``), oldest first; ``status=None``: all.
        ``wait_s``: when none is pending, the controller answers as soon as one is queued, or after that long
        (a long poll; this request's timeout is the client's plus ``wait_s``)."""
        params: dict[str, Any] = {"status": status if status is not None else "ALL"}
        kwargs: dict[str, Any] = {}
        if wait_s > 0:
            params["wait_s"] = wait_s
            if self._http.timeout.read is not None:
                kwargs["timeout"] = self._http.timeout.read + wait_s
        return parse(NodeCommandsPublic,
            self._request("GET", f"{API}/nodes/{node_id}/commands", params=params, **kwargs))

    def post_command_result(self, node_id: str, command_id: int, result: CommandResult) -> Any:
        """The agent's answer to one command; idempotent (a second answer is ignored by the controller)."""
        return self._request("POST", f"{API}/nodes/{node_id}/commands/{command_id}/result",
                             json=result.model_dump(mode="json"))

    # -- telemetry series ---------------------------------------------------------------------
    def job_steps(
        self, job_id: str, *, since_step: int | None = None, until_step: int | None = None,
        since_ts: float | None = None, until_ts: float | None = None, ranks: list[int] | None = None,
        max_points: int = 2000, max_ranks: int = 1024,
    ) -> JobStepsPublic:
        """Per-rank step breakdown (``GET /jobs/{id}/steps``)."""
        params = _drop_none(since_step=since_step, until_step=until_step, since_ts=since_ts, until_ts=until_ts,
                            ranks=ranks, max_points=max_points, max_ranks=max_ranks)
        return parse(JobStepsPublic, self._request("GET", f"{API}/jobs/{job_id}/steps", params=params))

    def job_collectives(
        self, job_id: str, *, since_step: int | None = None, until_step: int | None = None,
        since_ts: float | None = None, until_ts: float | None = None, ranks: list[int] | None = None,
        ops: list[str] | None = None, max_points: int = 2000, raw: bool = False, raw_limit: int = 10_000,
    ) -> JobCollectivesPublic:
        """Collective aggregates per kind and step, and each rank's calls with ``raw`` (``GET /jobs/{id}/collectives``)."""
        params = _drop_none(since_step=since_step, until_step=until_step, since_ts=since_ts, until_ts=until_ts,
                            ranks=ranks, ops=ops, max_points=max_points, raw=raw, raw_limit=raw_limit)
        return parse(JobCollectivesPublic,
            self._request("GET", f"{API}/jobs/{job_id}/collectives", params=params))

    # -- derived views (dashboard, CLI) -----------------------------------------------------------
    def job_overview(
        self, job_id: str, *, since_step: int | None = None, top_k: int = 10, rank_window: int = 50,
        max_points: int = 2000,
    ) -> JobOverviewPublic:
        """Job-wide figures per step, the slowest ranks and the markers (``GET /jobs/{id}/overview``)."""
        params = _drop_none(since_step=since_step, top_k=top_k, rank_window=rank_window, max_points=max_points)
        return parse(JobOverviewPublic, self._request("GET", f"{API}/jobs/{job_id}/overview", params=params))

    def job_heatmap(
        self, job_id: str, *, since_step: int | None = None, max_ranks: int = 128, max_steps: int = 200,
    ) -> StepHeatmapPublic:
        """Step time rank x step, binned server side (``GET /jobs/{id}/heatmap``)."""
        params = _drop_none(since_step=since_step, max_ranks=max_ranks, max_steps=max_steps)
        return parse(StepHeatmapPublic, self._request("GET", f"{API}/jobs/{job_id}/heatmap", params=params))

    def job_goodput(self, job_id: str) -> GoodputPublic:
        """Productive time against time lost per cause, and the ETTR (``GET /jobs/{id}/goodput``)."""
        return parse(GoodputPublic, self._request("GET", f"{API}/jobs/{job_id}/goodput"))

    def job_seconds_lost(self, job_id: str, max_points: int = 2000) -> SecondsLostPublic:
        """Seconds lost to slow ranks, per step, rank and node (``GET /jobs/{id}/stragglers``)."""
        return parse(SecondsLostPublic,
            self._request("GET", f"{API}/jobs/{job_id}/stragglers", params={"max_points": max_points}))

    def node_history(self, node_id: str, *, since_ts: float | None = None, max_points: int = 500) -> NodeHistoryPublic:
        """A node's host metrics over time (``GET /nodes/{id}/history``)."""
        params = _drop_none(since_ts=since_ts, max_points=max_points)
        return parse(NodeHistoryPublic, self._request("GET", f"{API}/nodes/{node_id}/history", params=params))

    def prometheus_metrics(self) -> str:
        """The controller's ``/metrics`` text (Prometheus exposition format)."""
        resp = self._http.get("/metrics")
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text)
        return resp.text


def _drop_none(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}
