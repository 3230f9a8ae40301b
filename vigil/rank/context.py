"""What a rank is told when it starts (:class:`RankContext`), what it returns (:class:`TrainSummary`),
and when it looks for a preemption (:class:`PreemptionSchedule`); the rank API's constants."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vigil.contract.checkpoint_layout import Location
from vigil.telemetry import NullTelemetry, TelemetrySink, check_job_id

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
    checkpoint_root: Location | None = None
    """This job's checkpoint root (``step-XXXXXXXX`` folders, see :mod:`vigil.checkpointing`), a folder or a
    URI (``s3://bucket/prefix``); restore takes the newest valid checkpoint there. None: a temporary root for this session (checkpoints do
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
    """This rank's one-shot fault file (:func:`vigil.contract.settings.fault_file_path`); None: no fault injection."""
    cache_dir: Path | None = None
    """Data cache directory for code that wants one (the GPT example's corpus); None: its default."""
    optimizer_hooks: bool = True
    """Register torch's global optimizer-step hooks (marked steps' optimizer phase, unmarked code's steps);
    False: whoever made the context forwards them (a launched script, :mod:`vigil.launch`)."""
    live: Any = None
    """Live recovery (:class:`vigil.live.LiveReplica`): this rank is a torchft replica; None: the
    usual process group under Ray Train."""

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
