"""Fail-slow: a rank that became persistently 1.1x-1.5x slower than its peers (Greyhound's fail-slows average
1.34x), found without per-job tuning, and whether evicting it is worth what eviction costs.

The straggler score of :mod:`controller.recovery.stragglers` needs 1.7x over 10 steps; a 1.15x rank hides in
a shared host's per-step noise there. This score trades time for sensitivity: over the newest 30, 40, ...,
200 scored steps (the longer, the lower the bar), per step a rank's **ratio to its peers** (its work
divided by the median of the other ranks' work in that step). Every length is tried, so that one window
starts within 10 steps of when the rank turned slow: its "before" is then the rank's old pace, not a mix.
Work is first forward+backward (compute-slow); where that names nobody, the step time outside the rank's
collectives (``basis: "step"``: a rank late to its collectives for something other than compute, e.g. a slow
communication path, is slow there while its peers' extra time is inside the collectives, waiting for it).
A rank is fail-slow when, in one of the windows:

* the median of its ratios reaches the window's bar (1.25 under 60 steps, 1.15 under 120, then
  ``fail_slow_ratio`` = 1.1);
* it was slower than its peers in more steps than chance allows: a sign test, ``k >= n/2 + 1.5 sqrt(n)``
  (three standard deviations of a fair coin; 0.77 of 30 steps, 0.61 of 200);
* it is slower by at least :data:`MIN_EXCESS_S` (3 ms) per step;
* and the ratio *changed*: it is at least ``fail_slow_change`` (1.08) times the rank's own ratio before
  the window (the median over its steps before, in the same run attempt; at least :data:`MIN_BEFORE`),
  and above that past ratio in more steps than chance allows (the same sign test).

Why this is not fooled by other load: everything is relative to the peers in the same step, so a
co-tenant that slows the whole machine (or every rank alike) moves numerator and denominator together,
and the sign test holds a noisy but fair host to chance; a rank always a little behind (a busier node
from the start) is an imbalance, caught by the change test, not a new fault. Load that slows *one* rank
(a co-tenant sharing its CPU) shows in the rank's run-queue wait (``cpu_wait_s``: runnable, waiting for a
CPU, as the kernel counts it): a rank whose excess over its peers is at least
:data:`~controller.recovery.stragglers.HOST_SHARE` run-queue wait over theirs is slowed by its host's other
load, not slow itself, and is not named. A node whose host
is saturated while its peers' are not (the agents' ``cpu_percent``) is named as contention in the evidence.

**Worth evicting?** Evicting costs a restart: the job's own measured restarts (acted -> recovered of its
earlier incidents, median) or ``fail_slow_restart_s``, plus the steps since the newest checkpoint done
again. The slow rank costs its share of the steps' seconds lost (:mod:`controller.seconds_lost`) per
step, over the steps left. The finding carries the arithmetic (``eviction``); the policy evicts only when
the projected loss exceeds the cost, and otherwise keeps the job running with the incident open.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.host_history import extract
from controller.models import Incident, Job, Node, RankStepStat, StepMetric
from controller.recovery import reads
from controller.recovery.detectors import Finding
from controller.recovery.stragglers import host_explains
from vigil.contract.schemas import IncidentKind, RecoveryThresholds

WINDOWS: tuple[tuple[int, float], ...] = tuple((n, 1.25 if n < 60 else 1.15 if n < 120 else 0.0)
                                               for n in range(30, 201, 10))
"""(scored steps, the bar of the median ratio to peers; 0: the job's ``fail_slow_ratio``)."""
MIN_BEFORE = 60
"""Scored steps a rank needs before the window for the change test."""
EVERY_STEPS = 5
"""The score runs once per this many new steps of a job (it reads up to 400 steps of every rank)."""
MIN_EXCESS_S = 0.003
"""A rank slower by less than this per step (median work over its peers') is not named: under 0.3 s per 100
steps, not worth an incident (a tiny model's 1 ms compute phase doubles from scheduling alone)."""
CONTENTION_CPU = 90.0
"""A host at or above this CPU percent, while its peers' median is 20 points lower, is contended."""

_last_scored: dict[str, int] = {}


def detect(s: Session, job: Job, th: RecoveryThresholds, busy: Any, steps_total: int) -> list[Finding]:
    """A fail-slow rank of ``job`` (module docstring), or nothing. ``busy(step, ts)``: the checkpoint shadow
    (:func:`controller.recovery.stragglers.checkpoint_busy`)."""
    last = job.last_step or 0
    if last - _last_scored.get(job.id, -EVERY_STEPS) < EVERY_STEPS:
        return []
    if len(_last_scored) > 10_000:  # ended jobs' entries: bounded, not kept for ever
        _last_scored.clear()
    _last_scored[job.id] = last
    rows = _rows(s, job.id, last)
    waits = _cpu_waits(rows)
    for basis in BASES:
        work = _work(rows, basis)
        steps = sorted((st for st, per in work.items() if len(per) >= 2 and not busy(st, max(t for _, t in per.values()))),
                       reverse=True)
        ratios = _step_ratios(work, steps)
        for window, bar in WINDOWS:
            if len(steps) < window + MIN_BEFORE:
                break
            found = _score(work, ratios, steps[:window], steps[window:window + 200], bar or th.fail_slow_ratio,
                           th.fail_slow_change, waits)
            if found is not None:
                rank, evidence = found
                locations = reads.rank_locations(s, job.id)
                loc = locations.get(rank)
                node = loc.node_id if loc else None
                evidence.update(basis=basis, phase=_phase(rows, steps[:window], rank), window=window,
                                steps=[steps[window - 1], steps[0]], contention=_contention(s, node, locations),
                                eviction=eviction_arithmetic(s, job, rank, steps_total, th))
                return [Finding(IncidentKind.STRAGGLER, job.id, node, rank, evidence, step=job.last_step)]
    return []


BASES = ("compute", "step")
"""What a rank's work is, in the order tried (module docstring)."""


def _rows(s: Session, job_id: str, last: int) -> list[Any]:
    """The newest 400 steps' samples of the current attempt."""
    return s.execute(select(StepMetric.rank, StepMetric.step, StepMetric.fwd_bwd_s, StepMetric.step_time_s,
                            StepMetric.comm_s, StepMetric.data_s, StepMetric.cpu_wait_s, StepMetric.ts)
                     .where(StepMetric.job_id == job_id, StepMetric.step > last - 400, StepMetric.step <= last,
                            StepMetric.attempt == reads.current_attempt(s, job_id))).all()


def _outside(r: Any) -> float:
    """The step time outside the rank's collectives."""
    return max(0.0, r.step_time_s - (r.comm_s or 0.0))


def _work(rows: list[Any], basis: str) -> dict[int, dict[int, tuple[float, float]]]:
    """step -> rank -> (work, ts): forward+backward (``compute``; the step outside collectives where it is not
    marked) or the step outside collectives (``step``)."""
    out: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    for r in rows:
        w = r.fwd_bwd_s if basis == "compute" and r.fwd_bwd_s is not None else _outside(r)
        out[r.step][r.rank] = (w, r.ts)
    return out


def _phase(rows: list[Any], window: list[int], rank: int) -> str:
    """Where the rank's excess over its peers sits in the window: ``data``, ``forward_backward`` or ``other``
    (the rest of the step outside its collectives: the optimizer, a late start of its collectives)."""
    steps = set(window)
    parts: dict[str, tuple[list[float], list[float]]] = {p: ([], []) for p in ("data", "forward_backward", "other")}
    for r in rows:
        if r.step not in steps:
            continue
        data, fb = r.data_s or 0.0, r.fwd_bwd_s or 0.0
        for p, v in (("data", data), ("forward_backward", fb), ("other", _outside(r) - data - fb)):
            parts[p][0 if r.rank == rank else 1].append(v)
    excess = {p: statistics.median(own) - statistics.median(peers) for p, (own, peers) in parts.items() if own and peers}
    return max(excess, key=lambda p: excess[p]) if excess else "forward_backward"


def _step_ratios(work: dict[int, dict[int, tuple[float, float]]], steps: list[int]) -> dict[int, dict[int, float]]:
    """step -> rank -> the rank's work over the median of its peers' in that step."""
    out: dict[int, dict[int, float]] = {}
    for st in steps:
        per = work[st]
        out[st] = {}
        for rank, (w, _) in per.items():
            peers = statistics.median(x for r, (x, _) in per.items() if r != rank)
            if peers > 0:
                out[st][rank] = w / peers
    return out


def _ratios(ratios: dict[int, dict[int, float]], steps: list[int]) -> dict[int, list[float]]:
    """rank -> its ratios over ``steps`` (:func:`_step_ratios`)."""
    out: dict[int, list[float]] = defaultdict(list)
    for st in steps:
        for rank, x in ratios[st].items():
            out[rank].append(x)
    return out


def _excess(work: dict[int, dict[int, tuple[float, float]]], steps: list[int], rank: int) -> float:
    """The rank's median work over the steps minus its peers' median work (seconds per step)."""
    own = [work[st][rank][0] for st in steps if rank in work[st]]
    peers = [w for st in steps for r, (w, _) in work[st].items() if r != rank]
    return statistics.median(own) - statistics.median(peers) if own and peers else 0.0


def _cpu_waits(rows: list[Any]) -> dict[int, dict[int, float]]:
    """step -> rank -> run-queue wait, where the rank reported one."""
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r.cpu_wait_s is not None:
            out[r.step][r.rank] = r.cpu_wait_s
    return out


def _score(work: dict[int, dict[int, tuple[float, float]]], per_step: dict[int, dict[int, float]], window: list[int],
           before: list[int], bar: float, change_bar: float,
           waits: dict[int, dict[int, float]] | None = None) -> tuple[int, dict[str, Any]] | None:
    """The slowest rank that passes the window's three tests and is not slowed by its host (``waits``: the
    run-queue waits, :func:`_cpu_waits`), with its evidence."""
    now, past = _ratios(per_step, window), _ratios(per_step, before)
    best: tuple[float, int, dict[str, Any]] | None = None
    for rank, ratios in now.items():
        n = len(ratios)
        slower = sum(x > 1.0 for x in ratios)
        to_peers = statistics.median(ratios)
        if n < len(window) // 2 or to_peers < bar or slower < n / 2 + 1.5 * math.sqrt(n):
            continue
        if len(past.get(rank, ())) < MIN_BEFORE:
            continue
        baseline = statistics.median(past[rank])
        change = to_peers / max(baseline, 1e-9)
        above_own = sum(x > baseline for x in ratios)  # the same sign test against its own past ratio
        if change < change_bar or above_own < n / 2 + 1.5 * math.sqrt(n):
            continue
        excess = _excess(work, window, rank)
        if excess < MIN_EXCESS_S:
            continue
        by_host, host = host_explains(waits or {}, window, rank, excess)
        if by_host:
            continue
        evidence = {"class": "fail-slow", "median_ratio_to_peers": round(to_peers, 3), "threshold": bar,
                    "slower_steps": slower, "scored_steps": n, "sign_test_min": math.ceil(n / 2 + 1.5 * math.sqrt(n)),
                    "ratio_before": round(baseline, 3), "above_own_steps": above_own, "change": round(change, 3), "change_threshold": change_bar,
                    "excess_s": round(excess, 5), "cpu_wait_excess_s": None if host is None else round(host, 5)}
        if best is None or to_peers > best[0]:
            best = (to_peers, rank, evidence)
    return (best[1], best[2]) if best is not None else None


def _contention(s: Session, node: str | None, locations: dict[int, Any]) -> dict[str, Any] | None:
    """The hosts' CPU use (the agents' newest heartbeats) of the rank's node and its peers' nodes."""
    nodes = {loc.node_id for loc in locations.values()}
    cpu: dict[str, float] = {}
    for n in s.scalars(select(Node).where(Node.id.in_(nodes))).all():
        value = extract(n.host)["cpu_percent"] if isinstance(n.host, dict) else None
        if value is not None:
            cpu[n.id] = value
    if node not in cpu:
        return None
    peers = [v for k, v in cpu.items() if k != node]
    peer_median = statistics.median(peers) if peers else None
    contended = cpu[node] >= CONTENTION_CPU and (peer_median is None or cpu[node] - peer_median >= 20.0)
    return {"node_cpu_percent": cpu[node], "peers_cpu_percent": peer_median, "node_contended": contended}


def eviction_arithmetic(s: Session, job: Job, rank: int, steps_total: int, th: RecoveryThresholds) -> dict[str, Any]:
    """Whether evicting ``rank``'s node is worth it (module docstring), with every number it used."""
    recent = s.execute(select(RankStepStat.lost_s).where(
        RankStepStat.job_id == job.id, RankStepStat.rank == rank, RankStepStat.lost_s.is_not(None))
        .order_by(RankStepStat.step.desc()).limit(60)).scalars().all()
    per_step = statistics.mean(recent) if recent else 0.0
    lost_so_far = float(s.scalar(select(func.sum(RankStepStat.lost_s)).where(
        RankStepStat.job_id == job.id, RankStepStat.rank == rank)) or 0.0)
    last = job.last_step or 0
    steps_left = max(0, steps_total - last)
    durations = sorted(r.recovered_at.timestamp() - r.acted_at.timestamp() for r in s.execute(
        select(Incident.acted_at, Incident.recovered_at).where(
            Incident.job_id == job.id, Incident.acted_at.is_not(None), Incident.recovered_at.is_not(None))).all())
    restart_s = statistics.median(durations) if durations else th.fail_slow_restart_s
    newest_ckpt = max((st for st in reads.checkpoint_times(s, job.id) if st <= last), default=0)
    step_s = s.scalar(select(func.avg(RankStepStat.step_time_s)).where(
        RankStepStat.job_id == job.id, RankStepStat.step > last - 20)) or 0.0
    rerun_s = (last - newest_ckpt) * float(step_s)
    projected = per_step * steps_left
    cost = restart_s + rerun_s
    return {"lost_so_far_s": round(lost_so_far, 3), "lost_per_step_s": round(per_step, 5), "steps_left": steps_left,
            "projected_lost_s": round(projected, 3), "restart_s": round(restart_s, 3),
            "restart_measured": bool(durations), "rerun_s": round(rerun_s, 3), "cost_s": round(cost, 3),
            "worth": projected > cost}


__all__ = ["WINDOWS", "detect", "eviction_arithmetic"]
