"""The telemetry maintainer's passes in a process of their own, beside the controller's.

Why: aggregating a step of a 10,000-rank job costs ~0.15 s of Python (reading one row per rank and
kind, assembling the three kinds of aggregate rows) on top of the database's own work. In a thread
of the ingest process that time holds the GIL, and every telemetry request in flight waits behind
it. On this 2-core machine (docs/BENCHMARKS.md), PostgreSQL: 140k samples/s and a p99 post of 103 ms
with the aggregation held, 112k/s and 243 ms with it in a thread, 112-117k/s and 124-126 ms with it
in a process of its own, which holds only its own interpreter and runs on whichever core is free.

It is the default wherever another process can open the database (``VIGIL_AGGREGATION_PROCESS``
unset; PostgreSQL, a SQLite file): on SQLite the child's writes queue with the ingest's in the same
cross-process writer queue (:func:`controller.db.sqlite_writer`), and measured there it helped as
much (p99 post 170 -> 75 ms). An in-memory SQLite database keeps the passes in a thread.

:class:`AggregationProcess` starts the child (``multiprocessing``, spawn: nothing of the parent's
threads or connections is inherited), stops it, and says whether it is alive; the child runs
:class:`~controller.aggregation.TelemetryMaintainer` passes on its own engine until asked to stop or
until its parent is gone (a controller killed with ``kill -9`` leaves no aggregator behind: the child
notices within one pause). Only the leader runs it (:mod:`controller.leader` starts and stops the
maintainer, which starts and stops this). Aggregation is idempotent and tolerates a second
aggregator (:func:`~controller.aggregation.aggregate_ready`), so a child still finishing a pass while
a new leader starts its own counts nothing twice.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event

from controller.aggregation import TelemetryMaintainer
from controller.db import make_engine, make_session_factory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaintainerParams:
    """What the child's :class:`~controller.aggregation.TelemetryMaintainer` is built with."""

    retention_s: float
    settle_s: float
    interval_s: float
    prune_interval_s: float
    max_steps_per_pass: int = 64


def _child(url: str, params: dict[str, float], stop: Event, parent_pid: int) -> None:
    """The child's loop: maintainer passes until ``stop`` is set or the parent is gone."""
    # A Ctrl-C at the terminal reaches the whole process group: the controller stops this child itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s vigil-aggregation %(message)s")
    engine = make_engine(url)
    maintainer = TelemetryMaintainer(make_session_factory(engine), **params)  # type: ignore[arg-type]
    try:
        while not stop.is_set() and os.getppid() == parent_pid:
            try:
                more = maintainer.tick()
            except Exception:  # one bad pass must not end the aggregation (as BackgroundLoop does)
                log.exception("aggregation pass failed")
                more = False
            if not more:
                stop.wait(maintainer.pause_s())
    finally:
        engine.dispose()


class AggregationProcess:
    """One child process running the maintainer's passes on the database at ``url`` (module docstring);
    the maintainer keeps it running as its :class:`~controller.aggregation.MaintainerProcess`."""

    def __init__(self, url: str, params: MaintainerParams) -> None:
        self.url = url
        self.params = params
        self._ctx = multiprocessing.get_context("spawn")
        self._stop: Event | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def ensure_running(self) -> None:
        """Start the child, or start it again if it died (logged)."""
        if self.alive:
            return
        if self._proc is not None:
            log.warning("aggregation process %s ended (exit code %s); starting it again", self._proc.pid,
                        self._proc.exitcode)
        self._stop = self._ctx.Event()
        self._proc = self._ctx.Process(target=_child, name="vigil-aggregation", daemon=True,
                                       args=(self.url, asdict(self.params), self._stop, os.getpid()))
        self._proc.start()
        log.info("aggregation runs in process %s", self._proc.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to end after its pass under way; terminate it if it has not within ``timeout``."""
        proc, stop = self._proc, self._stop
        self._proc = self._stop = None
        if proc is None or stop is None:
            return
        stop.set()
        proc.join(timeout)
        if proc.is_alive():
            log.warning("aggregation process %s still busy after %.0fs; terminating it", proc.pid, timeout)
            proc.terminate()
            proc.join(5)


__all__ = ["AggregationProcess", "MaintainerParams"]
