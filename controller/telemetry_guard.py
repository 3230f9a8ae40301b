"""Telemetry bound to its job: which node may speak for a job, and where a job's checkpoints may be.

An agent token is scoped to its node (``check_node_scope``), but a rank on that node could still post samples
for any other job through its agent (NaN loss, dead ranks: Vigil would restart that job until it failed) or
record a "checkpoint" anywhere (a later restart would load it). So, at ingest (:func:`controller.telemetry.store`):

- samples of job X are kept from node N only when Ray placed one of X's ranks (its Ray Train workers or live
  replicas) on N, now or earlier in the job's life (spooled samples arrive after the job ends); never the head
  for a job with no rank there (every job's driver lives on the head);
- a checkpoint of job X is recorded only inside X's own folders of the checkpoint storage (a folder, or a URI
  such as ``s3://bucket/prefix``: the same rule on the URI's string, no ``.``, ``..`` or empty segment).

The rest is refused and counted (``vigil_telemetry_refused_samples_total{reason}``) with an event (at most one a
minute per job, node and reason), never stored. Placement comes from Ray (:meth:`RayJobLauncher.placement`);
where the controller cannot ask (no Ray cluster, Ray not answering, a node not named as its Ray node), the
node check is skipped: telemetry is never lost to an outage of Ray's API (docs/SECURITY.md).
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable

from prometheus_client import Counter
from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.jobs import record_event
from controller.models import Job
from vigil.contract.checkpoint_layout import is_uri, normalise_uri, slugify

log = logging.getLogger(__name__)

REFUSED = Counter("vigil_telemetry_refused_samples", "Samples refused at ingest: from a node that runs none of "
                  "the job's processes (node), or a checkpoint outside the job's storage (checkpoint_path).",
                  ["reason"], registry=None)

Placement = Callable[[str], "tuple[set[str], set[str]] | None"]
"""A launch id (Ray submission id) -> (the names of the nodes the job's processes ran on, every Ray node's
name); None: cannot tell."""


def ray_placement(launcher: object, cluster: object) -> Placement | None:
    """Placement from Ray (:meth:`controller.launcher.RayJobLauncher.placement`, node names from the cluster's
    node table), or None where the controller has no Ray cluster to ask."""
    placement, nodes = getattr(launcher, "placement", None), getattr(cluster, "nodes", None)
    if placement is None or nodes is None:
        return None

    def where(launch_id: str) -> tuple[set[str], set[str]] | None:
        try:
            ids = placement(launch_id)
            names = {n.node_id: n.name for n in nodes()}
        except Exception as exc:  # noqa: BLE001 - Ray's API busy or down: skip the check, keep the telemetry
            log.warning("cannot tell where %s runs (%s): its samples are not checked against their node", launch_id, exc)
            return None
        # A node is known by its Ray name (vigil up, ray start) or, where it has none, by its Ray node id.
        return {names[i] for i in ids if i in names} | set(ids), set(names.values()) | set(names)

    return where


def _norm(path: str) -> str | None:
    """``path`` with ``.``, ``..`` and doubled slashes resolved; a URI normalised
    (:func:`~vigil.contract.checkpoint_layout.normalise_uri`), or None when it holds a ``.``, ``..`` or empty
    segment: an object store takes those literally, so no prefix comparison could place it."""
    if is_uri(path):
        try:
            return normalise_uri(path)
        except ValueError:
            return None
    return posixpath.normpath(path)


class TelemetryGuard:
    """The two checks above, with a per-job cache of placement refreshed at most every ``min_refresh_s``."""

    def __init__(self, storage: str, placement: Placement | None, *, min_refresh_s: float = 0.5,
                 event_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        norm = _norm(str(storage))
        if norm is None:
            raise ValueError(f"checkpoint storage {storage!r}: not a usable folder or URI")
        self.storage = norm
        self._placement = placement
        self._min_refresh_s = min_refresh_s
        self._event_every_s = event_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[set[str], float]] = {}  # job -> (nodes seen, when last asked)
        self._events: dict[tuple[str, str, str], float] = {}

    # -- which node may speak for a job ----------------------------------------------------------
    def node_allowed(self, session: Session, job_id: str, node_id: str) -> bool:
        if self._placement is None:
            return True
        now = self._clock()
        with self._lock:
            seen, asked = self._nodes.get(job_id, (set(), float("-inf")))
        if node_id in seen:
            return True
        if now - asked < self._min_refresh_s:
            return False
        launch = session.scalar(select(Job.ray_job_id).where(Job.id == job_id))
        found = self._placement(launch) if launch else (set(), None)
        if found is None:
            return True  # Ray cannot tell: the check is skipped, not the telemetry
        job_nodes, ray_names = found
        if ray_names is not None and node_id not in ray_names:
            return True  # an agent not named after its Ray node: nothing to check it against
        with self._lock:
            seen = self._nodes.get(job_id, (set(), now))[0] | job_nodes
            self._nodes[job_id] = (seen, now)
        return node_id in seen

    # -- where a job's checkpoints may be ---------------------------------------------------------
    def checkpoint_allowed(self, job_id: str, path: str) -> bool:
        """Inside ``<storage>/<slug>/`` (Vigil's layout and the job's files) or ``<storage>/vigil-<slug>/`` (Ray
        Train's run folder): a folder's ``..`` resolved first; a URI with a ``.``, ``..`` or empty segment refused."""
        norm, slug = _norm(path), slugify(job_id)
        if norm is None:
            return False
        return any(norm.startswith(f"{self.storage.rstrip('/')}/{folder}/") for folder in (slug, f"vigil-{slug}"))

    # -- refusals ----------------------------------------------------------------------------------
    def refused(self, session: Session, job_id: str, node_id: str, reason: str, count: int, detail: str) -> None:
        """Count ``count`` refused samples and, at most once a minute per (job, node, reason), record an event."""
        REFUSED.labels(reason).inc(count)
        now, key = self._clock(), (job_id, node_id, reason)
        with self._lock:
            if now - self._events.get(key, float("-inf")) < self._event_every_s:
                return
            self._events[key] = now
        log.warning("refused %d samples of job %s from node %s: %s", count, job_id, node_id, detail)
        record_event(session, "telemetry_refused", f"{count} samples from node {node_id} refused: {detail}",
                     job_id=job_id, node_id=node_id, data={"reason": reason, "samples": count})
