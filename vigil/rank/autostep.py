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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vigil.rank.step import Step

if TYPE_CHECKING:
    from vigil.rank.session import Session


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

    def __init__(self, session: Session) -> None:
        self.session = session
        self.clock: int | None = None
        """``id`` of the optimizer whose steps delimit (the first to step)."""
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
        s = self.session
        current = s._step
        counted = optimizer_count(optimizer)
        number = counted if counted is not None and counted > self.last else self.last + 1
        if current is not None and current.auto:
            current.number = number
            s._step = None
            s._finish_step(current)
            self.steps += 1
        self.last = number
        nxt = Step(s, number + 1)
        nxt.auto = True
        nxt.__enter__()  # sets the session's open step; a fault due at it fires here

    def disengage(self) -> None:
        """The code marks its own steps: drop the open unmarked one."""
        self.engaged = False
        s = self.session
        if s._step is not None and s._step.auto:
            s._step = None
