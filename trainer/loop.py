"""The train loop: one function, :func:`train`, for every optimizer, every world size and every restart.

Fault tolerance wraps this loop instead of forking it (CONVENTIONS 5): Ray Train restarts the
ranks, the loop restores the newest valid checkpoint (:mod:`trainer.checkpoint`) and continues from
the next step. The optimizer strategy, the communication layer, the checkpointer, the fault hook
and telemetry are objects the loop calls; everything the loop needs from its surroundings comes
through :class:`RankContext`, so tests run it without Ray (torch.multiprocessing + gloo) and
:func:`train_loop_per_worker` runs it under Ray Train.

Steps are numbered from 1: "step k" is the k-th optimizer update, a checkpoint "after step k"
resumes at k + 1, and the run ends after step ``spec.steps``.

Once per step the loop: checks the fault file (:mod:`trainer.faults`, one ``os.stat``), trains,
collects a finished asynchronous checkpoint (rank 0 reports it as a ``CheckpointSample``), sends
the step's telemetry, and at the scheduled steps asks about a pending preemption (a Ray Train
barrier: measured at ~7 ms median and ~70 ms at p90 on the shared 2-core test machine, so it is
asked about once per :data:`PREEMPTION_CHECK_PERIOD_S`, not every step), checkpoints and reports.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from controller.schemas import JobCreate, StepSample
from trainer import checkpoint
from trainer.comm import Comm
from trainer.data import BatchSampler, build_samplers
from trainer.faults import NAN_LOSS, SLOW_RANK, FaultHook, fault_path
from trainer.model import build_model
from trainer.optim import Strategy, build_strategy
from trainer.telemetry import NullTelemetry, TelemetrySink, check_job_id, finite_or_none

log = logging.getLogger(__name__)

REPORT_INTERVAL_STEPS = 10
"""Steps between looks for a newly complete checkpoint to hand Ray Train (``ray.train.report``, made only
then, at the end and on a preemption: each report is a barrier across ranks that also waits for Ray
Train's controller to take it, ~1.4 s on this project's 2-core machine)."""
EVAL_BATCHES = 8
"""Validation batches per evaluation (always the same batches, so evaluations compare)."""
PREEMPTION_CHECK_PERIOD_S = 1.0
"""About how often the ranks ask whether a node of theirs is being drained. Ray Train's watcher polls
every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` (the driver sets 1 s), so a drain with a deadline of a
few seconds leaves time for the check, a checkpoint and a report."""
MAX_PREEMPTION_CHECK_STEPS = 1000
"""Never more steps than this between two preemption checks."""

ReportFn = Callable[[dict[str, Any], Path | None], None]
"""``report(metrics, checkpoint_dir)``; every rank calls it at the same steps (it may be a barrier)."""


def _no_report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
    return None


def _never() -> bool:
    return False


@dataclass
class RankContext:
    """What the loop needs to know about, and hand to, the world around this rank."""

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
    """This job's checkpoint root (``step-XXXXXXXX`` folders, see :mod:`trainer.checkpoint`); on
    start the newest valid checkpoint there is restored. None: a temporary root for this call
    (checkpoints do not outlive it; saves are synchronous)."""
    restore_dir: Path | None = None
    """A checkpoint folder (or a pointer folder, as Ray Train hands back) to consider on start next
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
    """This rank's one-shot fault file (:func:`trainer.faults.fault_path`); None: no fault injection."""
    cache_dir: Path | None = None
    """Corpus cache directory; None: :func:`trainer.data.default_cache_dir`."""

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
    """What one call of :func:`train` did on this rank."""

    start_step: int
    """First step this call ran (1, or the restored step + 1)."""
    final_step: int
    """Last step completed (``spec.steps`` when the run finished)."""
    losses: dict[int, float | None] = field(default_factory=dict)
    """This rank's training loss per step (None when not finite)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss per evaluated step (rank 0 only)."""
    checkpoints: list[int] = field(default_factory=list)
    """Steps after which a checkpoint was started (written in the background, or at once)."""
    skipped_checkpoints: list[int] = field(default_factory=list)
    """Checkpoint steps not written because a rank's loss or parameters were not finite."""
    faults: list[int] = field(default_factory=list)
    """Steps at which an injected fault fired on this rank."""
    model: nn.Module | None = None
    """This rank's model as the loop left it (for callers that save or inspect it)."""


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


def lr_at(step: int, spec: JobCreate) -> float:
    """Learning rate of step ``step`` (1-based): linear warmup to the peak, then constant or cosine
    decay that reaches ``min_lr_ratio * lr`` at the last step."""
    peak = spec.optimizer.lr
    sched = spec.lr_schedule
    if step <= sched.warmup_steps:
        return peak * step / sched.warmup_steps
    if sched.kind == "constant":
        return peak
    span = spec.steps - sched.warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - sched.warmup_steps) / span)
    floor = sched.min_lr_ratio
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(module: nn.Module, val: BatchSampler, batches: int = EVAL_BATCHES) -> float:
    """Mean loss of ``module`` on the first ``batches`` validation batches (eval mode, no grad)."""
    was_training = module.training
    module.eval()
    try:
        losses = []
        for i in range(batches):
            x, y = val.sample(i)
            _, loss = module(x, y)
            losses.append(float(loss))
        return sum(losses) / len(losses)
    finally:
        module.train(was_training)


def train(spec: JobCreate, ctx: RankContext) -> TrainSummary:
    """Run (or resume) the job ``spec`` on this rank until step ``spec.steps``.

    Needs ``torch.distributed`` initialised when ``ctx.world_size`` > 1 (Ray Train does it; tests
    do it by hand). Every rank must call this with the same spec.
    """
    comm = Comm.from_process_group()
    if (comm.rank, comm.world_size) != (ctx.rank, ctx.world_size):
        raise RuntimeError(
            f"process group is rank {comm.rank} of {comm.world_size}, context says {ctx.rank} of {ctx.world_size}"
        )
    # Same seed on every rank: identical initial weights (strategies also broadcast rank 0's).
    torch.manual_seed(spec.data.seed)
    model = build_model(spec.model)
    strategy: Strategy = build_strategy(spec.optimizer, model, comm)
    train_data, val_data = build_samplers(
        spec.data, spec.batch_size, spec.model.context, ctx.rank, ctx.world_size, ctx.cache_dir
    )
    # Different stream per rank from here on (dropout), reproducible per (seed, rank).
    torch.manual_seed(spec.data.seed * 1_000_003 + ctx.rank + 1)

    ckpt = checkpoint.Checkpointer(
        ctx.checkpoint_root, rank=ctx.rank, world_size=ctx.world_size, job_id=ctx.job_id,
        keep_last=spec.checkpoint.keep_last, sink=ctx.telemetry, async_save=ctx.async_checkpoints,
    )
    try:
        summary = _train(spec, ctx, comm, model, strategy, train_data, val_data, ckpt)
    except BaseException:
        ckpt.abort()
        raise
    ckpt.close()
    return summary


def _train(
    spec: JobCreate, ctx: RankContext, comm: Comm, model: nn.Module, strategy: Strategy, train_data: BatchSampler,
    val_data: BatchSampler, ckpt: checkpoint.Checkpointer,
) -> TrainSummary:
    start = ckpt.restore(model, strategy, train_data, hint=ctx.restore_dir) + 1
    summary = TrainSummary(start_step=start, final_step=start - 1, model=model)
    if ctx.rank == 0:
        log.info(
            "job %s: %d ranks, %s, %d parameters, steps %d..%d",
            ctx.job_id, ctx.world_size, spec.optimizer.kind, sum(p.numel() for p in model.parameters()),
            start, spec.steps,
        )

    faults = FaultHook(ctx.fault_file)
    preemption = PreemptionSchedule(ctx.preemption_check_s, start, ctx.world_size > 1, ckpt.control_group)
    preempt_handled = False  # a checkpoint was taken for the preemption still pending
    ckpt_every = spec.checkpoint.interval_steps
    tokens = spec.batch_size * spec.model.context
    pid = os.getpid()
    window: list[float] = []  # finite losses since the last report
    slow = 1.0  # a slow_rank fault's factor on the compute phase
    last_val: float | None = None
    model.train()
    for step in range(start, spec.steps + 1):
        t0 = time.perf_counter()
        comm.set_step(step)
        fault = faults.check(step)
        x, y = train_data.next()
        t1 = time.perf_counter()
        strategy.zero_grad()
        _, loss = strategy.model(x, y)
        assert loss is not None
        if fault is not None and fault.kind == NAN_LOSS:
            # The real consequence follows: NaN gradients, and NaN weights after the update.
            loss = loss * float("nan")
            summary.faults.append(step)
        elif fault is not None and fault.kind == SLOW_RANK:
            slow = fault.factor
            summary.faults.append(step)
        loss.backward()
        if slow > 1.0:  # a slow accelerator: the compute phase takes `slow` times as long
            time.sleep((slow - 1.0) * (time.perf_counter() - t1))
        t2 = time.perf_counter()
        lr = lr_at(step, spec)
        strategy.step(step, lr)
        t3 = time.perf_counter()
        records = comm.drain()  # the first step's also holds the start-up ones (step 0: initial broadcasts)
        comm_s = sum(r.duration_s for r in records if r.step == step)
        step_time = t3 - t0
        raw_loss = loss.item()
        loss_value = finite_or_none(raw_loss)
        summary.losses[step] = loss_value
        summary.final_step = step
        if loss_value is not None:
            window.append(loss_value)
        ckpt.poll()

        last = step == spec.steps
        val_loss = None
        if last or (spec.eval_interval > 0 and step % spec.eval_interval == 0):
            # Every rank asks for the eval module (a strategy may need a collective to build it);
            # rank 0 alone spends the forward passes.
            module = strategy.eval_module()
            if ctx.rank == 0:
                val_loss = evaluate(module, val_data)
                summary.val_losses[step] = val_loss
                last_val = val_loss

        ctx.telemetry.send_step(
            StepSample(
                job_id=ctx.job_id,
                rank=ctx.rank,
                world_size=ctx.world_size,
                step=step,
                ts=time.time(),
                loss=loss_value,
                lr=lr,
                tokens=tokens,
                step_time_s=step_time,
                tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
                data_s=t1 - t0,
                fwd_bwd_s=t2 - t1,
                optim_s=max(0.0, (t3 - t2) - comm_s),
                comm_s=comm_s,
                val_loss=finite_or_none(val_loss),
                pid=pid,
            ),
            records,
        )

        # Every rank reaches the following at the same steps, so the collectives (preemption query,
        # checkpoint, report) stay in lockstep.
        save = ckpt_every > 0 and (step % ckpt_every == 0 or last)
        preempt = False
        if ckpt_every > 0 and not last and preemption.due(step):
            preemption.checked(step, step_time)
            pending = ctx.preemption_pending()
            if pending and not preempt_handled:
                log.warning("rank %d: preemption pending, checkpointing after step %d", ctx.rank, step)
                preempt = True
            preempt_handled = pending
        if save or preempt:
            # A preemption checkpoint is waited for: it has to be complete before the drain deadline.
            if ckpt.save(step, model, strategy, train_data, raw_loss, wait=last or preempt):
                summary.checkpoints.append(step)
            else:
                summary.skipped_checkpoints.append(step)
        if last or preempt or step % ctx.report_interval == 0:
            # Ray Train hears of a step only with a checkpoint (or at the end, or on a preemption):
            # each ray.train.report blocks until Ray Train's controller takes it (measured: ~1.4 s
            # on a 2-core host), and Vigil's own telemetry carries the metrics anyway.
            done = ckpt.reportable()
            if done is None and not (last or preempt):
                continue
            metrics: dict[str, Any] = {
                "step": step,
                "loss": sum(window) / len(window) if window else None,
                "last_loss": loss_value,
                "val_loss": last_val,
                "lr": lr,
                "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                "world_size": ctx.world_size,
                "checkpoint_step": done.step if done is not None else None,
                "checkpoint_path": str(done.directory) if done is not None else None,
            }
            window.clear()
            ctx.report(metrics, done.directory if done is not None else None)
    return summary


def ray_node_name(node_id: str, nodes: list[dict[str, Any]]) -> str:
    """The Ray node *name* of ``node_id`` in ``ray.nodes()``'s answer (Vigil's node identity,
    docs/RECOVERY.md); the node id itself when the node has no name there."""
    for n in nodes:
        if n.get("NodeID") == node_id and n.get("NodeName"):
            return str(n["NodeName"])
    return node_id


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point of each rank. ``config``: ``{"spec": JobCreate as dict, "job_id": str,
    "run_dir": agent sockets dir or None, "checkpoint_root": str (the job's checkpoint root),
    "report_interval": int (optional)}``."""
    import ray
    import ray.train

    from controller.settings import agent_socket_path, get_settings
    from trainer.telemetry import RankTelemetry

    spec = JobCreate.model_validate(config["spec"])
    job_id = str(config["job_id"])
    tctx = ray.train.get_context()
    rank = tctx.get_world_rank()
    ray_node_id = ray.get_runtime_context().get_node_id()
    try:
        node = ray_node_name(ray_node_id, ray.nodes())
    except Exception as e:  # noqa: BLE001 - the node id still identifies the node, only less durably
        log.warning("rank %d: cannot read Ray's node names (%s); using the node id", rank, e)
        node = ray_node_id
    run_dir = Path(config.get("run_dir") or get_settings().run_dir)
    root = config.get("checkpoint_root")
    if root is None:
        from trainer.driver import DEFAULT_STORAGE_PATH, ENV_STORAGE_PATH

        storage = Path(os.environ.get(ENV_STORAGE_PATH) or DEFAULT_STORAGE_PATH).expanduser()
        root = checkpoint.job_root(storage, job_id)

    def report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        # Rank 0 alone hands Ray Train a pointer to the complete checkpoint (module docstring of
        # trainer.checkpoint); Ray copies that tiny folder, never the data.
        if checkpoint_dir is None or rank != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="vigil-pointer-") as d:
            checkpoint.write_pointer(Path(d), checkpoint_dir)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    def preemption_pending() -> bool:
        return ray.train.get_preemption_info() is not None

    resume = ray.train.get_checkpoint()
    with RankTelemetry(agent_socket_path(run_dir, node)) as telemetry, (
        resume.as_directory() if resume is not None else nullcontext(None)
    ) as restore_dir:
        ctx = RankContext(
            rank=rank,
            world_size=tctx.get_world_size(),
            job_id=job_id,
            node_id=node,
            report=report,
            telemetry=telemetry,
            checkpoint_root=Path(root),
            restore_dir=Path(restore_dir) if restore_dir is not None else None,
            preemption_pending=preemption_pending,
            report_interval=int(config.get("report_interval") or REPORT_INTERVAL_STEPS),
            fault_file=fault_path(run_dir, job_id, rank),
        )
        summary = train(spec, ctx)
        if telemetry.dropped_total:
            log.info("rank %d: %d telemetry samples dropped (no agent or agent busy)", ctx.rank, telemetry.dropped_total)
    log.info("rank %d (node %s) finished at step %d", ctx.rank, node, summary.final_step)
