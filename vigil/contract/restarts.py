"""``recovery.max_restarts`` and "progress": their one definition, for the controller and the job driver alike.

**Progress** is the point a restart resumes from moving forward since the previous restart (for a job's
first restart: since the job started, which always counts as progress). Where a restart resumes from:

* a restart of the whole worker group (Ray Train under ``observe``, ``evict_restart``, ``rollback``; a
  rollback or a manual restart under ``live``) resumes from the job's **newest valid checkpoint**: the
  point is that checkpoint's step (-1: none yet). Steps run after it and lost in the failure are no progress.
* a replica replaced under ``live`` (torchft) heals from a live peer where the peers stand: the point is
  the job's **newest step**.

**max_restarts** is how many restarts in a row without progress a job is given. A restart made no progress
when the job failed again before its resume point moved; after ``max_restarts`` such restarts in a row the
job's next failure is final. ``0`` asks for no restart:
Ray Train's first failure of a rank is final; a restart Ray makes without counting it as a failure (the
worker group moved off a node Vigil drained, a Ray Train preemption; a live replica Ray starts again) is
still judged as under ``1``.

Who applies it (docs/RECOVERY.md, "Bounded restarts"):

* the controller (``controller/recovery``) counts each restart when the job resumes after an action
  (:meth:`RestartBudget.after_restart`) and fails a job whose restarts in a row without progress reached
  :attr:`RestartBudget.limit` (it judges at the resume, so the last restart has already happened);
* the job driver (``vigil/driver.py``) hands the same number to Ray Train (``FailureConfig.max_failures``:
  Ray Train's own count, every failure within one run) and, when a run has failed, starts a fresh run from
  the newest valid checkpoint only if that checkpoint moved during the run (:func:`progressed`) and
  restarts were asked for (:attr:`RestartBudget.reruns`). The same rule, applied per Ray Train run: a run
  that progressed early and then stalled is run again, where the controller, counting restarts in a row,
  fails the job first;
* the live driver (``vigil/live_driver.py``) does not apply it: Ray's per-replica bound there (with spares,
  the driver's own bound on replacements, ``vigil/live_replicas.py``) is a generous backstop, and the
  controller applies ``max_restarts``.

Torch-free and dependency-free: the controller, the driver and the tests import it.
"""

from __future__ import annotations

from dataclasses import dataclass


def progressed(before: int | None, now: int) -> bool:
    """Whether the resume point moved forward: ``now`` past ``before`` (None: no restart before this one,
    so the job's start is the mark and this counts as progress)."""
    return before is None or now > before


@dataclass(frozen=True)
class RestartBudget:
    """The job's ``recovery.max_restarts`` with its one meaning (module docstring)."""

    max_restarts: int

    @property
    def limit(self) -> int:
        """Restarts in a row without progress after which the controller fails the job: ``max_restarts``,
        at least 1 (with 0 Ray Train restarts nothing; what restarts anyway is judged as under 1)."""
        return max(1, self.max_restarts)

    @property
    def reruns(self) -> bool:
        """Whether the driver may start a fresh Ray Train run after a failed one (0: the first failure is final)."""
        return self.max_restarts > 0

    @property
    def ray_train_max_failures(self) -> int:
        """What the driver hands Ray Train as ``FailureConfig.max_failures``: the same number."""
        return self.max_restarts

    def after_restart(self, stalled: int, before: int | None, now: int) -> int:
        """Restarts in a row without progress once a restart resumed from ``now`` (the previous one from
        ``before``), ``stalled`` before it: back to 0 on progress, else one more."""
        return 0 if progressed(before, now) else stalled + 1

    def exhausted(self, stalled: int) -> bool:
        """Whether ``stalled`` restarts in a row without progress use the budget up: the job fails."""
        return stalled >= self.limit
