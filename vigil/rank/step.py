"""The optimizer a rank steps (:class:`Optimizer`: any strategy of the registry over the user's module)
and one training step (:class:`Step`: phases, the injected fault, the step sample).

Both reach the rank's session only through :class:`StepHost`, what they need of it (the session,
:class:`vigil.rank.session.Session`, is one): this module never imports the session's."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, Self

import torch
from torch import nn

from vigil.contract.schemas import OptimizerSpec
from vigil.optim import Strategy
from vigil.optim.base import StateLayout
from vigil.rank.context import PHASES

log = logging.getLogger(__name__)


def runqueue_s() -> float | None:
    """Seconds this thread has waited, runnable, for a CPU since it started (Linux' ``/proc/thread-self/schedstat``,
    its second field; None where unknown). A step's share: the difference between its end and its start."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def runqueue_since(start: float | None) -> float | None:
    """The run-queue wait since ``start`` (a :func:`runqueue_s`; None: unknown)."""
    now = runqueue_s()
    return max(0.0, now - start) if now is not None and start is not None else None


class StepHost(Protocol):
    """What a :class:`Step` and an :class:`Optimizer` need of the rank's session (which holds the open step)."""

    @property
    def slow_factor(self) -> float:
        """A ``slow_rank`` fault's factor: each step's compute takes this many times as long (1.0: none)."""
        ...

    @property
    def slow_mode(self) -> str:
        """Where a ``slow_rank`` fault's wait goes: after compute (``compute``) or before the collectives (``comm``)."""
        ...

    def open_step(self, what: str) -> Step:
        """The open step; a RuntimeError naming ``what`` (the caller) when none is open."""
        ...

    def step_opened(self, step: Step) -> None:
        """``step`` is entered: it becomes the open step and a fault due at it fires (a ``kill_rank`` never
        returns)."""
        ...

    def step_closed(self, step: Step, *, failed: bool) -> None:
        """``step`` is left: no step is open; one that did not fail (an exception left it) is recorded and sent."""
        ...


class Optimizer:
    """An optimizer strategy of the registry over the user's module, as :func:`optimizer` returns it.

    ``model``: the module to run forward on; ``step(lr=None)``: communicate and update (after
    ``backward``); ``zero_grad()``; ``eval_module()``: the synchronised model to evaluate (every rank
    calls it: it may communicate). Checkpoint it by handing it to :func:`checkpoint` / :func:`restore`.
    """

    def __init__(self, session: StepHost, strategy: Strategy, spec: OptimizerSpec) -> None:
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
        current = self._session.open_step(f"{type(self).__name__}.step")
        current.before_optimizer()
        t = time.perf_counter()
        try:
            current.late_to_collectives()
            self.strategy.step(current.number, self.lr)
        finally:
            current.add_time("optimizer", time.perf_counter() - t)

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

    def __init__(self, session: StepHost, number: int) -> None:
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
        self.runqueue_start = runqueue_s()
        """:func:`runqueue_s` when the step opened (None: unknown)."""
        self._optimizer_ns: int | None = None
        """Wall clock of the first torch optimizer step in this step (its collectives were done by then)."""
        self._optimizer_t: float | None = None
        self._slowed = False
        self._comm_delay = 0.0
        """A ``comm`` slow-down's wait, due before this step's collectives (:meth:`late_to_collectives`)."""
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
            self.add_time(name, time.perf_counter() - t)

    def add_time(self, name: str, seconds: float) -> None:
        """``seconds`` more spent in phase ``name`` of this step."""
        self._phases[name] = self._phases.get(name, 0.0) + seconds

    @property
    def phases(self) -> Mapping[str, float]:
        """Seconds per phase marked or measured so far (a phase never marked is absent)."""
        return self._phases

    @property
    def started_at(self) -> float:
        """``time.perf_counter()`` when the step opened (after a fault that hung it)."""
        return self._t0

    @property
    def start_ns(self) -> int:
        """Wall clock (``time.time_ns()``) when the step opened."""
        return self._start_ns

    @property
    def optimizer_ns(self) -> int | None:
        """Wall clock of the first torch optimizer step in this step, None before one."""
        return self._optimizer_ns

    def _slow_down(self, compute_s: float) -> None:
        """A ``slow_rank`` fault: the compute phase takes ``factor`` times as long (once per step); in ``comm``
        mode that wait is kept for :meth:`late_to_collectives`."""
        factor = self.session.slow_factor
        if factor > 1.0 and not self._slowed:
            self._slowed = True
            wait = (factor - 1.0) * max(0.0, compute_s)
            if self.session.slow_mode == "comm":
                self._comm_delay = wait
            else:
                time.sleep(wait)

    def late_to_collectives(self) -> None:
        """The optimizer step's collectives are about to start: a ``comm`` slow-down's wait goes here, inside
        the optimizer phase and outside every collective's timing (its peers wait for it in the collective)."""
        wait, self._comm_delay = self._comm_delay, 0.0
        if wait > 0:
            time.sleep(wait)

    def before_optimizer(self) -> None:
        """The optimizer step is about to run: compute is over (an unmarked step's ``slow_rank`` acts here)."""
        if "forward_backward" not in self._phases:  # compute not marked: all since the data phase
            self._slow_down(time.perf_counter() - self._t0 - self._phases.get("data", 0.0))

    def torch_optimizer_started(self) -> None:
        """A torch optimizer (the user's own, not one of Vigil's) starts its step: the end of compute and the
        start of the optimizer phase."""
        if self._optimizer_ns is None:  # before a slow_rank's sleep: the collectives were done by now
            self._optimizer_ns = time.time_ns()
        self.before_optimizer()
        self._optimizer_t = time.perf_counter()
        self.late_to_collectives()  # the user's optimizer: its peers wait at this rank's next collective

    def torch_optimizer_ended(self) -> None:
        """The torch optimizer's step ended: its time is the optimizer phase's."""
        if self._optimizer_t is not None:
            self.add_time("optimizer", time.perf_counter() - self._optimizer_t)
            self._optimizer_t = None

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
        self.session.step_opened(self)  # a fault due at this step fires (and may hang it) before the clock starts
        self._t0 = time.perf_counter()
        self._start_ns = time.time_ns()
        self.runqueue_start = runqueue_s()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.session.step_closed(self, failed=exc_type is not None)
