"""Vigil's rank API: what your training code calls on every rank, whatever the model, data and loop.

A complete loop (the same on every rank)::

    from vigil import sdk as vigil

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
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vigil.contract.checkpoint_layout import as_location
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import ENV_CHECKPOINT_ROOT, ENV_JOB_ID
from vigil.launch_context import context_from_env, launched
from vigil.rank.context import (
    MAX_PREEMPTION_CHECK_STEPS,
    PHASES,
    PREEMPTION_CHECK_PERIOD_S,
    REPORT_INTERVAL_STEPS,
    PreemptionSchedule,
    RankContext,
    ReportFn,
    TrainSummary,
)
from vigil.rank.session import Session
from vigil.rank.step import Optimizer, Step

log = logging.getLogger(__name__)


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
    if ctx is None and (found := launched()) is not None:  # a script rank of a Vigil job
        ctx, spec_, config_ = context_from_env(found)
        _current = Session(ctx, spec or spec_, config if config is not None else config_)
        return _current
    if ctx is None:
        distributed = dist.is_available() and dist.is_initialized()
        root = os.environ.get(ENV_CHECKPOINT_ROOT)
        ctx = RankContext(rank=dist.get_rank() if distributed else 0,
                          world_size=dist.get_world_size() if distributed else 1,
                          job_id=os.environ.get(ENV_JOB_ID) or "local",
                          checkpoint_root=as_location(root) if root else None)
        _current = Session(ctx, spec, config)
        atexit.register(close)  # nobody else closes a session made here: wait for its last checkpoint
        return _current
    _current = Session(ctx, spec, config)
    return _current


def get_session() -> Session:
    """The open session (:func:`init` makes one)."""
    if _current is None or _current.closed:
        raise RuntimeError("no Vigil session on this process: run inside a Vigil job or call vigil.sdk.init()")
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
    get_session().open_step("report()").report(loss, tokens=tokens, **metrics)


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
    "MAX_PREEMPTION_CHECK_STEPS", "PHASES", "PREEMPTION_CHECK_PERIOD_S", "REPORT_INTERVAL_STEPS", "Optimizer",
    "PreemptionSchedule", "RankContext", "ReportFn", "Session", "Step", "TrainSummary", "abort", "checkpoint",
    "close", "get_session", "init", "optimizer", "report", "restore", "run", "step",
]
