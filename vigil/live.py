"""Live recovery (``recovery.policy: live``): every rank is a torchft replica; survivors train through a failure.

Under the default path a fault stops the whole job: Ray Train tears the worker group down and restores
the newest disk checkpoint on a new one. Under ``live`` each rank is a torchft replica group of one:

* the driver runs torchft's lighthouse (:func:`start_lighthouse`) and one Ray actor per rank
  (:mod:`vigil.live_driver`); Ray restarts an actor whose process died (a kill, a node lost, Vigil
  killing a hung or slow rank), away from drained nodes;
* every step opens with a quorum (torchft ``Manager.start_quorum``): a replica that left drops out of
  it, a new one joins it and *heals*: it receives the model, optimizer and data position from a live
  peer over torchft's checkpoint transport (HTTP), not from disk;
* the cross-replica collectives still go through Vigil's communication layer (:class:`LiveComm`), so
  they stay timed and counted. A collective that fails because a peer died is run again, with the same
  local contribution, in a new quorum of the survivors: the survivors lose no step, the step averages
  over the replicas that finished it;
* disk checkpoints stay, for whole-job failures: the quorum's first replica writes them (a world of
  one, every rank's state being the same); a job whose replicas all start at step 0 restores the
  newest valid one.

Which optimizers can be live: those whose cross-replica traffic is all-reduce
(:data:`vigil.contract.schemas.LIVE_OPTIMIZERS`); sharded state (SDP4Bit, compressed Adam, the sharded
outer state of DSM / SlowMo) cannot be healed from one peer and keeps the restart path.

Bounds (docs/RECOVERY.md): a dead peer is noticed when its collective fails (at once for a killed
process) or after :data:`COLLECTIVE_TIMEOUT_S` (a hung one); the survivors then wait for the
lighthouse to drop it (:data:`HEARTBEAT_TIMEOUT_MS` without heartbeats, or :data:`JOIN_TIMEOUT_MS`
for a hung replica whose process still heartbeats).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vigil.comm import Comm

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_MS = 500
"""Lighthouse: a replica silent this long is out of the next quorum (managers beat every 100 ms, from a Rust
thread of their own, which the Python GIL does not hold up: five beats missed). A dead replica holds the
survivors' next quorum this long: with a kill every 60 s, 2 s of it kept ETTR at 0.973, 1 s at 0.977
(docs/BENCHMARKS.md)."""
JOIN_TIMEOUT_MS = 5000
"""Lighthouse: how long a quorum waits for a replica that beats but did not ask (a slow one; a hung one,
once: a quorum without it is not waited on again). Shorter leaves replicas out of quorums on a busy machine."""
QUORUM_TICK_MS = 10
"""Lighthouse: how often it looks for a quorum (each step waits for one)."""
COLLECTIVE_TIMEOUT_S = 10.0
"""A collective (and a heal's transfer) taking longer fails: bounds how long survivors wait for a hung peer."""
QUORUM_TIMEOUT_S = 120.0
"""How long a replica waits for a quorum of ``min_replicas`` (a lone survivor waits for company)."""
REPLACEMENT_WAIT_S = 60.0
"""How long a replacement (a replica Ray started again) keeps asking for a quorum with a live peer to heal
from before it takes the disk checkpoint instead (every peer gone too: a whole-job failure)."""
RETRY_PAUSE_S = 0.5
"""Pause between a replacement's quorum requests while it waits for a peer."""
RETRIES = 4
"""Times a failed collective is run again in a new quorum before the step fails (and the replica restarts)."""
SEQ_PER_STEP = 1 << 20
"""A live all-reduce's number in the watcher's reports: step x this + its place in the step (the same on every
replica; torchft's own process groups are new at each quorum, their numbers are not comparable)."""
KEY_LIVE = "vigil_live"
KEY_ATTEMPT = "attempt"


class LiveError(RuntimeError):
    """Something live recovery cannot do (an unsupported collective), or a step that could not complete."""


def quiet_torchft_logs() -> None:
    """torchft's Rust side logs every quorum at INFO to stderr (several lines per step): warnings only."""
    os.environ.setdefault("RUST_LOG", "warn")


def start_lighthouse(min_replicas: int, bind: str = "[::]:0", join_timeout_ms: int = JOIN_TIMEOUT_MS) -> Any:
    """torchft's lighthouse (a Rust server in this process): ``.address()`` is what replicas join."""
    quiet_torchft_logs()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)


def mark_failed(manager: Any) -> None:
    """Make the next quorum a new one even if its members are the same (torchft 0.2.0 keeps the quorum
    id, and with it each replica's process group, while the members do not change; the lighthouse
    starts a new one when a member reports a failed commit). A collective that timed out (a peer alive
    but not in it: its heal failed, it was paused) leaves the process group broken: it must be rebuilt,
    or every retry fails on it. torchft counts this in ``should_commit``, which runs once per step;
    Vigil's retries run inside a step, so they count it themselves."""
    manager._commit_failures += 1


def sum_over_quorum(manager: Any, tensor: torch.Tensor) -> None:
    """SUM all-reduce of ``tensor`` over the quorum's process group, waited on. A failure (a peer died, or the
    process group's timeout for a hung one) is reported to the manager, whose ``errored()`` the caller reads,
    as torchft's ``Manager.allreduce`` reports it.

    The process group is called directly: ``Manager.allreduce`` chains a timeout future and two callbacks, each
    run on another thread, which cost about 1 ms per all-reduce on this machine (the gloo process group has its
    own timeout, :data:`COLLECTIVE_TIMEOUT_S`). The quorum is complete here (``use_async_quorum=False``), so
    the group is the quorum's; a replica left out of it contributes zeros, as torchft's does."""
    from torch.distributed import AllreduceOptions, ReduceOp

    if not manager.is_participating():
        tensor.zero_()
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    try:
        manager._pg.allreduce([tensor], opts).wait()
    except Exception as e:  # noqa: BLE001 - any failure of the collective: the step is retried in a new quorum
        manager.report_error(e)


def commit_step(manager: Any) -> bool:
    """torchft's ``Manager.should_commit`` for a replica group of one (Vigil's: each rank is its own group),
    without its round trip to the group's manager server, which only agrees among a group's ranks (about
    1 ms per step here). A replica healing, or with a recovery stream to wait for (CUDA), takes torchft's own."""
    if manager._healing or manager._recovery_event is not None or manager._group_world_size != 1:
        return bool(manager.should_commit())
    if err := manager._pg.errored():
        manager.report_error(err)
    ok = manager.num_participants() >= manager._min_replica_size and manager.errored() is None
    manager._checkpoint_transport.disallow_checkpoint()
    if ok:
        manager._step += 1
        manager._batches_committed += manager.num_participants()
        manager._commit_failures = 0
    else:
        manager._commit_failures += 1
    return ok


class LiveComm(Comm):
    """Vigil's communication layer over a torchft manager: all-reduces only, timed and counted as always.

    ``world_size`` is the number of replicas in the current quorum (strategies divide by it after a
    sum). A failed all-reduce (a peer died or hung) is run again, from a copy of this rank's input,
    in a new quorum of the survivors (:data:`RETRIES` times).
    """

    def __init__(self, manager: Any, rank: int, world_size: int) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self.manager = manager
        self.reforms = 0
        """Quorums formed again inside a step because a collective failed."""
        self._calls = 0  # all-reduces entered in this step
        self._entered = self._done = -1
        self._inside: tuple[int, float] | None = None  # (seq, wall time entered)
        self._done_at: float | None = None

    def set_step(self, step: int) -> None:
        # A heal is recorded under the first step the replica runs (before the step opens): keep its seq.
        if step != self.step:
            super().set_step(step)
            self._calls = 0

    def progress(self) -> dict[str, Any]:
        """Where this replica stands in its all-reduces, as :func:`vigil.rank.watch.progress` says it from
        torch's Flight Recorder (which does not see torchft's process groups): group ``world``, each
        all-reduce numbered by its step and its place in the step (:data:`SEQ_PER_STEP`), the same on
        every replica, a healed one included (they run the same steps)."""
        from vigil.contract.schemas import CollectiveRef, GroupProgress

        inside, entered, done, done_at = self._inside, self._entered, self._done, self._done_at
        if entered < 0:
            return {"groups": [], "in_flight": [], "last_done": None}
        return {"groups": [GroupProgress(group="world", last_enqueued=entered, last_completed=done)],
                "in_flight": [] if inside is None else [CollectiveRef(group="world", seq=inside[0], op="all_reduce",
                                                                      enqueued_ts=inside[1])],
                "last_done": None if done < 0 else CollectiveRef(group="world", seq=done, op="all_reduce",
                                                                 enqueued_ts=done_at)}

    def _participants(self) -> int:
        return max(1, int(self.manager.num_participants()))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, *,
                   group: dist.ProcessGroup | None = None, group_name: str = "world", tag: str = "",
                   elements: int | None = None) -> torch.Tensor:
        if group is not None:
            raise LiveError("live recovery: all-reduce over a sub-group is not supported (replicas are the world)")
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise LiveError(f"live recovery: all-reduce with {op} is not supported (SUM and AVG are)")
        keep = tensor.detach().clone()
        seq = self.step * SEQ_PER_STEP + min(self._calls, SEQ_PER_STEP - 1)
        self._calls += 1
        self._entered, self._inside = seq, (seq, time.time())
        try:
            return self._all_reduce(tensor, op, group_name, tag, elements, keep)
        finally:
            self._done, self._done_at, self._inside = seq, time.time(), None

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group_name: str, tag: str,
                    elements: int | None, keep: torch.Tensor) -> torch.Tensor:
        for attempt in range(RETRIES + 1):
            t0 = time.perf_counter()  # a failed attempt's wait is its reform's (below), not the all-reduce's
            n = self._participants()
            self.world_size = n
            if n > 1:
                sum_over_quorum(self.manager, tensor)
            err = self.manager.errored()
            if err is None:
                if op == dist.ReduceOp.AVG:
                    tensor.div_(n)
                payload = tensor.numel() * tensor.element_size()
                self._record("all_reduce", group_name, tag, payload, int(2 * (n - 1) / n * payload),
                             tensor.numel() if elements is None else elements, t0)
                return tensor
            if attempt == RETRIES:
                break
            log.warning("live: all-reduce failed in a quorum of %d (%s); forming a new quorum", n,
                        str(err.original_exception)[:200])
            self.reforms += 1
            tensor.copy_(keep)
            mark_failed(self.manager)
            self.manager.start_quorum()  # without the replica that failed: the survivors ask again
            # From the failed attempt's start: a hang's long wait is not a usual all-reduce's duration (the
            # controller's yardstick for the next hang, controller.recovery.collective_hang).
            self.record_external("quorum", tag="reform", payload_bytes=0, wire_bytes=0, elements=0,
                                 duration_s=time.perf_counter() - t0)
        raise LiveError(f"live recovery: all-reduce failed {RETRIES + 1} times in a row")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, group: dist.ProcessGroup | None = None,
                  group_name: str = "world", tag: str = "", elements: int | None = None) -> torch.Tensor:
        # The strategies' only broadcast is of the initial weights (tag "init"), before any quorum:
        # torchft's first quorum (init_sync) heals every replica from one instead.
        if tag == "init":
            return tensor
        raise LiveError(f"live recovery: broadcast ({tag or 'untagged'}) is not supported; use an all-reduce method")

    def _unsupported(self, op: str) -> LiveError:
        return LiveError(f"live recovery: {op} is not supported (sharded state cannot be healed from one peer); "
                         "use an all-reduce optimizer or recovery.policy evict_restart")

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, **kw: Any) -> torch.Tensor:
        raise self._unsupported("all-gather")

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        raise self._unsupported("reduce-scatter")

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, **kw: Any) -> torch.Tensor:
        raise self._unsupported("all-to-all")


class LiveReplica:
    """One rank's torchft side: its manager (a replica group of one), its :class:`LiveComm`, heals.

    The session calls :meth:`restore` once (first quorum: heal from a live peer, else the disk
    checkpoint), :meth:`start_step` when a step opens and :meth:`end_step` when it closes.
    """

    def __init__(self, *, rank: int, world_size: int, min_replicas: int, lighthouse: str, host: str,
                 attempt: int = 1, checkpoint_root: Path | str | None = None, replica_prefix: str = "rank_",
                 replacement: bool = False, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 quorum_every: int = 1, spare: bool = False, heal_key: str) -> None:
        quiet_torchft_logs()
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from vigil.live_trust import QuorumGuard, SignedHTTPTransport

        self.rank = rank
        self.world_size = world_size
        self.replacement = replacement
        """Ray started this replica again (its process died): it heals from a live peer, it does not take
        the disk checkpoint while one may be training (see :meth:`restore`)."""
        self.spare = spare
        """A warm spare taking over a lost rank (:mod:`vigil.live_replicas`): its heal is tagged ``spare``."""
        self.base_attempt = attempt
        self.attempt = attempt
        """The run attempt this replica's samples carry: the same on every replica (the driver claims it;
        a replacement takes its peers' when it heals; a whole-job restart from disk claims a new one)."""
        self.checkpoint_root = checkpoint_root
        if quorum_every < 1:
            raise ValueError(f"quorum_every must be >= 1, got {quorum_every}")
        self.quorum_every = quorum_every
        """Steps between quorums while every replica is in (``recovery.quorum_every_steps``); see :meth:`start_step`."""
        self.quorums = 0
        """Quorums this replica asked for at a step's start (restore's and reforms' not counted)."""
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's own
        self._state: dict[str, Callable[[], Any]] = {}
        self._loaders: dict[str, Callable[[Any], None]] = {}
        self.heals: list[dict[str, float]] = []
        """Heals of this replica: ``{"step", "seconds"}`` (received from a live peer)."""
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=collective_timeout_s)),
            load_state_dict=self._load, state_dict=self._save, min_replica_size=min_replicas,
            use_async_quorum=False, timeout=timedelta(seconds=collective_timeout_s),
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S), connect_timeout=timedelta(seconds=30),
            rank=0, world_size=1, store_addr=host, store_port=self._store.port, lighthouse_addr=lighthouse,
            replica_id=f"{replica_prefix}{rank}", hostname=host, init_sync=True,
            # Heals signed with the run's key; quorums checked against the job's ranks (vigil.live_trust).
            checkpoint_transport=SignedHTTPTransport(heal_key, host, timedelta(seconds=collective_timeout_s)),
        )
        self.guard = QuorumGuard(self.manager._client, world_size, replica_prefix)
        self.manager._client = self.guard
        self.comm = LiveComm(self.manager, rank, world_size)
        self._healed: float | None = None
        self._quorum_ready = False  # restore's quorum is the first step's (peers are in that step already)

    # -- state a heal moves ----------------------------------------------------------------------

    def _save(self) -> dict[str, Any]:
        return {**{name: fn() for name, fn in self._state.items()}, KEY_LIVE: {KEY_ATTEMPT: self.attempt}}

    def _load(self, state: dict[str, Any]) -> None:
        for name, fn in self._loaders.items():
            if name in state:
                fn(state[name])
        self.attempt = int(state[KEY_LIVE][KEY_ATTEMPT])
        self._healed = time.perf_counter()

    def register(self, state: Mapping[str, Any]) -> None:
        """The named objects a heal copies from a peer (those given to ``vigil.restore``)."""
        for name, obj in state.items():
            self._state[name] = obj.state_dict
            self._loaders[name] = obj.load_state_dict

    # -- the session's hooks -----------------------------------------------------------------------

    def restore(self, disk_restore: Callable[[], int]) -> int:
        """First quorum: heal from a live peer when the job is under way (the step it is at), else
        (every replica at step 0: a new job, or a whole-job restart) the newest disk checkpoint.

        A replacement whose first quorum holds neither a peer to heal from nor every replica (its peers
        were busy past the lighthouse's join timeout: a long step, a busy machine) asks again, for up to
        :data:`REPLACEMENT_WAIT_S`: restoring the disk checkpoint there would run old steps again beside
        peers that are far ahead. A heal that failed (the peer died in it) is asked again too."""
        t = time.perf_counter()
        deadline = time.monotonic() + (REPLACEMENT_WAIT_S if self.replacement else 0.0)
        tries = 0
        while True:
            tries += 1
            self._healed = None
            self.manager.start_quorum()
            self._quorum_ready = True
            step = int(self.manager.current_step())
            err = self.manager.errored()
            if err is None and self._healed is not None and step > 0:
                seconds = time.perf_counter() - t
                self.heals.append({"step": float(step), "seconds": seconds})
                self.comm.set_step(step + 1)  # the heal shows in the collectives of the first step it runs
                self.comm.record_external("heal", tag="spare" if self.spare else "live", payload_bytes=_state_bytes(self._save()),
                                          wire_bytes=0, elements=0, duration_s=seconds)
                log.info("rank %d healed from a live peer at step %d in %.2f s (%d quorum(s))", self.rank, step,
                         seconds, tries)
                return step
            everyone = int(self.manager.num_participants()) >= self.world_size
            if time.monotonic() >= deadline:
                if err is not None:
                    raise LiveError(f"live recovery: rank {self.rank} could not heal ({err.original_exception}); "
                                    "it restarts and heals again")
                if everyone or not self.replacement:
                    break
                log.warning("rank %d: no live peer to heal from within %.0f s; restoring the disk checkpoint",
                            self.rank, REPLACEMENT_WAIT_S)
                break
            if err is None and everyone:
                break
            if err is not None:
                mark_failed(self.manager)
            if tries == 1:
                log.info("rank %d: first quorum had %d of %d replicas and no peer to heal from (%s); asking again",
                         self.rank, self.manager.num_participants(), self.world_size,
                         "heal failed" if err is not None else "peers busy")
            time.sleep(RETRY_PAUSE_S)
        step = disk_restore()
        if step > 0:
            # Every replica restarts from disk (a whole-job failure, a rollback): the steps after the
            # checkpoint run again, under a new attempt; the replicas of this quorum agree on it.
            self.attempt = self._claim(self.base_attempt + int(getattr(self.manager, "_quorum_id", 0)) + 1)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        return step

    def _claim(self, number: int) -> int:
        """Mark ``number`` claimed under the job's attempts folder (so a later driver claims past it)."""
        if self.checkpoint_root is not None:
            from vigil.checkpointing import storage
            from vigil.contract.checkpoint_layout import attempts_dir, join

            folder = attempts_dir(self.checkpoint_root)
            storage.makedirs(folder)
            storage.claim(join(folder, str(number)))  # False: claimed already (by a peer of this quorum)
        return number

    def quorum_due(self, number: int) -> bool:
        """Whether step ``number`` opens with a quorum: every :attr:`quorum_every` steps while the last quorum
        held every replica, and every step while one is missing (a replacement then joins at the next step).

        Every replica of a quorum decides the same way (they are at the same step and saw the same quorum):
        one asking while another does not would stall the asker until the lighthouse's join timeout. A
        replica that leaves between quorums is still noticed at once, by the collective that fails
        (:class:`LiveComm` forms a new quorum there and then)."""
        if self.quorum_every <= 1 or number % self.quorum_every == 0:
            return True
        return int(self.manager.num_participants()) < self.world_size

    def start_step(self, number: int) -> None:
        """The quorum of step ``number`` when one is due (:meth:`quorum_due`; restore's, for the first step
        after it)."""
        if not self._quorum_ready and self.quorum_due(number):
            self.manager.start_quorum()
            self.quorums += 1
        self._quorum_ready = False
        self.comm.world_size = max(1, int(self.manager.num_participants()))
        reached = int(self.manager.current_step())
        if reached != number - 1:
            # This replica fell behind (left out of a quorum) and was healed to the others' step: its
            # loop is at another step. It restarts (vigil.live_driver) and heals again in restore().
            raise LiveError(f"live recovery: rank {self.rank} opened step {number} but the replicas are at step "
                            f"{reached}; it restarts and heals from a peer")

    def end_step(self) -> None:
        if not commit_step(self.manager):
            raise LiveError(f"live recovery: rank {self.rank} could not commit its step "
                            f"({self.manager.errored()}); it restarts and heals from a peer")

    def is_primary(self) -> bool:
        """Whether this replica writes the disk checkpoints (the first of the quorum)."""
        return self.manager.participating_rank() == 0

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _state_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, Mapping):
        return sum(_state_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_state_bytes(v) for v in tree)
    return 0
