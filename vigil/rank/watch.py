"""Where a rank stands in its collectives while its steps stall: the evidence that names a hang's culprit.

A hung job looks the same from every healthy rank: it entered collective *n* of some process group and
waits there; the culprit never entered it (stopped mid-compute, stuck in I/O, asleep in the user's own
loop) or waits in another one. torch's Flight Recorder knows, per process group, the last collective a
rank entered and the last one done (``pg_status``) and which entries are still open. A daemon thread of
each rank (:class:`Watcher`) reads it about once a second, but only while no step has finished for a
while (:func:`stall_limit`: a few step times, at least :data:`STALL_MIN_S`), and sends a
:class:`vigil.contract.schemas.ProgressSample` when what it sees changed (and every :data:`RESEND_S` while
it lasts); the controller keeps each rank's newest and lines them up when it diagnoses a hang
(``controller.recovery.collectives``), what PyTorch's ``fr_trace`` analysis does after the fact.

The thread runs while the training thread is blocked: a gloo or NCCL wait and ``time.sleep`` release the
GIL. It costs nothing while steps finish (one clock read a second).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vigil.capture import dump_fr, entries
from vigil.contract.schemas import CollectiveRef, GroupProgress, ProgressSample

log = logging.getLogger(__name__)

PERIOD_S = 1.0
"""How often the watcher looks at the clock (and, while stalled, at the recorder)."""
STALL_MIN_S = 2.0
"""No step for this long at least (and :data:`STALL_STEPS` step times) before the watcher reports."""
STALL_STEPS = 3.0
RESEND_S = 5.0
"""While a stall lasts, the same state is sent again this often (the controller keeps the newest)."""


def stall_limit(last_step_s: float) -> float:
    return max(STALL_MIN_S, STALL_STEPS * last_step_s)


def progress(dump: dict[str, Any], exclude: set[str], world_size: int) -> dict[str, Any]:
    """``groups``, ``in_flight`` and ``last_done`` of a recorder dump (Vigil's own groups left out)."""
    found = [e for e in entries(dump, {}, world_size) if e.pg_name not in exclude]
    labels = {e.pg_name: e.group for e in found}
    groups = []
    for name, st in sorted((dump.get("pg_status") or {}).items(), key=lambda kv: kv[0]):
        name = str(name)
        if name in exclude:
            continue
        enq, done = int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective", -1))
        if enq < 0:
            continue  # a group that never ran a collective
        label = labels.get(name) or ("world" if name == "0" else f"pg{name}")
        groups.append(GroupProgress(group=label, last_enqueued=enq, last_completed=done))

    def ref(e: Any) -> CollectiveRef:
        return CollectiveRef(group=e.group, seq=e.seq, op=e.op, enqueued_ts=e.created_ns / 1e9 or None)

    open_ = [ref(e) for e in found if not e.done][-16:]
    done = [e for e in found if e.done]
    return {"groups": groups[:64], "in_flight": open_, "last_done": ref(done[-1]) if done else None}


class Watcher:
    """The rank's watcher thread (see the module docstring). ``idle()``: seconds since the last step ended
    and that step's time; ``sample(state, idle_s)``: the :class:`ProgressSample` to send; ``send``;
    ``on_stall()``: called once when a stall begins; ``state()``: where the rank stands, in place of the
    Flight Recorder's :func:`progress` (live recovery's all-reduces, which the recorder does not see);
    ``tick()``: called after every look (e.g. deliver what the agent could not take at once)."""

    def __init__(self, idle: Callable[[], tuple[float, float]], sample: Callable[[dict[str, Any], float], ProgressSample],
                 send: Callable[[ProgressSample], None], *, exclude: set[str], world_size: int,
                 dump: Callable[[], dict[str, Any]] = dump_fr, period_s: float = PERIOD_S,
                 on_stall: Callable[[], None] | None = None, state: Callable[[], dict[str, Any]] | None = None,
                 tick: Callable[[], None] | None = None) -> None:
        self._idle, self._sample, self._send, self._on_stall = idle, sample, send, on_stall
        self._state, self._tick = state, tick
        self.exclude, self.world_size, self.dump, self.period_s = exclude, world_size, dump, period_s
        self._stop = threading.Event()
        self._last: tuple[Any, float] | None = None
        self._stalled = False
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="vigil-watch", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must never take the rank down
                log.warning("collective watcher: %s", e)
            if self._tick is not None:
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001
                    log.warning("collective watcher: %s", e)

    def check(self) -> bool:
        """One look; True when a sample was sent."""
        idle_s, step_s = self._idle()
        if idle_s < stall_limit(step_s):
            self._last, self._stalled = None, False
            return False
        try:
            return self._report(idle_s)
        finally:  # after the report and apart from it: it must not keep the report from going, nor delay it
            if not self._stalled:
                self._stalled = True
                if self._on_stall is not None:
                    try:
                        self._on_stall()  # e.g. send the steps held back before the stall
                    except Exception as e:  # noqa: BLE001 - the watcher must never take the rank down
                        log.warning("collective watcher: at the stall's start: %s", e)

    def _report(self, idle_s: float) -> bool:
        state = self._state() if self._state is not None else progress(self.dump(), self.exclude, self.world_size)
        key = (tuple(g.model_dump_json() for g in state["groups"]), tuple(r.seq for r in state["in_flight"]))
        now = time.monotonic()
        if self._last is not None and self._last[0] == key and now - self._last[1] < RESEND_S:
            return False
        self._last = (key, now)
        self._send(self._sample(state, idle_s))
        self.sent += 1
        return True
