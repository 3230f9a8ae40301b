"""The driver side of live recovery (``recovery.policy: live``, :mod:`vigil.live`): lighthouse + one Ray actor per rank.

Ray Train owns a worker group that lives and dies as one; live recovery needs the opposite, ranks that
come and go on their own while the others train on, so each rank is a Ray actor of its own:

* ``max_restarts``: Ray starts a dead replica's process again (kill -9, a node lost, Vigil killing a
  hung or slow rank) on a node with room; a drained (evicted) node gets none. ``max_task_retries``:
  the replica's ``run`` is called again there, and it heals from a live peer.
* the lighthouse (torchft's quorum server) runs in this driver process: the job lives as long as its
  driver anyway.

Restarts are bounded by ``recovery.max_restarts`` per rank *without progress*: the controller fails a
job that does not progress across them (docs/RECOVERY.md); Ray's own bound is a generous backstop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlparse

from controller.checkpoint_layout import as_location
from controller.schemas import TRAINING_THREAD

log = logging.getLogger(__name__)

EXIT_REJOIN = 75
"""Exit status of a replica that restarts to heal again (Ray restarts the actor)."""
FINISH_GRACE_S = 60.0
"""Once a replica has run the last step, how long the others get to finish."""
ACTOR_RESTARTS_PER_RANK = 1000
"""Ray's bound on one replica's restarts (a backstop: the controller fails a job that stops progressing)."""


class ReplicaActor:
    """One rank of a live job (a Ray actor): a torchft replica running the job's entry point."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int, min_replicas: int, lighthouse: str) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.min_replicas = min_replicas
        self.lighthouse = lighthouse

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> int:
        """Import what a replica needs (seconds of torch on a busy machine) so that the replicas join their
        first quorum together; returns the pid."""
        import torch  # noqa: F401
        import torchft.manager  # noqa: F401

        from vigil.runner import load_function, parse_entrypoint

        entry = parse_entrypoint(self.config["spec"].get("entrypoint") or "")
        if not entry.is_script:
            load_function(entry)
        return os.getpid()

    def run(self) -> dict[str, Any]:
        import ray

        from vigil.live import LiveError, LiveReplica
        from vigil.runner import run_rank

        # The training thread's name lets a py-spy dump of a hung rank be read from the right thread.
        threading.current_thread().name = TRAINING_THREAD
        host = ray.util.get_node_ip_address()
        live = LiveReplica(rank=self.rank, world_size=self.world_size, min_replicas=self.min_replicas,
                           lighthouse=self.lighthouse, host=host, attempt=int(self.config["attempt"]),
                           checkpoint_root=as_location(self.config["checkpoint_root"]),
                           replacement=ray.get_runtime_context().was_current_actor_reconstructed)
        try:
            summary = run_rank(self.config, self.rank, self.world_size, live=live)
        except LiveError as e:
            # Not the user's error: this replica lost its place (a step it could not commit, a quorum it
            # missed). Its process ends so that Ray starts it again, and it heals from a live peer.
            log.error("rank %d: %s; exiting for a restart", self.rank, e)
            os._exit(EXIT_REJOIN)
        losses = [v for _, v in sorted(summary.losses.items()) if v is not None]
        return {
            "rank": self.rank, "step": summary.final_step, "start_step": summary.start_step,
            "loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
            "val_loss": summary.val_losses[max(summary.val_losses)] if summary.val_losses else None,
            "checkpoint": None, "heals": live.heals, "reforms": live.comm.reforms,
        }


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

    # One run attempt for every replica (telemetry's exactly-once key): replacements run new steps only.
    claimer = Checkpointer(as_location(config["checkpoint_root"]), rank=0, world_size=1, job_id=config["job_id"],
                           async_save=False)
    config = {**config, "attempt": claimer.claim_attempt()}
    claimer.close()
    server = start_lighthouse(min_replicas)
    address = lighthouse_address(server.address(), ray.util.get_node_ip_address())
    log.info("live recovery: lighthouse at %s, %d replicas (quorum of at least %d)", address, replicas, min_replicas)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    actor = ray.remote(ReplicaActor)
    actors = [
        actor.options(num_cpus=cpus_per_replica, max_restarts=ACTOR_RESTARTS_PER_RANK, max_task_retries=-1,
                      runtime_env={"env_vars": env}).remote(config, r, replicas, min_replicas, address)
        for r in range(replicas)
    ]
    steps = int(config["spec"]["steps"])
    try:
        ray.get([a.ready.remote() for a in actors])
        results = _gather({a.run.remote(): r for r, a in enumerate(actors)}, steps)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        server.shutdown()
    for r in results.values():
        log.info("live replica %d: step %d, heals %s, quorums re-formed in a step %d", r["rank"], r["step"],
                 r["heals"], r["reforms"])
    return results[min(results)]


def _gather(pending: dict[Any, int], steps: int) -> dict[int, dict[str, Any]]:
    """Every replica's result; a replica's failure (the user's code raised) fails the job. Once one
    replica has run the last step the job is trained (the replicas hold the same state at every step):
    the others get :data:`FINISH_GRACE_S` to finish, then are given up (one Ray cannot place, say)."""
    import ray

    results: dict[int, dict[str, Any]] = {}
    deadline: float | None = None
    while pending:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
        if not ready:
            log.warning("live recovery: the job is trained; replica(s) %s did not finish within %.0f s of the first "
                        "(not placed?): given up", sorted(pending.values()), FINISH_GRACE_S)
            break
        ref = ready[0]
        rank = pending.pop(ref)
        results[rank] = ray.get(ref)
        if deadline is None and results[rank]["step"] >= steps:
            deadline = time.monotonic() + FINISH_GRACE_S
    return results
