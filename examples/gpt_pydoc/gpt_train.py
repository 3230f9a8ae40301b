"""A byte-level GPT trained on CPython's own documentation, written against Vigil's rank API.

Vigil's bundled example and the default entry point of a job spec (``entrypoint:
gpt_train:train_func`` with ``--working-dir examples/gpt_pydoc``, or the installed
``examples.gpt_pydoc.gpt_train:train_func``). It uses nothing a user's code could not: the model
(:mod:`vigil.model`) and the corpus (:mod:`vigil.data`) are ordinary library code, the loop is
below. Its settings are the job spec's ``model``, ``data``, ``batch_size``, ``lr_schedule``,
``eval_interval`` and ``steps``; the optimizer is the spec's ``optimizer`` (any kind).

Steps are numbered from 1: "step k" is the k-th optimizer update, a checkpoint "after step k"
resumes at k + 1, and the run ends after step ``spec.steps``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from vigil import sdk as vigil
from vigil.contract.schemas import JobCreate
from vigil.data import BatchSampler, build_samplers
from vigil.model import build_model

log = logging.getLogger(__name__)

EVAL_BATCHES = 8
"""Validation batches per evaluation (always the same batches, so evaluations compare)."""


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


def train_func(config: dict[str, Any] | None = None) -> None:
    """Every rank's training function (Ray Train style): run or resume the job until ``spec.steps``."""
    run = vigil.init()
    spec = run.spec
    # Same seed on every rank: identical initial weights (strategies also broadcast rank 0's).
    torch.manual_seed(spec.data.seed)
    model = build_model(spec.model)
    opt = vigil.optimizer(model)  # the spec's optimizer, whichever kind
    train_data, val_data = build_samplers(spec.data, spec.batch_size, spec.model.context, run.rank,
                                          run.world_size, run.ctx.cache_dir)
    # Different stream per rank from here on (dropout), reproducible per (seed, rank).
    torch.manual_seed(spec.data.seed * 1_000_003 + run.rank + 1)
    state = {"model": model, "strategy": opt, "data": train_data}
    start = (vigil.restore(**state) or 0) + 1
    if run.rank == 0:
        log.info("job %s: %d ranks, %s, %d parameters, steps %d..%d", run.job_id, run.world_size,
                 spec.optimizer.kind, sum(p.numel() for p in model.parameters()), start, spec.steps)
    tokens = spec.batch_size * spec.model.context
    model.train()
    for step in range(start, spec.steps + 1):
        with vigil.step(step) as s:
            with s.phase("data"):
                x, y = train_data.next()
            with s.phase("forward_backward"):
                opt.zero_grad()
                _, loss = opt.model(x, y)
                loss.backward()
            lr = lr_at(step, spec)
            opt.step(lr)
            val_loss = None
            if step == spec.steps or (spec.eval_interval > 0 and step % spec.eval_interval == 0):
                # Every rank asks for the eval module (a strategy may need a collective to build it);
                # rank 0 alone spends the forward passes.
                module = opt.eval_module()
                if run.rank == 0:
                    val_loss = evaluate(module, val_data)
            s.report(loss=loss.item(), tokens=tokens, lr=lr, val_loss=val_loss)
        vigil.checkpoint(step, **state)


def train(spec: JobCreate, ctx: vigil.RankContext) -> vigil.TrainSummary:
    """Run this example on one rank outside Ray (tests, benchmarks), as Vigil's runner does under Ray."""
    return vigil.run(train_func, ctx, spec)
