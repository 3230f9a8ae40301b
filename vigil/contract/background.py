"""One way to run a pass over and over in a background thread: the controller's supervisor, monitor and
telemetry maintainer, and the agent's collectors, receiver and command loop all do it.

A :class:`BackgroundLoop` calls :meth:`~BackgroundLoop.tick` in a daemon thread until
:meth:`~BackgroundLoop.stop`: again at once when the pass says more work is waiting (it returned
True), else after :meth:`~BackgroundLoop.pause_s` seconds or as soon as :meth:`~BackgroundLoop.wake`
is called. A pass that raises is logged and the loop goes on (one bad pass must not end supervision).
``start()`` after ``stop()`` starts afresh (the stop flag is cleared); ``start()`` on a running loop
does nothing; ``stop()`` from inside a pass (the agent's kill_node) does not join its own thread.
Tests drive ``tick()`` (or the subclass's ``step()``) directly, one pass at a time.

Standard library only.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class BackgroundLoop:
    """Base of the background loops (module docstring). Subclasses set :attr:`thread_name` and
    implement :meth:`tick`; they call ``super().__init__()``."""

    thread_name = "vigil-loop"
    wait_first = False
    """Pause before the first pass (the monitor: give telemetry a moment to arrive)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what a subclass provides ---------------------------------------------------------------------
    def tick(self) -> bool | None:
        """One pass; True when more work is waiting (go again at once)."""
        raise NotImplementedError

    def pause_s(self) -> float:
        """Seconds between passes (default: the subclass's ``interval`` attribute)."""
        return float(self.interval)  # type: ignore[attr-defined]

    # -- life cycle -----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Set by :meth:`stop` (or by a pass that ends the loop) until the next :meth:`start`."""
        return self._stop.is_set()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run the next pass now instead of after the pause."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to end and wait up to ``timeout`` for the pass under way to finish (0: do not wait:
        the pass ends by itself, and no other follows)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and timeout > 0:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("%s still busy after %.0fs; leaving it", self.thread_name, timeout)
        self._thread = None

    def _pause(self) -> bool:
        """Sleep until the pause is over or someone wakes us; True when the loop should end."""
        self._wake.wait(self.pause_s())
        self._wake.clear()
        return self._stop.is_set()

    def _run(self) -> None:
        if self.wait_first and self._pause():
            return
        while not self._stop.is_set():
            try:
                again = bool(self.tick())
            except Exception:  # keep going; a bad pass must not kill the thread
                log.exception("%s: pass failed", self.thread_name)
                again = False
            if self._stop.is_set() or (not again and self._pause()):
                return
