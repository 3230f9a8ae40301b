"""Vigil's rank API: what your training code calls on every rank, whatever the model, data and loop.

A complete loop (the same on every rank)::

    from trainer import sdk as vigil

    def train_func(config):
        run = vigil.init()                              # rank, world size, device, job spec, config
        model = MyModel()
        opt = vigil.optimizer(model)                    # the job's optimizer (any kind of the registry)
        data = MyBatches(rank=run.rank, world_size=run.world_size)   # anything with state_dict()
        start = (vigil.restore(model=model, optimizer=opt, data=data) or 0) + 1
        for step in range(start, run.steps + 1):
            with vigil.step(step) as s:
                with s.phase("data"):
                    x, y = data.next()
                with s.phase("forward_backward"):
                    opt.zero_grad()
                    loss = loss_fn(opt.model(x), y)
                    loss.backward()
                opt.step()                              # communicates (timed, counted) and updates
                s.report(loss=loss.item(), tokens=len(x))
            vigil.checkpoint(step, model=model, optimizer=opt, data=data)

What each piece does for you:

* :func:`init` returns the rank's :class:`Session`: rank, world size, device, the job's spec and
  ``config``, the process group's communication layer, the node agent's telemetry sink and the fault
  hook, all from what Vigil (or Ray Train) set up. Under a Vigil job the session exists before your
  code runs; elsewhere :func:`init` makes one from ``torch.distributed`` (or a world of one).
* :func:`optimizer` wraps your ``nn.Module`` in any optimizer of the registry (``adamw``,
  ``powersgd``, ``fp16_compress``, ``local_adamw``, ``slowmo``, ``dsm``, ``sdp4bit`` and its
  ablations, ``cser``, ``cser_pl``, ``ef_sgd``, ``qsparse_local_sgd``, ``compressed_adam``); every
  collective goes through Vigil's communication layer, so it is timed and its bytes counted. Without
  a ``kind`` it is the job spec's ``optimizer`` (so one script compares optimizers by job spec).
  Run forward on ``opt.model`` (a strategy may wrap the module, e.g. in DDP).
* :func:`step` opens a step: it sets the step number of the collectives, fires an injected fault
  due at this step (``nan_loss``: the module's outputs turn NaN, so its loss, gradients and weights
  do for real; ``slow_rank``: the compute phase takes ``factor`` times as long), and on leaving sends
  one step sample (data / forward+backward / optimizer / communication time, loss, tokens, your
  metrics) and the step's collectives to the node agent. Phases you do not mark are inferred: the
  optimizer phase is :meth:`Optimizer.step`; forward+backward is the rest of the step outside data.
* :func:`checkpoint` is called after every step with the objects to save; it saves when the job's
  ``checkpoint.interval_steps`` says so, at the job's last step and when Ray is draining a node of
  this job (a preemption, e.g. Vigil evicting a bad node), asynchronously with ``torch.distributed.
  checkpoint``, a manifest with checksums, retention, and resharding on another world size; it also
  tells Ray Train about complete checkpoints. :func:`restore` loads the newest valid checkpoint into
  the same names (falling back past corrupt ones) and returns its step, or None.

Every rank must make the same calls in the same order (:func:`optimizer`, :func:`restore`,
:func:`checkpoint`, :meth:`Optimizer.step` communicate). Steps are numbered from 1.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from controller.schemas import JobCreate, OptimizerSpec, StepSample
from trainer import checkpoint as ckpt_mod
from trainer.comm import Comm
from trainer.faults import NAN_LOSS, SLOW_RANK, FaultHook
from trainer.optim import Strategy, build_strategy
from trainer.optim.base import StateLayout
from trainer.telemetry import NullTelemetry, TelemetrySink, check_job_id, finite_or_none

log = logging.getLogger(__name__)

REPORT_INTERVAL_STEPS = 10
"""Steps between looks for a newly complete checkpoint to hand Ray Train (``ray.train.report``, made only
then, at the end and on a preemption: each report is a barrier across ranks that also waits for Ray
Train's controller to take it, ~1.4 s on this project's 2-core machine)."""
PREEMPTION_CHECK_PERIOD_S = 1.0
"""About how often the ranks ask whether a node of theirs is being drained. Ray Train's watcher polls
every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` (the driver sets 1 s), so a drain with a deadline of a
few seconds leaves time for the check, a checkpoint and a report."""
MAX_PREEMPTION_CHECK_STEPS = 1000
"""Never more steps than this between two preemption checks."""
PHASES = ("data", "forward_backward", "optimizer")
"""The phases a step can mark (collectives are timed by the communication layer)."""

ReportFn = Callable[[dict[str, Any], Path | None], None]
"""``report(metrics, checkpoint_dir)``; every rank calls it at the same steps (it may be a barrier)."""


def _no_report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
    return None


def _never() -> bool:
    return False


@dataclass
class RankContext:
    """What a rank's session needs to know about, and hand to, the world around this rank."""

    rank: int
    """This rank's index in the process group."""
    world_size: int
    """Ranks in the process group."""
    job_id: str
    """Vigil job id; tags every telemetry sample."""
    node_id: str = "local"
    """Node this rank runs on (its Ray node name under Ray)."""
    report: ReportFn = _no_report
    """Called at the same steps on every rank with metrics and, when a checkpoint completed since
    the last report, its folder (the same on every rank; copy it during the call if you need it to
    outlive retention or a temporary root)."""
    telemetry: TelemetrySink = field(default_factory=NullTelemetry)
    """Where step, collective and (rank 0) checkpoint samples go."""
    checkpoint_root: Path | None = None
    """This job's checkpoint root (``step-XXXXXXXX`` folders, see :mod:`trainer.checkpoint`); restore
    takes the newest valid checkpoint there. None: a temporary root for this session (checkpoints do
    not outlive it; saves are synchronous)."""
    restore_dir: Path | None = None
    """A checkpoint folder (or a pointer folder, as Ray Train hands back) to consider on restore next
    to the root's; None: the root's alone."""
    preemption_pending: Callable[[], bool] = _never
    """Asked at the scheduled steps on every rank (under Ray it is a barrier); True: checkpoint now."""
    report_interval: int = REPORT_INTERVAL_STEPS
    """Steps between reports (a report also happens after the last step and after a preemption checkpoint)."""
    preemption_check_s: float = PREEMPTION_CHECK_PERIOD_S
    """About how often (seconds) to ask ``preemption_pending``; 0: every step."""
    async_checkpoints: bool = True
    """Write checkpoints in the background (with a ``checkpoint_root``); False: synchronously."""
    fault_file: Path | None = None
    """This rank's one-shot fault file (:func:`controller.settings.fault_file_path`); None: no fault injection."""
    cache_dir: Path | None = None
    """Data cache directory for code that wants one (the GPT example's corpus); None: its default."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.report_interval < 1:
            raise ValueError(f"report_interval must be >= 1, got {self.report_interval}")
        if not (self.preemption_check_s >= 0 and math.isfinite(self.preemption_check_s)):
            raise ValueError(f"preemption_check_s must be a finite number >= 0, got {self.preemption_check_s}")
        check_job_id(self.job_id)


@dataclass
class TrainSummary:
    """What one session did on this rank (for tests, benchmarks and the runner's log line)."""

    start_step: int = 1
    """First step run (1, or the restored step + 1)."""
    final_step: int = 0
    """Last step completed."""
    losses: dict[int, float | None] = field(default_factory=dict)
    """This rank's reported training loss per step (None when not finite)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Reported validation loss per step (``val_loss=`` of :meth:`Step.report`)."""
    checkpoints: list[int] = field(default_factory=list)
    """Steps after which a checkpoint was started (written in the background, or at once)."""
    skipped_checkpoints: list[int] = field(default_factory=list)
    """Checkpoint steps not written because a rank's loss or parameters were not finite."""
    faults: list[int] = field(default_factory=list)
    """Steps at which an injected fault fired on this rank."""
    model: nn.Module | None = None
    """The module of the last :func:`optimizer` made (for callers that inspect it)."""


class PreemptionSchedule:
    """The steps at which every rank asks about a pending preemption: about every ``period_s``.

    The spacing in steps comes from the slowest rank's recent step time (one scalar all-reduce at
    each check), so every rank computes the same next step without any per-step communication.
    """

    def __init__(self, period_s: float, first_step: int, distributed: bool, group: Any = None) -> None:
        self.period_s = period_s
        self.next_step = first_step
        self.distributed = distributed
        self.group = group
        self._last: tuple[int, float] | None = None

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def checked(self, step: int, step_time_s: float) -> None:
        """Plan the next check; call at every due step, on every rank."""
        now = time.perf_counter()
        per_step = step_time_s
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
        self._last = (step, now)
        if self.period_s <= 0:
            self.next_step = step + 1
            return
        t = torch.tensor([per_step], dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        every = int(self.period_s / max(float(t), 1e-6))
        self.next_step = step + min(MAX_PREEMPTION_CHECK_STEPS, max(1, every))


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
        self._slowed = False
        self.fault: str | None = None

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
        if s._step is not None:
            raise RuntimeError(f"step {self.number} opened while step {s._step.number} is still open")
        s._step = self
        s.comm.set_step(self.number)
        fault = s.faults.check(self.number)
        if fault is not None:
            s.summary.faults.append(self.number)
            self.fault = fault.kind
            if fault.kind == NAN_LOSS:
                s._nan_step = self.number
            elif fault.kind == SLOW_RANK:
                s._slow = fault.factor
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        s = self.session
        s._step = None
        if exc_type is not None:
            return
        s._finish_step(self)


class Session:
    """One rank of one job: the world, the job, the communication layer, telemetry, faults, checkpoints.

    Made by Vigil's runner before the user's code starts (or by :func:`init` outside a job); closed
    by it afterwards (:meth:`close` waits for the checkpoint in flight and makes the final report).
    """

    def __init__(self, ctx: RankContext, spec: JobCreate | None = None, config: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.spec = spec if spec is not None else JobCreate(name=ctx.job_id)
        """The job spec (steps, optimizer, checkpoint interval, ...; the GPT example's model and data)."""
        self.config: dict[str, Any] = dict(config if config is not None else self.spec.config)
        """The job's ``config``: free JSON for the user's code."""
        self.comm = Comm.from_process_group()
        if (self.comm.rank, self.comm.world_size) != (ctx.rank, ctx.world_size):
            raise RuntimeError(f"process group is rank {self.comm.rank} of {self.comm.world_size}, "
                               f"context says {ctx.rank} of {ctx.world_size}")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        """Where this rank's tensors go (its GPU when it has one)."""
        self.faults = FaultHook(ctx.fault_file)
        self.summary = TrainSummary()
        self.checkpointer = ckpt_mod.Checkpointer(
            ctx.checkpoint_root, rank=ctx.rank, world_size=ctx.world_size, job_id=ctx.job_id,
            keep_last=self.spec.checkpoint.keep_last, sink=ctx.telemetry, async_save=ctx.async_checkpoints,
        )
        self.preemption = PreemptionSchedule(ctx.preemption_check_s, 1, ctx.world_size > 1,
                                             self.checkpointer.control_group)
        self._preempt_handled = False
        self._step: Step | None = None
        self._last_step_time = 0.0
        self._nan_step: int | None = None
        self._slow = 1.0
        self._window: list[float] = []
        self._last: dict[str, Any] = {}
        self._last_val: float | None = None
        self._reported_step = 0
        self._hooks: list[Any] = []
        self._pid = os.getpid()
        self.closed = False

    # -- the world ---------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def job_id(self) -> str:
        return self.ctx.job_id

    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    @property
    def steps(self) -> int:
        """The job's ``steps``: the last step (a checkpoint is always taken after it)."""
        return self.spec.steps

    @property
    def telemetry(self) -> TelemetrySink:
        return self.ctx.telemetry

    # -- optimizer ---------------------------------------------------------------------------------

    def optimizer(self, model: nn.Module, kind: str | None = None, *, lr: float | None = None,
                  weight_decay: float | None = None, betas: tuple[float, float] | None = None,
                  grad_clip: float | None = None, params: Mapping[str, Any] | None = None) -> Optimizer:
        """See :func:`optimizer`."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"optimizer: model must be a torch.nn.Module, got {type(model).__name__}")
        base = self.spec.optimizer.model_dump()
        if kind is not None and kind != base["kind"]:
            base = {"kind": kind, "params": {}, **{k: base[k] for k in ("lr", "weight_decay", "betas", "grad_clip")}}
        overrides = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "grad_clip": grad_clip,
                     "params": dict(params) if params is not None else None}
        base.update({k: v for k, v in overrides.items() if v is not None})
        spec = OptimizerSpec.model_validate(base)  # a ValidationError names the field and the rule
        strategy = build_strategy(spec, model, self.comm)
        def poison(module: nn.Module, args: Any, output: Any) -> Any:
            # A plain function, not a bound method: deepcopy (a strategy's eval copy of the module)
            # shares functions instead of copying the session they close over.
            return self._poison_outputs(module, args, output)

        self._hooks.append(model.register_forward_hook(poison))
        self.summary.model = model
        return Optimizer(self, strategy, spec)

    def _poison_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:
        """A ``nan_loss`` fault: this step's outputs (so its loss, gradients and weights) turn NaN."""
        if self._nan_step is None or self._step is None or self._step.number != self._nan_step or not module.training:
            return None
        return tree_map(lambda t: t * float("nan") if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        output)

    # -- steps -------------------------------------------------------------------------------------

    def step(self, number: int) -> Step:
        """See :func:`step`."""
        return Step(self, number)

    def _open_step(self, what: str) -> Step:
        if self._step is None:
            raise RuntimeError(f"{what} needs an open step: call it inside `with vigil.step(n):`")
        return self._step

    def _finish_step(self, s: Step) -> None:
        now = time.perf_counter()
        records = self.comm.drain()  # the first step's also holds the start-up ones (step 0: initial broadcasts)
        comm_s = sum(r.duration_s for r in records if r.step == s.number)
        step_time = now - s._t0
        data_s = s._phases.get("data")
        optim_total = s._phases.get("optimizer")
        fwd_bwd = s._phases.get("forward_backward")
        if fwd_bwd is None:  # not marked: the rest of the step
            fwd_bwd = max(0.0, step_time - (data_s or 0.0) - (optim_total or 0.0))
        loss = s.loss
        if s.number == self._nan_step and loss is not None:
            loss = math.nan  # the user may have computed it outside the module
        loss_value = finite_or_none(loss)
        val = s.metrics.get("val_loss")
        val_value = finite_or_none(val) if isinstance(val, int | float) else None
        self.ctx.telemetry.send_step(
            StepSample(
                job_id=self.job_id, rank=self.rank, world_size=self.world_size, step=s.number, ts=time.time(),
                loss=loss_value, lr=finite_or_none(s.metrics.get("lr")), tokens=min(s.tokens, 2**31 - 1),
                step_time_s=step_time, tokens_per_s=s.tokens / step_time if step_time > 0 else 0.0,
                data_s=data_s, fwd_bwd_s=fwd_bwd,
                optim_s=max(0.0, optim_total - comm_s) if optim_total is not None else None,
                comm_s=comm_s, val_loss=val_value, pid=self._pid,
            ),
            records,
        )
        self._last_step_time = step_time
        summary = self.summary
        if not summary.losses:
            summary.start_step = s.number
        summary.losses[s.number] = loss_value
        summary.final_step = s.number
        if val_value is not None:
            summary.val_losses[s.number] = val_value
            self._last_val = val_value
        if loss_value is not None:
            self._window.append(loss_value)
        self._last = {"step": s.number, "last_loss": loss_value, "loss_raw": loss,
                      "tokens_per_s": s.tokens / step_time if step_time > 0 else 0.0, **s.metrics}
        self.checkpointer.poll()

    # -- checkpoints -------------------------------------------------------------------------------

    def restore(self, **state: Any) -> int | None:
        """See :func:`restore`."""
        if self._step is not None:
            raise RuntimeError("restore() inside a step: call it before the first step")
        step = self.checkpointer.restore(state, hint=self.ctx.restore_dir)
        self.preemption.next_step = step + 1
        self.summary.start_step = step + 1
        return step if step > 0 else None

    def checkpoint(self, step: int, *, force: bool = False, **state: Any) -> bool:
        """See :func:`checkpoint`."""
        if self._step is not None:
            raise RuntimeError("checkpoint() inside a step: call it after the `with vigil.step(n):` block")
        interval = self.spec.checkpoint.interval_steps
        last = step >= self.steps
        preempt = False
        if interval > 0 and not last and self.preemption.due(step):
            self.preemption.checked(step, self._last_step_time)
            pending = self.ctx.preemption_pending()
            if pending and not self._preempt_handled:
                log.warning("rank %d: preemption pending, checkpointing after step %d", self.rank, step)
                preempt = True
            self._preempt_handled = pending
        save = force or (interval > 0 and (step % interval == 0 or last)) or preempt
        started = False
        if save:
            loss = self._last.get("loss_raw") if self._last.get("step") == step else None
            # A preemption checkpoint is waited for: it has to be complete before the drain deadline.
            started = self.checkpointer.save(step, state, loss, wait=last or preempt)
            (self.summary.checkpoints if started else self.summary.skipped_checkpoints).append(step)
        if last or preempt or step % self.ctx.report_interval == 0:
            self._report(step, final=last or preempt)
        return started

    def _report(self, step: int, *, final: bool) -> None:
        """Hand Ray Train the newest complete checkpoint (collective: every rank at the same steps)."""
        done = self.checkpointer.reportable()
        if done is None and not final:
            return
        last = self._last if self._last.get("step") == step else {}
        metrics: dict[str, Any] = {
            "step": step,
            "loss": sum(self._window) / len(self._window) if self._window else None,
            "last_loss": last.get("last_loss"),
            "val_loss": self._last_val,
            "lr": last.get("lr"),
            "tokens_per_s": last.get("tokens_per_s"),
            "world_size": self.world_size,
            "checkpoint_step": done.step if done is not None else None,
            "checkpoint_path": str(done.directory) if done is not None else None,
        }
        self._window.clear()
        self._reported_step = step
        self.ctx.report(metrics, done.directory if done is not None else None)

    # -- end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """After the user's code returned on every rank: wait for the checkpoint in flight, make the
        final report if the last step made none, release the process groups."""
        if self.closed:
            return
        self.closed = True
        for h in self._hooks:
            h.remove()
        try:
            self.checkpointer.wait()
            final = self.summary.final_step
            if final > 0 and self._reported_step != final:
                self._report(final, final=True)
        finally:
            self.checkpointer.close()

    def abort(self) -> None:
        """After a failure on this rank: no collectives, no waiting."""
        self.closed = True
        for h in self._hooks:
            h.remove()
        self.checkpointer.abort()


# --------------------------------------------------------------------------------------------------
# The module-level API (one session per process, as ray.train's)
# --------------------------------------------------------------------------------------------------

_current: Session | None = None


def init(ctx: RankContext | None = None, spec: JobCreate | None = None,
         config: Mapping[str, Any] | None = None) -> Session:
    """This rank's session: the one Vigil opened for the job, else a new one.

    Outside a Vigil job (``ctx`` None): rank and world size from ``torch.distributed`` when it is
    initialised (else a world of one), job id from ``VIGIL_JOB_ID`` (else ``local``), no telemetry,
    no fault injection, checkpoints under ``VIGIL_CHECKPOINT_ROOT`` when set (else a temporary root).
    """
    global _current
    if _current is not None and not _current.closed:
        if ctx is not None:
            raise RuntimeError("init(ctx): a session is already open on this process")
        return _current
    if ctx is None:
        distributed = dist.is_available() and dist.is_initialized()
        root = os.environ.get("VIGIL_CHECKPOINT_ROOT")
        ctx = RankContext(rank=dist.get_rank() if distributed else 0,
                          world_size=dist.get_world_size() if distributed else 1,
                          job_id=os.environ.get("VIGIL_JOB_ID") or "local",
                          checkpoint_root=Path(root) if root else None)
        _current = Session(ctx, spec, config)
        atexit.register(close)  # nobody else closes a session made here: wait for its last checkpoint
        return _current
    _current = Session(ctx, spec, config)
    return _current


def get_session() -> Session:
    """The open session (:func:`init` makes one)."""
    if _current is None or _current.closed:
        raise RuntimeError("no Vigil session on this process: run inside a Vigil job or call trainer.sdk.init()")
    return _current


def close() -> None:
    """Close the open session (the runner does this after the user's code returns)."""
    global _current
    if _current is not None:
        try:
            _current.close()
        finally:
            _current = None


def abort() -> None:
    """Drop the open session after a failure (no collectives)."""
    global _current
    if _current is not None:
        try:
            _current.abort()
        finally:
            _current = None


def optimizer(model: nn.Module, kind: str | None = None, *, lr: float | None = None,
              weight_decay: float | None = None, betas: tuple[float, float] | None = None,
              grad_clip: float | None = None, params: Mapping[str, Any] | None = None) -> Optimizer:
    """An optimizer of the registry over ``model`` (collective: every rank, same order).

    ``kind`` None: the job spec's optimizer (kind, lr, params, ...), with any argument given here
    overriding it; another ``kind``: that optimizer with its default params (or ``params``), the
    spec's lr, weight decay, betas and clip unless given. Invalid values raise a ``ValueError`` naming
    the field and the rule (the same validation as the job spec's).
    """
    return get_session().optimizer(model, kind, lr=lr, weight_decay=weight_decay, betas=betas,
                                   grad_clip=grad_clip, params=params)


def step(number: int) -> Step:
    """Open step ``number`` (``with vigil.step(n) as s:``); see :class:`Step`."""
    return get_session().step(number)


def report(loss: float | torch.Tensor | None = None, *, tokens: int | None = None, **metrics: Any) -> None:
    """Report the open step's loss, tokens and metrics (the same as ``s.report(...)``)."""
    get_session()._open_step("report()").report(loss, tokens=tokens, **metrics)


def checkpoint(step: int, *, force: bool = False, **state: Any) -> bool:
    """Call after every step with the objects to checkpoint (anything with ``state_dict()`` /
    ``load_state_dict()``: modules, :class:`Optimizer`, torch optimizers, your data position);
    returns whether a checkpoint of ``step`` was started. It is taken when due (the job's
    ``checkpoint.interval_steps``, its last step ``steps``, a pending preemption) or ``force``, never
    when a rank's loss or parameters are not finite. The RNG states are saved with it."""
    return get_session().checkpoint(step, force=force, **state)


def restore(**state: Any) -> int | None:
    """Load the newest valid checkpoint of this job into the named objects (the names given to
    :func:`checkpoint`); returns its step, None when there is none (start from step 1)."""
    return get_session().restore(**state)


def run(fn: Callable[..., Any], ctx: RankContext, spec: JobCreate | None = None,
        config: Mapping[str, Any] | None = None, *, pass_config: bool = True) -> TrainSummary:
    """Open a session for ``ctx``, call ``fn(config)`` (or ``fn()``), close it; this rank's summary.

    What Vigil's runner does on every rank of a job; tests and benchmarks call it the same way."""
    session = init(ctx, spec, config)
    try:
        if pass_config:
            fn(session.config)
        else:
            fn()
        close()
    except BaseException:
        abort()
        raise
    return session.summary


__all__ = [
    "Optimizer", "RankContext", "Session", "Step", "TrainSummary", "checkpoint", "get_session", "init",
    "optimizer", "report", "restore", "run", "step",
]
