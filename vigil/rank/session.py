"""A rank's session (:class:`Session`): its context, communication layer, telemetry sink, fault hook,
optimizer, steps and checkpoints, from open to close."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from vigil import checkpointing as ckpt_mod
from vigil.capture import CollectiveCapture, Window, assign, captured_times, fr_available
from vigil.comm import CollectiveRecord, Comm
from vigil.contract.schemas import FaultSample, JobCreate, OptimizerSpec, ProgressSample, StepSample
from vigil.faults import NAN_LOSS, PROCESS_KINDS, SLOW_RANK, Fault, FaultHook, carry_out
from vigil.optim import build_strategy
from vigil.rank.adapt import Adaptation
from vigil.rank.autostep import AutoSteps
from vigil.rank.context import PreemptionSchedule, RankContext, TrainSummary
from vigil.rank.step import Optimizer, Step, runqueue_since
from vigil.rank.watch import Watcher
from vigil.telemetry import TelemetrySink, finite_or_none

log = logging.getLogger(__name__)

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
        self.live = ctx.live
        """Live recovery's replica (:mod:`vigil.live`), or None."""
        self.comm = self.live.comm if self.live is not None else Comm.from_process_group()
        if self.live is None and (self.comm.rank, self.comm.world_size) != (ctx.rank, ctx.world_size):
            raise RuntimeError(f"process group is rank {self.comm.rank} of {self.comm.world_size}, "
                               f"context says {ctx.rank} of {ctx.world_size}")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        """Where this rank's tensors go (its GPU when it has one)."""
        self.faults = FaultHook(ctx.fault_file)
        self.adapt = Adaptation.of(ctx, self.spec, self.comm)
        """``recovery.policy: adapt``: the setting the ranks agree on (:mod:`vigil.rank.adapt`); None for other jobs."""
        self.summary = TrainSummary()
        # A live replica checkpoints as a world of one (every replica's state is the same; the
        # quorum's first replica writes): there is no process group across replicas to coordinate.
        solo = self.live is not None
        self.checkpointer = ckpt_mod.Checkpointer(
            ctx.checkpoint_root, rank=0 if solo else ctx.rank, world_size=1 if solo else ctx.world_size,
            job_id=ctx.job_id,
            keep_last=self.spec.checkpoint.keep_last, sink=ctx.telemetry, async_save=ctx.async_checkpoints,
        )
        self.attempt = self.live.attempt if self.live is not None else self.checkpointer.claim_attempt()
        """This start's run attempt (increases at every restart of the ranks); tags every sample."""
        self.preemption = PreemptionSchedule(ctx.preemption_check_s, 1, ctx.world_size > 1 and not solo,
                                             self.checkpointer.control_group)
        self._preempt_handled = False
        self._step: Step | None = None
        self._last_step_time = 0.0
        self._nan_step: int | None = None
        self.slow_factor = 1.0
        """A ``slow_rank`` fault's factor: each step's compute takes this many times as long (1.0: none)."""
        self.slow_mode = "compute"
        """Where a ``slow_rank`` fault's wait goes: ``compute`` or ``comm`` (:data:`vigil.faults.SLOW_MODES`)."""
        self._window: list[float] = []
        self._last: dict[str, Any] = {}
        self._last_val: float | None = None
        self._reported_step = 0
        self._hooks: list[Any] = []
        self._pid = os.getpid()
        self.closed = False
        # Collectives torch runs on its own (the user's DDP, FSDP, DTensor, dist calls), from its Flight
        # Recorder (vigil.capture); off once the code steps one of Vigil's optimizers (its layer counts
        # exactly). Step samples wait for the read that finds their collectives (about a second).
        self.capture: CollectiveCapture | None = None
        if fr_available() and self.live is None:
            self.capture = CollectiveCapture(self.world_size, exclude=self.checkpointer.group_names())
        self._held: list[tuple[StepSample, list[CollectiveRecord], Window, bool]] = []
        self._shipped_step = 0
        self._ship_lock = threading.Lock()
        self.ship_cpu_s = 0.0
        """CPU seconds spent reading the Flight Recorder and assigning its entries to steps (what capture costs;
        the collective samples it adds are sent as every sample is)."""
        self._vigil_optimizer = False
        self._auto = AutoSteps(self)
        self._last_end = time.monotonic()
        self._watch: Watcher | None = None
        send_progress = getattr(ctx.telemetry, "send_progress", None)  # optional in a sink
        if (fr_available() or self.live is not None) and send_progress is not None:
            self._watch = Watcher(self._idle, self._progress_sample, send_progress,
                                  exclude=self.checkpointer.group_names(), world_size=self.world_size,
                                  on_stall=lambda: self._ship_held(force=True),
                                  state=self.live.comm.progress if self.live is not None else None,
                                  tick=getattr(ctx.telemetry, "offer", None)).start()
        if ctx.optimizer_hooks:
            self._hooks.append(register_optimizer_step_pre_hook(self._torch_optimizer_pre))
            self._hooks.append(register_optimizer_step_post_hook(self._torch_optimizer_post))

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
        self._vigil_optimizer = True
        self.capture = None  # Vigil's layer counts this code's collectives exactly
        self._ship_held(force=True)
        strategy = build_strategy(spec, model, self.comm)
        if self.adapt is not None:
            self.adapt.add(strategy, self.spec, spec)
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

    def _torch_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A torch optimizer's step (the user's own, not one of Vigil's) inside an open step: the end of
        compute (an unmarked step's ``slow_rank`` acts here) and the start of the optimizer phase."""
        s = self._step
        if s is None or self._vigil_optimizer:
            return
        s.torch_optimizer_started()

    def _torch_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._vigil_optimizer:
            return
        s = self._step
        if s is not None:
            s.torch_optimizer_ended()
        if s is None or s.auto:
            self._auto.after_optimizer(optimizer)  # code that does not mark its steps

    def restart_idle_clock(self) -> None:
        """Training was just seen to progress: the idle time the watcher reports starts again from now."""
        self._last_end = time.monotonic()

    def _idle(self) -> tuple[float, float]:
        return time.monotonic() - self._last_end, self._last_step_time

    def _progress_sample(self, state: dict[str, Any], idle_s: float) -> ProgressSample:
        s = self._step
        return ProgressSample(job_id=self.job_id, rank=self.rank, attempt=self.attempt, ts=time.time(),
                              step=s.number if s is not None else self.summary.final_step, idle_s=idle_s, **state)

    def _fault_hit(self, fault: Fault) -> None:
        """Tell the controller the step an injected fault hits (its record's ``hit_step``), before acting."""
        send = getattr(self.ctx.telemetry, "send_fault", None)  # optional in a sink (TelemetrySink)
        if fault.fault_id is None or send is None:
            return
        send(FaultSample(
            job_id=self.job_id, rank=self.rank, step=fault.step, attempt=self.attempt, ts=time.time(),
            fault_id=fault.fault_id, fault_kind=fault.kind))

    # -- steps -------------------------------------------------------------------------------------

    def step(self, number: int) -> Step:
        """See :func:`step`."""
        return Step(self, number)

    @property
    def current_step(self) -> Step | None:
        """The open step, None when none is."""
        return self._step

    def open_step(self, what: str) -> Step:
        """The open step; a RuntimeError naming ``what`` (the caller) when none is open."""
        if self._step is None:
            raise RuntimeError(f"{what} needs an open step: call it inside `with vigil.step(n):`")
        return self._step

    def drop_step(self) -> None:
        """No step is open any more (the open one is neither recorded nor sent)."""
        self._step = None

    def step_opened(self, step: Step) -> None:
        """``step`` is entered (:meth:`Step.__enter__`): it becomes the open step, and a fault due at it fires."""
        if not step.auto:
            self._auto.disengage()
        if self._step is not None:
            raise RuntimeError(f"step {step.number} opened while step {self._step.number} is still open")
        self._step = step
        self.comm.set_step(step.number)
        if self.live is not None:
            self.live.start_step(step.number)  # the quorum of this step (a replica that left is out, a new one heals)
        fault = self.faults.check(step.number)
        if fault is not None:
            self._take_fault(step, fault)

    def _take_fault(self, step: Step, fault: Fault) -> None:
        """A fault due at ``step`` fires: a process fault now (``kill_rank`` never returns, ``hang_rank``
        returns when continued), ``nan_loss`` in this step's forward, ``slow_rank`` in each step's compute."""
        self.summary.faults.append(step.number)
        step.fault = fault.kind
        self._fault_hit(fault)
        if fault.kind in PROCESS_KINDS:
            carry_out(fault)
        elif fault.kind == NAN_LOSS:
            self._nan_step = step.number
        elif fault.kind == SLOW_RANK:
            self.slow_factor, self.slow_mode = fault.factor, fault.mode

    def step_closed(self, step: Step, *, failed: bool) -> None:
        """``step`` is left (:meth:`Step.__exit__`): no step is open; one that did not fail is recorded and sent."""
        self._step = None
        if failed:
            return
        if self.live is not None:
            self.live.end_step()
        if self.adapt is not None:  # after the step's optimizer step, on every rank: a boundary's agreement
            self.adapt.step_ended(step, self.attempt)
        self.finish_step(step)

    def finish_step(self, s: Step) -> None:
        """Record and send ``s``, which has ended: its step sample, the summary, the loss window."""
        now = time.perf_counter()
        records = self.comm.drain()  # the first step's also holds the start-up ones (step 0: initial broadcasts)
        # (a live replica's heal is recorded under its first step but ran before it: not this step's time)
        comm_s = sum(r.duration_s for r in records if r.step == s.number and r.op != "heal")
        step_time = now - s.started_at
        data_s = s.phases.get("data")
        optim_total = s.phases.get("optimizer")
        fwd_bwd = s.phases.get("forward_backward")
        if fwd_bwd is None:  # not marked: the rest of the step
            fwd_bwd = max(0.0, step_time - (data_s or 0.0) - (optim_total or 0.0))
        loss = s.loss
        if s.number == self._nan_step and loss is not None:
            loss = math.nan  # the user may have computed it outside the module
        loss_value = finite_or_none(loss)
        val = s.metrics.get("val_loss")
        val_value = finite_or_none(val) if isinstance(val, int | float) else None
        sample = StepSample(
                job_id=self.job_id, rank=self.rank, world_size=self.world_size, step=s.number,
                attempt=self.attempt, ts=time.time(),
                loss=loss_value, lr=finite_or_none(s.metrics.get("lr")), tokens=min(s.tokens, 2**31 - 1),
                step_time_s=step_time, tokens_per_s=s.tokens / step_time if step_time > 0 else 0.0,
                data_s=data_s, fwd_bwd_s=fwd_bwd,
                optim_s=max(0.0, optim_total - comm_s) if optim_total is not None else None,
                comm_s=comm_s, val_loss=val_value, pid=self._pid, cpu_wait_s=runqueue_since(s.runqueue_start),
        )
        if self.capture is None and not s.auto:
            self.ctx.telemetry.send_step(sample, records)
        else:
            if s.auto:  # ship the steps before this one: its metrics may follow its optimizer step (autostep)
                self._ship_held()
            self._held.append((sample, records, Window(s.number, s.start_ns, s.optimizer_ns, time.time_ns()),
                               "forward_backward" in s.phases))
            if not s.auto:
                self._ship_held()
        self._last_step_time = step_time
        self._last_end = time.monotonic()
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

    def amend_held(self, number: int, values: dict[str, Any]) -> int | None:
        """Metrics reported after step ``number`` ended (:meth:`AutoSteps.reported`) onto its held sample;
        None when it was sent already."""
        with self._ship_lock:
            for i in range(len(self._held) - 1, -1, -1):
                sample, records, w, marked = self._held[i]
                if sample.step != number:
                    continue
                update = {k: finite_or_none(v) for k, v in values.items() if k in ("loss", "val_loss", "lr")}
                if "tokens" in values:
                    update["tokens"] = min(values["tokens"], 2**31 - 1)
                    update["tokens_per_s"] = values["tokens"] / sample.step_time_s if sample.step_time_s > 0 else 0.0
                self._held[i] = (sample.model_copy(update=update), records, w, marked)
                if "loss" in values:
                    self.summary.losses[number] = update["loss"]
                    self._last["last_loss"] = update["loss"]
                    if update["loss"] is not None:
                        self._window.append(update["loss"])
                if update.get("val_loss") is not None:
                    self.summary.val_losses[number] = self._last_val = update["val_loss"]
                return number
        return None

    def _ship_held(self, *, force: bool = False) -> None:
        """Send the held step samples with the collectives the Flight Recorder holds for them (when a read
        is due, or ``force``); a step's communication time is the span its captured calls cover."""
        with self._ship_lock:  # the training thread, or the watcher's when the steps stall
            self._ship_held_locked(force)

    def _steps_since_read(self) -> int:
        """Steps finished since the recorder was last read: the held ones, or more where steps went out
        unheld between (the step numbers tell; not across a restart's renumbering)."""
        since = self._held[-1][2].step - self._shipped_step if self._held else 0
        return since if self._shipped_step and since >= len(self._held) else len(self._held)

    def _ship_held_locked(self, force: bool) -> None:
        cap = self.capture
        if not self._held or (cap is not None and not force and not cap.due(self._steps_since_read())):
            return
        since = self._steps_since_read()
        held, self._held = self._held, []
        captured: dict[int, list[CollectiveRecord]] = {}
        if cap is not None:
            t = time.thread_time()
            found = cap.read()
            recs, later = assign(found, [h[2] for h in held], before_first=self._shipped_step)
            cap.hold(later)
            cap.observed(since)
            for r in recs:
                captured.setdefault(r.step, []).append(r)
            self.ship_cpu_s += time.thread_time() - t
        for i, (sample, records, w, marked) in enumerate(held):
            mine = captured.pop(w.step, [])
            if i == 0:  # calls of steps already sent (start-up, between steps) ride with the first
                mine += [r for recs_ in captured.values() for r in recs_ if r.step < w.step]
            own = [r for r in mine if r.step == w.step]
            if own:
                sample = sample.model_copy(update=captured_times(sample, own, w, marked))
            self.ctx.telemetry.send_step(sample, [*records, *mine])
            self._shipped_step = w.step

    # -- checkpoints -------------------------------------------------------------------------------

    def restore(self, **state: Any) -> int | None:
        """See :func:`restore`."""
        if self._step is not None and not self._step.auto:
            raise RuntimeError("restore() inside a step: call it before the first step")
        if self.live is not None:
            self.live.register(state)
            step = self.live.restore(lambda: self.checkpointer.restore(state, hint=self.ctx.restore_dir))
            self.attempt = self.live.attempt  # a peer's (healed) or a new one (restarted from disk)
        else:
            step = self.checkpointer.restore(state, hint=self.ctx.restore_dir)
        self.preemption.next_step = step + 1
        self.summary.start_step = step + 1
        return step if step > 0 else None

    def checkpoint(self, step: int, *, force: bool = False, **state: Any) -> bool:
        """See :func:`checkpoint`."""
        if self._step is not None and not self._step.auto:
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
        if self.live is not None and not self.live.is_primary():
            save = False  # the quorum's first replica writes the job's checkpoints
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
        if self.world_size > 1 and not dist.is_initialized():
            # The code destroyed its process group itself (a torchrun script's last line): nothing
            # collective is possible any more; send what is held and let go.
            self._ship_held(force=True)
            self.abort()
            return
        self.closed = True
        self._stop_watch()
        for h in self._hooks:
            h.remove()
        try:
            self._ship_held(force=True)
            self.checkpointer.wait()
            final = self.summary.final_step
            if final > 0 and self._reported_step != final:
                self._report(final, final=True)
        finally:
            self.checkpointer.close()
            if self.live is not None:
                self.live.close()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def abort(self) -> None:
        """After a failure on this rank: no collectives, no waiting."""
        self.closed = True
        self._stop_watch()
        for h in self._hooks:
            h.remove()
        self.checkpointer.abort()
        if self.live is not None:
            self.live.close()

