"""The statistics the aggregator and the views share, over one step's samples: nearest-rank
percentiles, finite means, a step's job-wide figures, when a step ran (its attempts), and how the
time inside a collective splits into transfer and wait. Pure functions: no database.

**Wait inside collectives.** A collective call is identified by (job, step, seq): every rank's
``seq``-th call of the step. A collective cannot finish on any rank before the last rank has
joined, so the fastest rank's duration is the best available estimate of the transfer itself
(it arrived last and waited for nobody); every other rank's excess over that minimum is time it
spent waiting for the others: ``wait(rank, call) = duration(rank, call) - min over ranks of
duration(call)``. A rank's step wait is the sum over its calls, and a kind's ``transfer_s`` the
sum over its calls of the minimum. The estimate is conservative: the fastest rank may also have
waited a little (skewed clocks inside the collective library), which is then counted as transfer.

**Attempts.** A step's raw step samples also say when it ran (``[ts - step_time_s, ts]`` per rank):
the ranks' latest samples that overlap the newest one in time are the kept attempt (its earliest
start is ``start_ts``); every other sample (one a rank replaced, or a rank's latest one from an
earlier run, e.g. of a rank evicted since) ran in an earlier attempt, whose time ranges are kept,
merged, in ``reruns`` (``[[start, end], ...]``, None when the step ran once). The goodput view
(:mod:`controller.views`) counts that time as lost.

**Seconds lost to slow ranks** (:func:`seconds_lost`). A rank's *own* time in a step is its step
time minus its wait inside the step's collectives: data, compute, optimizer and its share of the
transfers, without the time it spent waiting for the others. A synchronous step lasts as long as its
slowest rank's own time. The step's seconds lost are how much sooner it would have ended had every rank
run at its peers' pace: each rank's *offset* (how much slower than the step's median rank it has run
lately: the median of its :func:`rel_to_median` over the newest :data:`OFFSET_STEPS` steps, never below 0) taken
off its own time, its step-to-step jitter kept. A rank that is usually as fast as its peers costs
nothing, even in a step where jitter made it the slowest (a healthy job loses ~0); a rank persistently
``d`` slower costs about ``d`` per step, less where its peers' jitter would have made the step that long
anyway (what the same job measures without the slow rank). Without history (one step alone), each rank's
offset is its excess over the median this step: the step's slowest own time minus the median own time.
The loss is shared among the ranks above the counterfactual step's end as in the airport game's Shapley
value: each stretch between two consecutive own times is split equally among the ranks that reach it,
so one slow rank carries all of it and two equally slow ranks half each; the shares sum to the step's
loss. docs/RECOVERY.md ("Seconds lost to slow ranks") gives the model's limits.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any


def nearest_rank(ordered: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile of sorted values by the nearest-rank definition: the ``ceil(pct/100 n)``-th
    smallest (integer arithmetic, so that 0.9 x 100 does not round up to the 91st); an observed value."""
    return ordered[-(-pct * len(ordered) // 100) - 1]


def p50(values: Sequence[float]) -> float:
    """Nearest-rank median (the lower middle value for an even count): always an observed value."""
    return nearest_rank(sorted(values), 50)


def p90(values: Sequence[float]) -> float:
    """Nearest-rank 90th percentile."""
    return nearest_rank(sorted(values), 90)


def finite_mean(values: Iterable[float | None]) -> float | None:
    """Mean of the finite values (None: there are none)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def step_figures(times: Mapping[int, float], losses: Iterable[float | None], val_losses: Iterable[float | None],
                 tokens_per_s: Iterable[float | None]) -> dict[str, Any]:
    """The job-wide figures of one step from its ranks' latest samples (``times``: rank -> step time):
    :func:`p50`, :func:`p90`, max and its rank (the lowest on ties), means over finite losses.

    The one definition the aggregator and the views (forming steps) share."""
    out: dict[str, Any] = {
        "loss_mean": finite_mean(losses),
        "val_loss_mean": finite_mean(val_losses),
        "tokens_per_s": sum(t for t in tokens_per_s if t is not None) if times else None,
        "step_time_p50_s": None, "step_time_p90_s": None, "step_time_max_s": None, "slowest_rank": None,
        "reporting": len(times),
    }
    if times:
        ordered = sorted(times.values())
        top = ordered[-1]
        out.update(step_time_p50_s=nearest_rank(ordered, 50), step_time_p90_s=nearest_rank(ordered, 90),
                   step_time_max_s=top, slowest_rank=min(r for r, t in times.items() if t == top))
    return out


OFFSET_STEPS = 21
"""Steps (this one and the 20 before) whose median :func:`rel_to_median` is a rank's offset: about ten steps
after a rank turns slow its offset is its new pace; the median of 21 steps' jitter is ~0.27 of one step's."""


def rel_to_median(own: Mapping[int, float]) -> dict[int, float]:
    """Each rank's own time minus the step's nearest-rank median own time (with two ranks, the faster one's:
    the slower rank's excess, 0 for the faster)."""
    if not own:
        return {}
    median = nearest_rank(sorted(own.values()), 50)
    return {r: t - median for r, t in own.items()}


def seconds_lost(own: Mapping[int, float], offsets: Mapping[int, float] | None = None) -> tuple[float, dict[int, float]]:
    """The step's seconds lost to its slow ranks and each rank's share (see the module docstring), from
    each rank's own time in the step and, per rank, its recent offset over its peers (a rank absent:
    0; ``offsets`` None: each rank's excess over this step's median). Fewer than two ranks: nothing lost."""
    shares = dict.fromkeys(own, 0.0)
    if len(own) < 2:
        return 0.0, shares
    if offsets is None:
        reference = nearest_rank(sorted(own.values()), 50)
    else:
        reference = max(t - max(0.0, offsets.get(r, 0.0)) for r, t in own.items())
    above = sorted(((t, r) for r, t in own.items() if t > reference), reverse=True)  # slowest first
    if not above:
        return 0.0, shares
    levels = [t for t, _ in above] + [reference]
    for i in range(len(above)):  # the stretch from levels[i + 1] to levels[i]: the i + 1 slowest reach it
        part = (levels[i] - levels[i + 1]) / (i + 1)
        for _, r in above[: i + 1]:
            shares[r] += part
    return levels[0] - reference, shares


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[list[float]]:
    """Overlapping ``(start, end)`` ranges merged, in time order."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def attempt_spans(samples: Iterable[tuple[int, float, float]]) -> tuple[float | None, list[list[float]] | None]:
    """When one step ran, from its ``(rank, ts, step_time_s)`` step samples in arrival order.

    Returns the kept attempt's start (the earliest start among the ranks' latest samples that overlap,
    transitively, the newest one) and the merged time ranges of the earlier attempts (None: none).
    The ranks of one attempt run the step together (its collectives join them), so their ranges
    overlap; a restart separates attempts by at least the time it takes.
    """
    latest: dict[int, tuple[float, float]] = {}
    earlier: list[tuple[float, float]] = []
    for rank, ts, st in samples:
        if rank in latest:
            earlier.append(latest[rank])
        latest[rank] = (ts - (st or 0.0), ts)
    if not latest:
        return None, None
    # The kept attempt: walking back from the newest end, every range that reaches the attempt so far.
    spans = sorted(latest.values(), key=lambda s: s[1], reverse=True)
    start = spans[0][0]
    for s, e in spans[1:]:
        if e >= start:
            start = min(start, s)
        else:
            earlier.append((s, e))
    return start, (merge_spans(earlier) or None)


def fastest_of_calls(durations: Iterable[tuple[Hashable, float]]) -> dict[Hashable, float]:
    """The fastest duration of each call, from ``(call, duration)`` pairs of every rank.

    How Vigil splits the time inside a collective, here and in the straggler detector: the fastest
    rank's duration is the transfer (it waited for nobody); every other rank's duration minus it is
    that rank's *wait* for the last one to arrive (:func:`waits_in_call`).
    """
    fastest: dict[Hashable, float] = {}
    for call, d in durations:
        if call not in fastest or d < fastest[call]:
            fastest[call] = d
    return fastest


def waits_in_call(per_rank: Mapping[int, float]) -> dict[int, float]:
    """Each rank's wait inside one call: its duration minus the call's fastest (:func:`fastest_of_calls`)."""
    fastest = min(per_rank.values())
    return {rank: d - fastest for rank, d in per_rank.items()}


__all__ = [
    "OFFSET_STEPS", "attempt_spans", "fastest_of_calls", "finite_mean", "merge_spans", "nearest_rank", "p50", "p90",
    "rel_to_median", "seconds_lost",
    "step_figures", "waits_in_call",
]
