"""Steps of code that never marks them: torch's optimizer step delimits them.

A loop written for plain PyTorch (a torchrun script, a Ray Train ``train_loop_per_worker``) calls
``optimizer.step()`` once per training step and never ``vigil.step``. Vigil's session then takes torch's
global optimizer-step hooks as the step boundary: step *n* runs from the end of the previous optimizer
step to the end of this one; its optimizer phase is the optimizer step itself, its communication the
collectives captured from the Flight Recorder (:mod:`vigil.capture`), its compute the rest. The first
optimizer step of a process only starts the clock (what ran before it is start-up, not a step).

The step's number is the optimizer's own count where it keeps one (Adam, AdamW, ...: ``state[p]["step"]``,
restored with the optimizer from the code's own checkpoint, so a restarted job numbers on from there),
else one more than the last. Faults due at a step fire when it opens (``kill_rank``, ``hang_rank``) or
before its optimizer step (``slow_rank``), as for marked steps. Only the first optimizer that steps
is the clock (a second one, e.g. a GAN's, is part of the same step). A loop that opens ``vigil.step``
itself takes the boundaries back at once.

Metrics the code hands Ray Train (``ray.train.report``, :mod:`vigil.raytrain`) are the step's loss and
the rest: a report follows the optimizer step of the step it is about, so it lands on the step just
finished (its sample is held until the next step ends, for that). Code that steps no torch optimizer
at all (its own update rule) is stepped by its reports instead: from its second report on, each report
ends a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from vigil.rank.step import Step, StepHost


class AutoStepHost(StepHost, Protocol):
    """What the unmarked steps need of the rank's session (:class:`vigil.rank.session.Session` is one),
    beyond what a step needs."""

    @property
    def current_step(self) -> Step | None:
        """The open step, None when none is."""
        ...

    def drop_step(self) -> None:
        """No step is open any more (the open one is neither recorded nor sent)."""
        ...

    def finish_step(self, step: Step) -> None:
        """Record and send ``step``, which has ended."""
        ...

    def amend_held(self, number: int, values: dict[str, Any]) -> int | None:
        """Metrics reported after step ``number`` ended onto its held sample; None when it was sent already."""
        ...

    def restart_idle_clock(self) -> None:
        """Training has just been seen to progress (the rank's idle time starts again from now)."""
        ...


def optimizer_count(optimizer: Any) -> int | None:
    """The optimizer's own step count (its first parameter's ``state["step"]``), None if it keeps none."""
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):
        return None
    return None


class AutoSteps:
    """The session's unmarked steps (module docstring)."""

    def __init__(self, session: AutoStepHost) -> None:
        self.session = session
        self.clock: int | str | None = None
        """``id`` of the optimizer whose steps delimit (the first to step), or :data:`REPORTS`."""
        self.reports = 0
        """Reports seen while no optimizer had stepped."""
        self.last = 0
        self.engaged = True
        self.steps = 0
        """Steps finished this way."""

    def after_optimizer(self, optimizer: Any) -> None:
        """The clock optimizer's step ended: finish the open step, open the next."""
        if not self.engaged:
            return
        if self.clock is None:
            self.clock = id(optimizer)
        elif id(optimizer) != self.clock:
            return
        self._boundary(optimizer_count(optimizer))

    def _boundary(self, counted: int | None) -> None:
        s = self.session
        current = s.current_step
        number = counted if counted is not None and counted > self.last else self.last + 1
        if current is not None and current.auto:
            current.number = number
            s.drop_step()
            s.finish_step(current)
            self.steps += 1
        self.last = number
        nxt = Step(s, number + 1)
        nxt.auto = True
        nxt.__enter__()  # sets the session's open step; a fault due at it fires here

    def reported(self, metrics: Mapping[str, Any]) -> int | None:
        """Metrics the code reported (``ray.train.report``): onto the step they are about (module
        docstring); that step's number, None when no step took them."""
        s = self.session
        values = step_values(metrics)
        if not self.engaged:  # the code marks its steps: the open one is the one it reports about
            current = s.current_step
            if current is not None and values:
                current.report(values.pop("loss", None), **values)
                return current.number
            return None
        if self.clock is None:
            self.reports += 1
            if self.reports < 2:  # an initial report (an evaluation before training) only starts the clock
                s.restart_idle_clock()
                return None
            self.clock = REPORTS
        if self.clock == REPORTS:
            if s.current_step is None:
                self._boundary(None)  # opens the first step: it ends at the next report
                return None
            step = metrics.get("step")
            counted = int(step) if isinstance(step, int) and not isinstance(step, bool) else None
            self._boundary(counted)
        if not values or self.steps == 0:
            return None
        return s.amend_held(self.last, values)

    def disengage(self) -> None:
        """The code marks its own steps: drop the open unmarked one."""
        self.engaged = False
        current = self.session.current_step
        if current is not None and current.auto:
            self.session.drop_step()


REPORTS = "reports"
"""The clock of code that steps no torch optimizer: its reports delimit its steps."""
STEP_FIELDS = ("loss", "val_loss", "lr")


def step_values(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The step fields among reported metrics: ``loss``, ``val_loss``, ``lr`` (numbers) and ``tokens``
    (an integer >= 0); anything else is the code's own (Ray Train keeps it)."""
    out: dict[str, Any] = {}
    for name in STEP_FIELDS:
        v = metrics.get(name)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[name] = float(v) if math.isfinite(v) else math.nan
    tokens = metrics.get("tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        out["tokens"] = tokens
    return out

