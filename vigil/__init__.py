"""Vigil's public name: the rank API your training code calls, and the typed REST client.

``import vigil`` is all a user writes::

    import vigil

    def train_func(config):
        run = vigil.init()
        ...
        with vigil.step(step) as s:
            ...
            s.report(loss=loss.item())
        vigil.checkpoint(step, model=model, optimizer=opt)

The rank API (:mod:`vigil.sdk`: ``init``, ``optimizer``, ``step``, ``report``, ``checkpoint``,
``restore``, ...) and :class:`Client` (the controller's REST API, :mod:`vigil.contract.client`) load on first
use, so ``import vigil`` itself imports neither torch nor httpx. The rest of the package is Vigil's rank
runtime (driver, runner, communication layer, optimizers, checkpoints, telemetry): one top-level name
that a project's own ``trainer.py``, ``model.py`` or ``data.py`` cannot shadow.
"""

from __future__ import annotations

import importlib
from typing import Any

_SDK = frozenset({
    "MAX_PREEMPTION_CHECK_STEPS", "PHASES", "PREEMPTION_CHECK_PERIOD_S", "REPORT_INTERVAL_STEPS", "Optimizer",
    "PreemptionSchedule", "RankContext", "ReportFn", "Session", "Step", "TrainSummary", "abort", "checkpoint",
    "close", "get_session", "init", "optimizer", "report", "restore", "run", "step",
})
_CLIENT = {"Client": "VigilClient", "VigilClient": "VigilClient", "ApiError": "ApiError"}

__all__ = [
    "MAX_PREEMPTION_CHECK_STEPS",
    "PHASES",
    "PREEMPTION_CHECK_PERIOD_S",
    "REPORT_INTERVAL_STEPS",
    "ApiError",
    "Client",
    "Optimizer",
    "PreemptionSchedule",
    "RankContext",
    "ReportFn",
    "Session",
    "Step",
    "TrainSummary",
    "VigilClient",
    "abort",
    "checkpoint",
    "close",
    "get_session",
    "init",
    "optimizer",
    "report",
    "restore",
    "run",
    "step",
]


def __getattr__(name: str) -> Any:
    if name in _SDK:
        return getattr(importlib.import_module("vigil.sdk"), name)
    if name in _CLIENT:
        return getattr(importlib.import_module("vigil.contract.client"), _CLIENT[name])
    raise AttributeError(f"module 'vigil' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SDK | set(_CLIENT))
