"""Straggler detectors: a rank persistently slower than its peers and than its own past (compute-slow
in C4's sense). Pure reads through :mod:`controller.recovery.reads`; they return at most one
:class:`~controller.recovery.detectors.Finding` per pass.

Two scores over the same window of the job's newest ``straggler_m`` scored steps:

* on compute (forward+backward): :func:`detect` first;
* on collective wait (``basis: collective-wait``): a rank its peers wait for in the step's
  collectives, late for something other than forward+backward (:func:`late_rank`), tried when the
  compute score names nobody.

Communication-slow ranks (a sick NIC) are the NIC detector's (:mod:`controller.recovery.nic`).
Thresholds: the job's ``recovery.thresholds`` (``straggler_*``, ``checkpoint_settle_s``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

from sqlalchemy.orm import Session

from controller.models import Job
from controller.recovery import reads
from controller.recovery.detectors import Finding
from controller.step_stats import waits_in_call
from vigil.contract.schemas import IncidentKind, RecoveryThresholds

OWN_HISTORY_STEPS = 200
"""How far back a rank's own past reaches for the individual score (steps before the scored window)."""
OWN_BASELINE_QUANTILE = 0.25
"""The rank's own pace: this quantile of its past, not the median. With the median, a rank slow for half
its past (about 25 steps of a 50-step past) stopped being a straggler; telemetry that arrives in bursts
(a rank's recorder read every few seconds) could skip that whole chance, and a 4x slow rank was never named
(seen in CI). The lower quartile keeps its pace before the slowdown until three quarters of its past are
slow: a rank always behind its peers (a busier host) is still an imbalance, not a new straggler."""


HOST_SHARE = 0.5
"""A rank whose median run-queue wait (``cpu_wait_s``) over its peers' is at least this share of its excess is
slowed by its host's other load (a co-tenant on its CPU), not slow itself: the straggler and fail-slow scores
do not name it."""


def host_explains(waits: dict[int, dict[int, float]], steps: list[int], rank: int, excess: float) -> tuple[bool, float | None]:
    """(whether the rank's run-queue wait over its peers' explains ``excess``, that wait excess; None: not reported),
    over ``steps`` (``waits``: step -> rank -> ``cpu_wait_s``)."""
    own = [waits[st][rank] for st in steps if rank in waits.get(st, {})]
    peers = [w for st in steps for r, w in waits.get(st, {}).items() if r != rank]
    if not own or not peers:
        return False, None
    host = statistics.median(own) - statistics.median(peers)
    return host >= HOST_SHARE * excess, host


def own_baseline(history: list[float] | tuple[float, ...]) -> float:
    """The rank's own pace: :data:`OWN_BASELINE_QUANTILE` of its past times (at least 1e-9)."""
    ordered = sorted(history)
    return max(ordered[int(OWN_BASELINE_QUANTILE * (len(ordered) - 1))], 1e-9)


def detect(s: Session, job: Job, th: RecoveryThresholds, checkpoint_interval: int,
           since: float | None = None) -> list[Finding]:
    """A compute-slow straggler, else a late rank (see the module docstring). ``since``: steps that ended
    before it are not scored (live recovery: a replaced rank's old process shares the run attempt)."""
    rows = reads.recent_compute(s, job.id, th.straggler_m * 3 * 64)
    if since is not None:
        rows = [r for r in rows if r.ts > since]
    by_step: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    step_ts: dict[int, float] = {}
    waits: dict[int, dict[int, float]] = defaultdict(dict)
    for r in rows:  # newest first: after a restart, a replayed step keeps the new incarnation's row
        by_step[r.step].setdefault(r.rank, (r.fwd_bwd_s or 0.0, r.step_time_s or 0.0))
        step_ts.setdefault(r.step, r.ts)
        if r.cpu_wait_s is not None:
            waits[r.step].setdefault(r.rank, r.cpu_wait_s)
    busy = checkpoint_busy(s, job.id, checkpoint_interval, th.checkpoint_settle_s)
    steps = sorted((st for st, ranks in by_step.items() if len(ranks) >= 2 and not busy(st, step_ts[st])),
                   reverse=True)[: th.straggler_m]
    if len(steps) < th.straggler_m:
        return []
    # Persistence: slower than its peers in k of the window's m steps. A per-step bar lower than
    # the verdict's: on a shared host one step's compute swings by tens of percent either way, so
    # a rank really 2x slower still shows some steps under 1.5x its peers.
    hits: dict[int, list[float]] = defaultdict(list)
    for st in steps:
        ranks = by_step[st]
        for rank, (compute, _) in ranks.items():
            peers = [c for r, (c, _) in ranks.items() if r != rank]
            base = statistics.median(peers)
            if base > 0 and compute > th.straggler_step_ratio * base:
                hits[rank].append(compute / base)
    for rank, ratios in hits.items():
        if len(ratios) < th.straggler_k:
            continue
        # Relative to peers over the window: medians, robust to the odd slow or fast step.
        window = [by_step[st][rank][0] for st in steps if rank in by_step[st]]
        peer_window = statistics.median(c for st in steps for r, (c, _) in by_step[st].items() if r != rank)
        to_peers = statistics.median(window) / max(peer_window, 1e-9)
        if to_peers < th.straggler_ratio:
            continue
        # Individual score: slower than this rank's own past pace too (own_baseline). A rank that was
        # always a little behind its peers (a busier host, say) is an imbalance, not a new straggler.
        history = reads.compute_history(s, job.id, rank, steps[-1], OWN_HISTORY_STEPS)
        if len(history) < th.straggler_m:
            continue
        own = statistics.median(window) / own_baseline(list(history))
        if own < th.straggler_own_ratio:
            continue
        # And slower by a margin that matters: on a busy host a few-millisecond compute phase
        # doubles from scheduling noise alone. The excess must be a real share of the step.
        step_median = statistics.median(t for st in steps for _, t in by_step[st].values())
        excess = statistics.median(window) - peer_window
        if excess < max(th.straggler_min_excess_s, th.straggler_min_share * step_median):
            continue
        if host_explains(waits, steps, rank, excess)[0]:  # a co-tenant on its CPU, not the rank
            continue
        loc = reads.rank_locations(s, job.id).get(rank)
        return [Finding(IncidentKind.STRAGGLER, job.id, loc.node_id if loc else None, rank, {
            "class": "compute-slow", "slow_steps": len(ratios), "window": th.straggler_m,
            "median_ratio_to_peers": round(to_peers, 3), "threshold": th.straggler_ratio,
            "step_threshold": th.straggler_step_ratio, "own_threshold": th.straggler_own_ratio,
            "ratio_to_own_history": round(own, 3), "excess_s": round(excess, 4),
            "steps": [steps[-1], steps[0]]}, step=job.last_step)]
    return late_rank(s, job, th, steps)


def late_rank(s: Session, job: Job, th: RecoveryThresholds, steps: list[int]) -> list[Finding]:
    """Straggler score on collective wait: a rank whose peers wait for it in the step's collectives.

    The compute score sees a slow forward+backward; a rank can be late for the rest of its step too
    (a data loader starved of I/O, a slow optimizer step, a host stalling the process). Then it
    arrives last at every collective: its peers' wait (their duration of a call minus the fastest
    rank's) grows by its lateness while its own stays near 0 (C4's "non-communication slow"). Per
    step, lateness = median of the peers' wait - the rank's own wait, over its peers' work outside
    collectives (step time - comm). The verdict mirrors the compute score's: late by
    ``straggler_step_ratio`` in ``straggler_k`` of the window's steps (``steps``, newest first), by
    ``straggler_ratio`` in the window's median, its own work ``straggler_own_ratio`` x its recent
    past, and by at least ``straggler_min_excess_s`` and ``straggler_min_share`` of the step.
    """
    # Bounded like the compute score's read (up to 64 ranks, here with up to 32 calls per step): a
    # job beyond that is not scored on wait in this pass rather than read whole every 0.5 s.
    cap = th.straggler_m * 64 * 32
    calls = reads.collective_calls(s, job.id, steps, cap + 1)
    if len(calls) > cap:
        return []
    work: dict[int, dict[int, float]] = defaultdict(dict)
    step_time: dict[int, dict[int, float]] = defaultdict(dict)
    for r in reads.work_rows(s, job.id, steps):  # newest first: a replayed step keeps the new incarnation's row
        if r.rank not in work[r.step]:
            work[r.step][r.rank] = max(0.0, r.step_time_s - (r.comm_s or 0.0))
            step_time[r.step][r.rank] = r.step_time_s
    durations: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for c in calls:
        durations[(c.step, c.seq)][c.rank] = c.duration_s  # a replay's call overwrites its first run
    wait: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (st, _), per_rank in durations.items():
        if len(per_rank) < 2:
            continue
        for rank, w in waits_in_call(per_rank).items():
            wait[st][rank] += w
    late: dict[int, list[tuple[float, float]]] = defaultdict(list)  # rank -> [(lateness s, ratio)]
    for st in steps:
        ranks = wait.get(st, {})
        if len(ranks) < 2 or len(work.get(st, {})) < 2:
            continue
        for rank, own in ranks.items():
            peers = [w for r, w in ranks.items() if r != rank]
            peer_work = statistics.median(w for r, w in work[st].items() if r != rank)
            lateness = statistics.median(peers) - own
            late[rank].append((lateness, 1.0 + lateness / max(peer_work, 1e-9)))
    if not step_time:
        return []
    step_median = statistics.median(t for per in step_time.values() for t in per.values())
    for rank, values in late.items():
        hits = sum(ratio >= th.straggler_step_ratio for _, ratio in values)
        if len(values) < th.straggler_m or hits < th.straggler_k:
            continue
        to_peers = statistics.median(ratio for _, ratio in values)
        lateness = statistics.median(x for x, _ in values)
        if to_peers < th.straggler_ratio or lateness < max(th.straggler_min_excess_s,
                                                           th.straggler_min_share * step_median):
            continue
        window = [work[st][rank] for st in steps if rank in work.get(st, {})]
        history = reads.work_history(s, job.id, rank, steps[-1], OWN_HISTORY_STEPS)
        if len(history) < th.straggler_m:
            continue
        own = statistics.median(window) / own_baseline(history)
        if own < th.straggler_own_ratio:
            continue
        loc = reads.rank_locations(s, job.id).get(rank)
        return [Finding(IncidentKind.STRAGGLER, job.id, loc.node_id if loc else None, rank, {
            "class": "compute-slow", "basis": "collective-wait",
            "late_steps": hits, "window": th.straggler_m,
            "median_ratio_to_peers": round(to_peers, 3), "threshold": th.straggler_ratio,
            "peers_wait_s": round(lateness, 4), "ratio_to_own_history": round(own, 3),
            "steps": [steps[-1], steps[0]]}, step=job.last_step)]
    return []


def checkpoint_busy(s: Session, job_id: str, interval: int, settle_s: float) -> Callable[[int, float], bool]:
    """Whether a step (number, time) falls in a checkpoint's shadow, where it is not scored.

    The rank that writes a checkpoint (rank 0 computes the manifest's checksums, an async save runs
    beside the next steps) is busy on purpose and must not look like a straggler. A step is in the
    shadow when it is within a third of the interval after a checkpoint step, unless that checkpoint
    is known complete (its sample's time) more than ``settle_s`` before the step ran. The steps before the
    first checkpoint step are never in a shadow (before this rule, a third of them went unscored).
    """
    if interval <= 1:
        return lambda st, ts: False
    done = reads.checkpoint_times(s, job_id)

    def busy(st: int, ts: float) -> bool:
        if st % interval > interval // 3 or st < interval:  # no checkpoint is taken at step 0
            return False
        finished = done.get(st - st % interval)
        return finished is None or ts <= finished + settle_s

    return busy
