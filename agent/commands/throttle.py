"""Throttling a process: the SIGCONT / SIGSTOP duty cycle of ``throttle_pid`` (:class:`Throttle`)."""

from __future__ import annotations

import signal
import threading

import psutil


class Throttle:
    """SIGCONT / SIGSTOP duty cycle in a thread: the process runs ``1/factor`` of each period.

    Ends (with a SIGCONT, so the process is left running) on :meth:`stop` or when the process is
    gone; psutil refuses to signal a pid that now names another process.
    """

    def __init__(self, proc: psutil.Process, factor: float, period_s: float) -> None:
        self.proc = proc
        self.factor = factor
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"vigil-throttle-{proc.pid}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> bool:
        try:
            self.proc.send_signal(sig)
            return True
        except psutil.Error:
            return False

    def _run(self) -> None:
        on = self.period_s / self.factor
        try:
            while not self._stop.is_set():
                if not self._signal(signal.SIGCONT):
                    return
                if self._stop.wait(on):
                    return
                if not self._signal(signal.SIGSTOP):
                    return
                self._stop.wait(self.period_s - on)
        finally:
            self._signal(signal.SIGCONT)
