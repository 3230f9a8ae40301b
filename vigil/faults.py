"""In-rank fault injection: a one-shot fault file each rank looks at once per step.

The file is ``<run_dir>/faults/<slug(job id)>/rank-<rank>.json`` (:func:`vigil.contract.settings.fault_file_path`; the agent of
the rank's node writes it when the controller fires a fault), holding one JSON object::

    {"kind": "nan_loss", "step": 120, "fault_id": 7}
    {"kind": "slow_rank", "step": 40, "factor": 2.0, "fault_id": 8}

``kind``: what to do. ``kill_rank``: the process sends itself SIGKILL as the step begins (a crashed
rank, at exactly that step). ``hang_rank``: it sends itself SIGSTOP (every thread stops, as a
rank wedged in a driver or a collective does; the controller's SIGCONT undoes it). ``nan_loss``: the rank's loss of that step is multiplied by NaN before
``backward``, so NaN gradients and, unless something guards, NaN parameters follow for real.
``slow_rank``: from that step on, the rank's compute phase (forward + backward) takes ``factor``
times as long (it waits ``factor - 1`` times the phase's own time after it): a slow accelerator,
slow whatever else the host runs, unlike a SIGSTOP duty cycle whose effect a busy host dilutes. With
``"mode": "comm"`` the same wait comes later, inside the optimizer step just before its collectives
(a rank slow to communicate: its peers wait for it inside the collective).
It lasts until the process ends or a later file sets ``factor`` 1. ``step``: the fault fires at the first step >= ``step`` this rank runs. ``fault_id``: the
controller's id, echoed in the log.

One-shot: when it fires, the rank renames the file to ``rank-<rank>.json.fired`` *before* acting, so
after a rollback to a checkpoint taken before ``step`` the fault does not fire again (and if the
rename fails it does not fire at all). Cost per step: one ``os.stat`` that fails with ENOENT; the
file is read only when its (inode, size, mtime) changes. Never blocks, never raises into the loop.

Torch-free on purpose; the file's path and suffix are the contract's (:mod:`vigil.contract.settings`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from vigil.contract.settings import FAULT_FIRED_SUFFIX

log = logging.getLogger(__name__)

NAN_LOSS = "nan_loss"
SLOW_RANK = "slow_rank"
KILL_RANK = "kill_rank"
HANG_RANK = "hang_rank"
KNOWN_KINDS = frozenset({NAN_LOSS, SLOW_RANK, KILL_RANK, HANG_RANK})
PROCESS_KINDS = frozenset({KILL_RANK, HANG_RANK})
"""Kinds :func:`carry_out` does to this process (the others change what the step computes)."""
MAX_SLOW_FACTOR = 100.0
SLOW_MODES = ("compute", "comm")
"""Where a ``slow_rank`` fault's wait goes: after the compute phase, or before the step's collectives."""




@dataclass(frozen=True)
class Fault:
    """A fault that fired at this step."""

    kind: str
    step: int
    fault_id: int | None = None
    factor: float = 1.0
    """``slow_rank``: how many times longer the compute phase takes (1: back to normal)."""
    mode: str = "compute"
    """``slow_rank``: where the wait goes (:data:`SLOW_MODES`)."""


class FaultHook:
    """Checks this rank's fault file; :meth:`check` once per step returns the fault firing now, if any."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._pending: Fault | None = None

    def check(self, step: int) -> Fault | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:  # no fault file: the common case
            self._seen, self._pending = None, None
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._seen:
            self._seen = key
            self._pending = self._read()
        fault = self._pending
        if fault is None or step < fault.step:
            return None
        try:
            os.replace(self.path, self.path.with_name(self.path.name + FAULT_FIRED_SUFFIX))
        except OSError as e:
            log.error("fault file %s cannot be marked fired (%s); not firing it", self.path, e)
            return None
        self._seen, self._pending = None, None
        log.warning("fault %s (id %s) fires at step %d (asked for step %d)", fault.kind, fault.fault_id, step,
                    fault.step)
        return Fault(kind=fault.kind, step=step, fault_id=fault.fault_id, factor=fault.factor, mode=fault.mode)

    def _read(self) -> Fault | None:
        assert self.path is not None
        try:
            body = json.loads(self.path.read_text())
            kind, step = body["kind"], body["step"]
            fault_id = body.get("fault_id")
            if not isinstance(kind, str) or isinstance(step, bool) or not isinstance(step, int):
                raise TypeError("kind must be a string and step an integer")
            if fault_id is not None and (isinstance(fault_id, bool) or not isinstance(fault_id, int)):
                raise TypeError("fault_id must be an integer")
            factor = body.get("factor", 1.0)
            if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1.0 <= factor <= MAX_SLOW_FACTOR:
                raise TypeError(f"factor must be a number from 1 to {MAX_SLOW_FACTOR:g}")
            mode = body.get("mode", "compute")
            if mode not in SLOW_MODES:
                raise TypeError(f"mode must be one of {SLOW_MODES}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            # A half-written file (the writer should rename into place) or a bad one: look again
            # when it changes.
            log.warning("ignoring fault file %s: %s", self.path, e)
            return None
        if kind not in KNOWN_KINDS:
            log.warning("ignoring fault file %s: unknown kind %r (known: %s)", self.path, kind, sorted(KNOWN_KINDS))
            return None
        return Fault(kind=kind, step=step, fault_id=fault_id, factor=float(factor), mode=mode)


def carry_out(fault: Fault) -> None:
    """Do a process kind (:data:`PROCESS_KINDS`) to this process, now; other kinds: nothing.

    ``kill_rank`` does not return. ``hang_rank`` returns once someone sends SIGCONT.
    """
    if fault.kind == KILL_RANK:
        logging.shutdown()  # the warning above reaches the log before the process goes
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == HANG_RANK:
        os.kill(os.getpid(), signal.SIGSTOP)
