"""The driver side of live recovery (``recovery.policy: live``, :mod:`vigil.live`): lighthouse + one Ray actor per rank.

Ray Train owns a worker group that lives and dies as one; live recovery needs the opposite, ranks that
come and go on their own while the others train on, so each rank is a Ray actor of its own:

* ``max_restarts``: Ray starts a dead replica's process again (kill -9, a node lost, Vigil killing a
  hung or slow rank) on a node with room; a drained (evicted) node gets none. ``max_task_retries``:
  the replica's ``run`` is called again there, and it heals from a live peer. With ``recovery.spares``
  the driver replaces it instead, by a spare already started (:mod:`vigil.live_replicas`).
* the lighthouse (torchft's quorum server) runs in this driver process: the job lives as long as its
  driver anyway.
* the driver watches the nodes its replicas run on (:mod:`vigil.live_watch`): a node whose raylet stops
  answering has its replicas started again elsewhere before Ray declares it dead.

Restarts are bounded by ``recovery.max_restarts`` restarts in a row *without progress* (for a replaced
replica, progress is the job's newest step moving on: :mod:`vigil.contract.restarts`, the one definition):
the controller applies it and fails a job that does not progress across them (docs/RECOVERY.md). This
driver does not apply it; Ray's own per-replica bound is a generous backstop.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from vigil.contract.checkpoint_layout import as_location

log = logging.getLogger(__name__)


def lighthouse_address(server_address: str, host: str) -> str:
    """The lighthouse's address as the replicas on other nodes reach it: ``host`` and the server's port."""
    port = urlparse(server_address).port
    if port is None:
        raise RuntimeError(f"lighthouse address {server_address!r} has no port")
    return f"http://{host}:{port}"


def run_live(config: dict[str, Any], *, replicas: int, min_replicas: int, cpus_per_replica: float) -> dict[str, Any]:
    """Run the job's ranks as live replicas until every one has reached the last step; rank 0's result."""
    import ray

    from vigil.checkpointing import Checkpointer
    from vigil.live import start_lighthouse
    from vigil.live_replicas import Replicas
    from vigil.live_trust import new_key

    # One run attempt for every replica (telemetry's exactly-once key): replacements run new steps only.
    claimer = Checkpointer(as_location(config["checkpoint_root"]), rank=0, world_size=1, job_id=config["job_id"],
                           async_save=False)
    # The run's heal key (vigil.live_trust): only its replicas hold it, so only they can heal each other.
    config = {**config, "attempt": claimer.claim_attempt(), "heal_key": new_key()}
    claimer.close()
    server = start_lighthouse(min_replicas)
    address = lighthouse_address(server.address(), ray.util.get_node_ip_address())
    log.info("live recovery: lighthouse at %s, %d replicas (quorum of at least %d)", address, replicas, min_replicas)
    spares = int(config["spec"].get("recovery", {}).get("spares", 0))
    pool = Replicas(config, replicas, min_replicas, address, cpus_per_replica, spares=spares)
    try:
        pool.ready()
        results = pool.gather(int(config["spec"]["steps"]))
    finally:
        pool.kill()
        server.shutdown()
    for r in results.values():
        log.info("live replica %d: step %d, heals %s, quorums at a step's start %d, re-formed in a step %d",
                 r["rank"], r["step"], r["heals"], r.get("quorums"), r["reforms"])
    return results[min(results)]
