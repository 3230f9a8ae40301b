"""A job's detector thresholds (``recovery.thresholds``): each with its default and its documented range."""

from __future__ import annotations

from pydantic import Field, model_validator

from vigil.contract.schemas.common import _Strict


class RecoveryThresholds(_Strict):
    """The detectors' thresholds for this job (docs/RECOVERY.md, "Detection"). Every field has a default.

    Monitor-wide values that judge nodes rather than jobs (the heartbeat timeout) are controller
    settings, not here.
    """

    death_grace_s: float = Field(
        1.5, ge=0.0, le=60.0,
        description="rank_died: after a rank is seen dead, wait this long for every agent's report before naming "
        "the rank that died first.")
    hang_k: float = Field(
        10.0, gt=0.0, le=1000.0, description="hang: no new step for max(hang_k x median step time, hang_floor_s).")
    hang_floor_s: float = Field(
        15.0, gt=0.0, le=86_400.0, description="hang: the shortest silence that counts as a hang, in seconds.")
    collective_hang_k: float = Field(
        4.0, ge=1.0, le=1000.0,
        description="hang from the collective: a rank waiting inside a collective longer than this many times the "
        "longest collective of that group in the job's history (and than collective_hang_floor_s), while a rank "
        "of the group never entered it, is a hang without waiting for hang_floor_s.")
    collective_hang_floor_s: float = Field(
        5.0, ge=0.5, le=86_400.0,
        description="hang from the collective: the shortest wait inside a collective that counts (raise it for code "
        "whose single ranks work alone for longer between collectives, e.g. a rank-0-only save).")
    stack_wait_s: float = Field(
        10.0, ge=0.0, le=600.0,
        description="hang: how long to wait for every rank's py-spy stack before deciding without the missing ones.")
    straggler_ratio: float = Field(
        1.7, ge=1.0, le=100.0,
        description="straggler: over the last straggler_m scored steps, a rank's median compute (or lateness) is "
        "at least this many times its peers' median ...")
    straggler_own_ratio: float = Field(
        1.4, ge=1.0, le=100.0, description="straggler: ... and this many times its own recent median ...")
    straggler_step_ratio: float = Field(
        1.2, ge=1.0, le=100.0,
        description="straggler: ... and slower than its peers by this factor in at least straggler_k of those steps "
        "(persistence) ...")
    straggler_k: int = Field(6, ge=1, le=100, description="straggler: steps of the window that must be slow (k of m).")
    straggler_m: int = Field(
        10, ge=1, le=100, description="straggler: the window of scored steps (also bounds how much is read per pass).")
    straggler_min_excess_s: float = Field(
        0.025, ge=0.0, le=60.0, description="straggler: ... and its excess over its peers is at least this many seconds ...")
    straggler_min_share: float = Field(
        0.25, ge=0.0, le=1.0, description="straggler: ... and at least this share of the median step time.")
    checkpoint_settle_s: float = Field(
        0.25, ge=0.0, le=3600.0,
        description="straggler: steps in a checkpoint's shadow are scored again this long after it completed.")
    fail_slow_ratio: float = Field(
        1.1, ge=1.01, le=10.0,
        description="fail-slow: over 120 or 200 scored steps, a rank's median ratio of work to its peers' is at least "
        "this (shorter windows: 1.25 over 30 steps, 1.15 over 60), slower in more steps than a sign test allows by "
        "chance ...")
    fail_slow_change: float = Field(
        1.08, ge=1.0, le=10.0,
        description="fail-slow: ... and that ratio is this many times the rank's own ratio before the window.")
    fail_slow_restart_s: float = Field(
        60.0, ge=0.0, le=86_400.0,
        description="fail-slow: what a restart costs, in seconds, until the job has measured one of its own; a "
        "fail-slow node is evicted only when the rank's projected seconds lost exceed the restart and the steps "
        "done again.")
    spike_ratio: float = Field(
        3.0, gt=1.0, le=1000.0, description="loss_spike: a loss above this many times the recent median.")
    drain_deadline_s: float = Field(
        5.0, gt=0.0, le=3600.0, description="eviction: the ranks on a drained node get this long to checkpoint.")
    restart_gap_s: float = Field(
        5.0, gt=0.0, le=3600.0,
        description="a pause this long in the job's steps after a recovery action counts as its restart.")

    @model_validator(mode="after")
    def _k_le_m(self) -> RecoveryThresholds:
        if self.straggler_k > self.straggler_m:
            raise ValueError(f"straggler_k ({self.straggler_k}) must be <= straggler_m ({self.straggler_m})")
        return self


# ``policy`` picks one policy class in the controller (controller/recovery/policy.py). ``max_restarts`` and
# the "progress" it counts have one definition, vigil/contract/restarts.py: restarts in a row whose resume
# point (the newest valid checkpoint; under ``live``, a replaced replica's peers' newest step) did not move;
# the controller applies it and the driver hands the same number to Ray Train. (A comment, not the
# docstring: the docstring is the OpenAPI description.)
