"""The live driver's replicas (:mod:`vigil.live_driver`): one Ray actor per rank, warm spares, and the watch on
their nodes (:mod:`vigil.live_watch`).

Without spares (``recovery.spares: 0``) Ray starts a dead replica's process again (``max_restarts``) and
runs it again there; the new process imports torch and the job's code before it can heal (seconds on a
busy machine). With spares, that many more replica actors are started and kept idle with torch and the
job's code imported (:meth:`ReplicaActor.ready`), on whatever node has room; the driver replaces a replica
whose actor died (killed, ``kill -9``, its node lost, a replica that lost its place and exited) by a spare,
which takes the dead one's rank and heals from a live peer, and starts a new spare behind it. Replicas
then have no Ray restarts (``max_restarts: 0``): the driver is the one that replaces them, once each.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from vigil.contract.checkpoint_layout import as_location
from vigil.contract.schemas import TRAINING_THREAD

log = logging.getLogger(__name__)

EXIT_REJOIN = 75
"""Exit status of a replica that restarts to heal again (Ray restarts the actor)."""
FINISH_GRACE_S = 60.0
"""Once a replica has run the last step, how long the others get to finish."""
ACTOR_RESTARTS_PER_RANK = 1000
"""Ray's bound on one replica's restarts (a backstop, not ``max_restarts``: the controller applies that,
:mod:`vigil.contract.restarts`, and fails a job that stops progressing)."""


class ReplicaActor:
    """One rank of a live job (a Ray actor): a torchft replica running the job's entry point."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int, min_replicas: int, lighthouse: str,
                 replacement: bool = False) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.min_replicas = min_replicas
        self.lighthouse = lighthouse
        self.replacement = replacement
        """Started by the driver in place of a replica on a lost node (:mod:`vigil.live_watch`): it heals."""

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> int:
        """Import what a replica needs (seconds of torch on a busy machine) so that the replicas join their
        first quorum together, and a spare that takes a rank over starts training at once; returns the pid."""
        import importlib

        import torch  # noqa: F401
        import torchft.manager  # noqa: F401

        import vigil.checkpointing.checkpointer  # noqa: F401 - torch.distributed.checkpoint: 1.6 s on a quiet machine
        from vigil.optim import REGISTRY
        from vigil.runner import load_function, parse_entrypoint

        entry = parse_entrypoint(self.config["spec"].get("entrypoint") or "")
        if not entry.is_script:
            load_function(entry)
        kind = (self.config["spec"].get("optimizer") or {}).get("kind")
        if kind in REGISTRY:  # the optimizer's own module, as the session will build it
            importlib.import_module(REGISTRY[kind].partition(":")[0])
        return os.getpid()

    def run(self, rank: int | None = None, replacement: bool = False) -> dict[str, Any]:
        """Train as rank ``rank`` (a spare is told which rank it takes over; the others keep theirs)."""
        import ray

        spare = rank is not None  # only a spare is told its rank when it starts
        if spare:
            self.rank, self.replacement = rank, replacement

        from vigil.live import LiveError, LiveReplica
        from vigil.live_trust import ForeignQuorum
        from vigil.runner import final_metrics, run_rank

        # The training thread's name lets a py-spy dump of a hung rank be read from the right thread.
        threading.current_thread().name = TRAINING_THREAD
        host = ray.util.get_node_ip_address()
        live = LiveReplica(rank=self.rank, world_size=self.world_size, min_replicas=self.min_replicas,
                           lighthouse=self.lighthouse, host=host, attempt=int(self.config["attempt"]),
                           checkpoint_root=as_location(self.config["checkpoint_root"]),
                           replacement=self.replacement or ray.get_runtime_context().was_current_actor_reconstructed,
                           quorum_every=int(self.config["spec"].get("recovery", {}).get("quorum_every_steps", 1)),
                           spare=spare, heal_key=self.config["heal_key"])
        try:
            summary = run_rank(self.config, self.rank, self.world_size, live=live)
        except (LiveError, ForeignQuorum) as e:
            # Not the user's error: this replica lost its place (a step it could not commit, a quorum it
            # missed). Its process ends so that Ray (or, with spares, the driver) starts it again, and it
            # heals from a live peer.
            log.error("rank %d: %s; exiting for a restart", self.rank, e)
            os._exit(EXIT_REJOIN)
        return {
            "rank": self.rank, **final_metrics(summary),
            "checkpoint": None, "heals": live.heals, "reforms": live.comm.reforms, "quorums": live.quorums,
        }


PLACEMENT_EVERY_S = 10.0
"""How often the driver asks Ray where its replicas run (Ray moves one only when it restarts it)."""


class Replicas:
    """The job's replica actors, one per rank, its spares, and the driver's watch on their nodes."""

    def __init__(self, config: dict[str, Any], replicas: int, min_replicas: int, lighthouse: str,
                 cpus_per_replica: float, *, spares: int = 0, watch: Any = None) -> None:
        from vigil.live_watch import NodeWatch

        self.config = config
        self.replicas = replicas
        self.min_replicas = min_replicas
        self.lighthouse = lighthouse
        self.cpus = cpus_per_replica
        self.spares = spares
        self.watch = watch if watch is not None else NodeWatch()
        self.env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.started = 0
        self.names: dict[int, str] = {}
        self.actors: dict[int, Any] = {}
        for r in range(replicas):
            self.actors[r], self.names[r] = self._start(f"rank{r}", r)
        self.idle: list[dict[str, Any]] = []
        """Spares: ``{"actor", "name", "ready"}`` (``ready``: the reference of its imports)."""
        self.pending: dict[Any, int] = {}
        self.replaced: list[dict[str, Any]] = []
        """Replicas replaced by the driver: ``{"rank", "why", "spare", "at"}`` (unix time)."""
        self.replacements = dict.fromkeys(range(replicas), 0)
        self.placed: dict[int, str] = {}
        """Rank -> the node its replica runs on, as Ray last said."""
        self._placed_at = float("-inf")

    def _start(self, label: str, rank: int, *, replacement: bool = False) -> tuple[Any, str]:
        import ray

        from vigil.live_watch import avoiding

        self.started += 1
        name = f"vigil-live-{self.config['job_id']}-{label}-{self.started}"
        restarts = 0 if self.spares else ACTOR_RESTARTS_PER_RANK  # with spares the driver replaces, not Ray
        options: dict[str, Any] = {"num_cpus": self.cpus, "max_restarts": restarts,
                                   "max_task_retries": -1 if restarts else 0, "runtime_env": {"env_vars": self.env},
                                   "name": name}
        if self.watch.lost:
            options["label_selector"] = avoiding(self.watch.lost)
        actor = ray.remote(ReplicaActor).options(**options).remote(
            self.config, rank, self.replicas, self.min_replicas, self.lighthouse, replacement)
        return actor, name

    def _start_spare(self) -> None:
        actor, name = self._start("spare", -1)
        self.idle.append({"actor": actor, "name": name, "ready": actor.ready.remote()})

    def ready(self) -> None:
        """Wait for every replica's imports, start them, then start the spares (not waited for: they take
        what room is left, and a spare Ray cannot place yet is still a replacement later)."""
        import ray

        ray.get([a.ready.remote() for a in self.actors.values()])
        self.pending.update({a.run.remote(): r for r, a in self.actors.items()})
        for _ in range(self.spares):
            self._start_spare()

    def _take_spare(self) -> dict[str, Any] | None:
        """The spare to use: one whose imports are done if any (oldest first), else the oldest."""
        import ray

        if not self.idle:
            return None
        done, _ = ray.wait([s["ready"] for s in self.idle], num_returns=len(self.idle), timeout=0)
        ready = [s for s in self.idle if s["ready"] in done]
        spare = (ready or self.idle)[0]
        self.idle.remove(spare)
        if spare in ready:
            try:
                spare["pid"] = ray.get(spare["ready"])
            except ray.exceptions.RayError:  # it died waiting (its node lost): the next one
                return self._take_spare()
        return spare

    def take_over(self, rank: int, why: str) -> None:
        """Rank ``rank`` runs again: on a spare (then a new spare is started) or on a new actor; it heals."""
        self.replacements[rank] += 1
        if self.replacements[rank] > ACTOR_RESTARTS_PER_RANK:
            raise RuntimeError(f"live recovery: rank {rank} was replaced {ACTOR_RESTARTS_PER_RANK} times")
        spare = self._take_spare()
        if spare is not None:
            actor, name = spare["actor"], spare["name"]
            ref = actor.run.remote(rank, True)
            self._start_spare()
            where = f"spare {name} (pid {spare['pid']})" if spare.get("pid") else f"spare {name} (still importing)"
        else:
            actor, name = self._start(f"rank{rank}", rank, replacement=True)
            ref = actor.run.remote()
            where = f"a new actor {name}"
        self.actors[rank], self.names[rank] = actor, name
        self.pending[ref] = rank
        self.replaced.append({"rank": rank, "why": why, "spare": spare is not None, "at": time.time()})
        log.warning("live recovery: rank %d (%s) continues on %s", rank, why, where)
        self.placed.pop(rank, None)
        self._placed_at = float("-inf")  # where it runs now: asked at the next look

    def died(self, rank: int, error: Exception) -> None:
        """Rank ``rank``'s actor died (spares only: without them Ray starts it again itself)."""
        self.take_over(rank, f"its actor died: {type(error).__name__}")

    def look(self) -> None:
        """One look at the replicas' nodes; the replicas of a node newly lost are replaced. Where each replica
        runs is asked of Ray every :data:`PLACEMENT_EVERY_S` (and after a replacement), its nodes probed each time."""
        import ray

        from vigil.live_watch import actor_nodes, alive_raylets

        now = time.monotonic()
        if now >= self._placed_at + PLACEMENT_EVERY_S:
            where = actor_nodes([*self.names.values(), *(s["name"] for s in self.idle)])
            self.placed = {r: where[name] for r, name in self.names.items() if name in where}
            for spare in self.idle:
                spare["node"] = where.get(spare["name"])
            self._placed_at = now
        if not self.placed:
            return
        lost = self.watch.look(alive_raylets(), self.placed.values())
        gone = [s for s in self.idle if s.get("node") in lost]
        for spare in gone:  # a spare on a lost node would take a rank only to hang until Ray gives up the node
            self.idle.remove(spare)
            ray.kill(spare["actor"], no_restart=True)
            self._start_spare()
        for rank, node in sorted(self.placed.items()):
            if node in lost:
                for ref in [ref for ref, r in self.pending.items() if r == rank]:
                    del self.pending[ref]  # in place: _gather waits on this very dict
                ray.kill(self.actors[rank], no_restart=True)
                self.take_over(rank, f"node {node} lost")

    def gather(self, steps: int) -> dict[int, dict[str, Any]]:
        return _gather(self.pending, steps, self.look, self.died if self.spares else None)

    def kill(self) -> None:
        import ray

        for a in [*self.actors.values(), *(s["actor"] for s in self.idle)]:
            ray.kill(a, no_restart=True)


def _gather(pending: dict[Any, int], steps: int, look: Callable[[], None] = lambda: None,
            died: Callable[[int, Exception], None] | None = None) -> dict[int, dict[str, Any]]:
    """Every replica's result, calling ``look`` between waits while the job trains (it may swap a replica's
    entry in ``pending``); a replica's failure (the user's code raised) fails the job. A replica whose actor
    died is handed to ``died`` (which puts its successor in ``pending``) when given; else that fails the job
    too (without spares Ray starts the actor again and the result comes from there). Once one replica has
    run the last step the job is trained (the replicas hold the same state at every step): the others get
    :data:`FINISH_GRACE_S` to finish, then are given up (one Ray cannot place, say)."""
    import ray

    from vigil.live_watch import WATCH_INTERVAL_S

    results: dict[int, dict[str, Any]] = {}
    deadline: float | None = None
    while pending:
        if deadline is not None and time.monotonic() >= deadline:
            log.warning("live recovery: the job is trained; replica(s) %s did not finish within %.0f s of the first "
                        "(not placed?): given up", sorted(pending.values()), FINISH_GRACE_S)
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=WATCH_INTERVAL_S)
        if not ready:
            if deadline is None:
                look()
            continue
        rank = pending.pop(ready[0])
        try:
            results[rank] = ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            if died is None:
                raise
            if deadline is None:  # once the job is trained a replica that died is only given up
                died(rank, e)
            continue
        if deadline is None and results[rank]["step"] >= steps:
            deadline = time.monotonic() + FINISH_GRACE_S
    return results
