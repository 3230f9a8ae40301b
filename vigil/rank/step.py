"""The optimizer a rank steps (:class:`Optimizer`: any strategy of the registry over the user's module)
and one training step (:class:`Step`: phases, the injected fault, the step sample)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from controller.schemas import OptimizerSpec
from vigil.faults import NAN_LOSS, PROCESS_KINDS, SLOW_RANK, carry_out
from vigil.optim import Strategy
from vigil.optim.base import StateLayout
from vigil.rank.context import PHASES

if TYPE_CHECKING:
    from vigil.rank.session import Session

log = logging.getLogger(__name__)

class Optimizer:
    """An optimizer strategy of the registry over the user's module, as :func:`optimizer` returns it.

    ``model``: the module to run forward on; ``step(lr=None)``: communicate and update (after
    ``backward``); ``zero_grad()``; ``eval_module()``: the synchronised model to evaluate (every rank
    calls it: it may communicate). Checkpoint it by handing it to :func:`checkpoint` / :func:`restore`.
    """

    def __init__(self, session: Session, strategy: Strategy, spec: OptimizerSpec) -> None:
        self._session = session
        self.strategy = strategy
        self.spec = spec
        self.lr = spec.lr
        """The learning rate :meth:`step` uses when given none (the last one given, else the spec's)."""

    @property
    def module(self) -> nn.Module:
        """The user's module (unwrapped)."""
        return self.strategy.module

    @property
    def model(self) -> nn.Module:
        """The module to run forward on (the strategy's wrapper where it has one, e.g. DDP)."""
        return self.strategy.model

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def step(self, lr: float | None = None) -> None:
        """Communicate and update after ``backward`` of the current step (inside :func:`step`)."""
        if lr is not None:
            if not (lr > 0 and math.isfinite(lr)):
                raise ValueError(f"lr must be a finite number > 0, got {lr}")
            self.lr = lr
        current = self._session._open_step(f"{type(self).__name__}.step")
        current._before_optimizer()
        t = time.perf_counter()
        try:
            self.strategy.step(current.number, self.lr)
        finally:
            current._add("optimizer", time.perf_counter() - t)

    def eval_module(self) -> nn.Module:
        return self.strategy.eval_module()

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(state)

    def state_layout(self) -> StateLayout:
        return self.strategy.state_layout()

    def after_restore(self, *, old_world_size: int, fresh: bool) -> None:
        self.strategy.after_restore(old_world_size=old_world_size, fresh=fresh)


class Step:
    """One open step (:func:`step`): phases, the report, the fault of this step; sends on leaving."""

    def __init__(self, session: Session, number: int) -> None:
        if number < 1:
            raise ValueError(f"step must be >= 1 (steps are numbered from 1), got {number}")
        self.session = session
        self.number = number
        self.loss: float | None = None
        self.metrics: dict[str, Any] = {}
        self.tokens = 0
        self._phases: dict[str, float] = {}
        self._open_phase: str | None = None
        self._t0 = time.perf_counter()
        self._start_ns = time.time_ns()
        self._optimizer_ns: int | None = None
        """Wall clock of the first torch optimizer step in this step (its collectives were done by then)."""
        self._optimizer_t: float | None = None
        self._slowed = False
        self.fault: str | None = None
        self.auto = False
        """Opened by Vigil at an optimizer step of code that does not mark steps (:mod:`vigil.rank.autostep`)."""

    # -- phases ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of this step: ``"data"``, ``"forward_backward"`` or ``"optimizer"``."""
        if name not in PHASES:
            raise ValueError(f"phase: {name!r} is not one of {PHASES}")
        if self._open_phase is not None:
            raise RuntimeError(f"phase {name!r} opened inside phase {self._open_phase!r}; phases do not nest")
        self._open_phase = name
        t = time.perf_counter()
        try:
            yield
            if name == "forward_backward":
                self._slow_down(time.perf_counter() - t)
        finally:
            self._open_phase = None
            self._add(name, time.perf_counter() - t)

    def _add(self, name: str, seconds: float) -> None:
        self._phases[name] = self._phases.get(name, 0.0) + seconds

    def _slow_down(self, compute_s: float) -> None:
        """A ``slow_rank`` fault: the compute phase takes ``factor`` times as long (once per step)."""
        factor = self.session._slow
        if factor > 1.0 and not self._slowed:
            self._slowed = True
            time.sleep((factor - 1.0) * max(0.0, compute_s))

    def _before_optimizer(self) -> None:
        if "forward_backward" not in self._phases:  # compute not marked: all since the data phase
            self._slow_down(time.perf_counter() - self._t0 - self._phases.get("data", 0.0))

    # -- report ------------------------------------------------------------------------------------

    def report(self, loss: float | torch.Tensor | None = None, *, tokens: int | None = None,
               **metrics: Any) -> None:
        """This step's training loss, tokens processed on this rank, and any other metrics
        (``val_loss`` is shown as the validation loss; numbers only). May be called more than once."""
        if loss is not None:
            self.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if tokens is not None:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
            self.tokens = tokens
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = float(v.detach())
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ValueError(f"metric {k!r} must be a number, got {type(v).__name__}")
            self.metrics[k] = v

    # -- context -----------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        s = self.session
        if not self.auto:
            s._auto.disengage()
        if s._step is not None:
            raise RuntimeError(f"step {self.number} opened while step {s._step.number} is still open")
        s._step = self
        s.comm.set_step(self.number)
        if s.live is not None:
            s.live.start_step(self.number)  # the quorum of this step (a replica that left is out, a new one heals)
        fault = s.faults.check(self.number)
        if fault is not None:
            s.summary.faults.append(self.number)
            self.fault = fault.kind
            s._fault_hit(fault)
            if fault.kind in PROCESS_KINDS:
                carry_out(fault)  # kill_rank never returns; hang_rank returns when continued
            elif fault.kind == NAN_LOSS:
                s._nan_step = self.number
            elif fault.kind == SLOW_RANK:
                s._slow = fault.factor
        self._t0 = time.perf_counter()
        self._start_ns = time.time_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        s = self.session
        s._step = None
        if exc_type is not None:
            return
        if s.live is not None:
            s.live.end_step()
        s._finish_step(self)
