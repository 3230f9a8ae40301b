"""``vigil bench stragglers``: how soon a slow rank is found, whether the right one, and whether the seconds it
cost are reported right; and how many ranks a long clean run under other load wrongly names.

On a local cluster (head with no CPUs + 2 worker raylets, real agents and controller), 2-rank jobs under
``recovery.policy: observe`` (found, never acted on: the whole run is measured), ``STEPS`` steps each:

* per co-tenant setting (none, or a process burning one CPU beside the job: on this one machine every node
  shares the CPUs, so it loads the job's nodes alike), a **fault-free** run of the same job (same seed):
  the true cost of a fault is its run's time from the fault's step to the end minus this run's;
* per (factor, mode, co-tenant) **case**: rank 1 made ``factor`` x slower from step ``AT`` by the
  ``slow_rank`` fault (``compute``: its forward+backward ``factor`` x longer; ``comm``: the same seconds spent
  late to its collectives, inside its optimizer step, its forward+backward at its peers' pace).
  ``detected_after_steps``: the straggler incident's step minus ``AT`` (null: never); ``culprit_correct``: it
  names rank 1; ``seconds_lost_reported``: ``GET /jobs/{id}/stragglers``' per-step seconds lost summed from
  ``AT`` on, as a user reads it live (no fault-free run to subtract); ``noise_floor_s``: the same sum in the
  fault-free run; ``seconds_lost_true``: what the fault cost, against the fault-free run: the two runs' step
  durations (rank 0's time from one step to the next) from ``AT`` on subtracted step by step, their mean
  with the 5% highest and lowest differences left out (a checkpoint's pause or a hiccup that hit one run
  only), times the steps; ``seconds_lost_true_relative``: each run's pace after ``AT`` relative to its own
  pace before (steps ``WARMUP``-``AT``), the fault-free run's change subtracted (cancels a difference of pace
  between the two runs, adds the noise of 60 steps' pace); ``seconds_lost_true_wall``: the plain difference
  of their wall times over those steps. On this shared 2-core machine two runs of one job differ by more
  than a 1.15x-1.3x fault costs (docs/BENCHMARKS.md).
* ``clean``: one long run with the co-tenant; ``false_positives``: straggler incidents in it.

Prints one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from ops.bench.faultrun import FaultRun
from ops.bench.recovery import job_spec
from ops.localcluster import free_port, start_local_cluster

log = logging.getLogger("vigil.bench.stragglers")

STEPS, AT = 300, 80
FACTORS = (1.15, 1.3, 2.0)
MODES = ("compute", "comm")
TRIM = 0.05
"""The share of paired step differences left out at each end for ``seconds_lost_true``."""


WARMUP = 20
"""Steps left out of a run's pace before the fault (the first steps warm up)."""


def trimmed_mean(values: list[float]) -> float:
    """The mean with the :data:`TRIM` share of the values left out at each end."""
    ordered = sorted(values)
    k = int(TRIM * len(ordered))
    kept = ordered[k:len(ordered) - k] or ordered
    return sum(kept) / len(kept)


def pace(ts: Mapping[int, float], first: int, last: int) -> float | None:
    """A run's trimmed mean step duration over the steps after ``first`` up to ``last`` (None: a step missing)."""
    if any(st not in ts for st in range(first, last + 1)):
        return None
    return trimmed_mean([ts[st] - ts[st - 1] for st in range(first + 1, last + 1)])


def relative_cost(run: Mapping[int, float], clean: Mapping[int, float]) -> float | None:
    """What the fault cost over the steps after ``AT``: the run's pace after it minus its pace before, less the
    same for the clean run, times the steps (None: a step missing)."""
    paces = [pace(ts, a, b) for ts in (run, clean) for a, b in ((AT, STEPS), (WARMUP, AT))]
    if any(p is None for p in paces):
        return None
    after, before, clean_after, clean_before = paces
    return ((after - before) - (clean_after - clean_before)) * (STEPS - AT)  # type: ignore[operator]


def paired_cost(run: Mapping[int, float], clean: Mapping[int, float], first: int, last: int) -> float | None:
    """What a fault cost: step by step from ``first`` to ``last``, the run's step duration minus the clean run's
    (durations from each step's timestamp to the next), a mean trimmed by :data:`TRIM` at each end, times the
    steps (None: a step missing in either run)."""
    if any(st not in run or st not in clean for st in range(first, last + 1)):
        return None
    diffs = [(run[st] - run[st - 1]) - (clean[st] - clean[st - 1]) for st in range(first + 1, last + 1)]
    return trimmed_mean(diffs) * len(diffs)


class Cotenant:
    """A process burning one CPU while it lives (``with Cotenant(on): ...``; off: nothing)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class Bench(FaultRun):
    def run_job(self, name: str, steps: int, fault: dict[str, Any] | None) -> dict[str, Any]:
        """One observed job to its end: its step times, per-step seconds lost and straggler incidents."""
        spec = job_spec(name, steps, policy="observe", ckpt=100)
        job = self.client.submit_job(spec).id
        if fault is not None:
            self.inject(job, fault)
        status = self.finish(job, timeout=1800)
        time.sleep(3)  # the last steps' aggregates
        steps_, ts, _ = self.rank0_series(job)
        lost = self.client.job_seconds_lost(job, max_points=100_000)
        return {"job_id": job, "status": status, "ts": dict(zip(steps_, ts, strict=True)),
                "lost": dict(zip(lost.step, lost.lost_s, strict=True)),
                "stragglers": [i for i in self.incidents(job) if i["kind"] == "straggler"]}

    @staticmethod
    def span(run: dict[str, Any], first: int, last: int) -> float | None:
        t = run["ts"]
        return t[last] - t[first] if first in t and last in t else None

    @staticmethod
    def lost_from(run: dict[str, Any], first: int) -> float:
        return sum(v for st, v in run["lost"].items() if st > first)

    def case(self, factor: float, mode: str, cotenant: bool, clean: dict[str, Any]) -> dict[str, Any]:
        fault = {"kind": "slow_rank", "rank": 1, "step": AT, "params": {"factor": factor, "mode": mode}}
        with Cotenant(cotenant):
            run = self.run_job(f"straggler-{factor}-{mode}-{int(cotenant)}", STEPS, fault)
        inc = run["stragglers"][0] if run["stragglers"] else None
        true = self.span(run, AT, STEPS)
        base = self.span(clean, AT, STEPS)
        noise = self.lost_from(clean, AT)
        paired = paired_cost(run["ts"], clean["ts"], AT, STEPS)
        relative = relative_cost(run["ts"], clean["ts"])
        return {
            "factor": factor, "mode": mode, "cotenant": cotenant, "job_id": run["job_id"], "status": run["status"],
            "detected_after_steps": (inc["step_at_detect"] - AT) if inc and inc.get("step_at_detect") else None,
            "culprit_correct": bool(inc and inc["rank"] == 1),
            "class": inc["evidence"].get("class") if inc else None,
            "basis": inc["evidence"].get("basis") if inc else None,
            "phase": inc["evidence"].get("phase") if inc else None,
            "seconds_lost_reported": round(self.lost_from(run, AT), 3),
            "seconds_lost_true": round(paired, 3) if paired is not None else None,
            "seconds_lost_true_relative": round(relative, 3) if relative is not None else None,
            "seconds_lost_true_wall": round(true - base, 3) if true is not None and base is not None else None,
            "noise_floor_s": round(noise, 3),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vigil bench stragglers", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    p.add_argument("--clean-steps", type=int, default=1000, help="Steps of the clean run under load (default 1000).")
    p.add_argument("--factors", default=",".join(map(str, FACTORS)), help="Comma-separated slow factors.")
    p.add_argument("--cotenant", choices=("both", "on", "off"), default="both", help="Co-tenant settings to run.")
    p.add_argument("--modes", default=",".join(MODES), help="Comma-separated slow modes (compute, comm).")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    factors = [float(x) for x in args.factors.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: {', '.join(bad)} not one of {', '.join(MODES)}")
    settings = {"both": (False, True), "on": (True,), "off": (False,)}[args.cotenant]
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-stragglers-"))
    t0 = time.time()
    cluster = start_local_cluster(home, nodes=3, cpus_per_node=1, port=free_port())
    try:
        b = Bench(cluster, timeout=30)
        cases = []
        for cotenant in settings:
            with Cotenant(cotenant):
                clean = b.run_job(f"fault-free-{int(cotenant)}", STEPS, None)
            cases += [b.case(f, mode, cotenant, clean) for mode in modes for f in factors]
        clean_run = None
        if args.clean_steps > 0:
            with Cotenant(True):
                long = b.run_job("clean-long", args.clean_steps, None)
            clean_run = {"steps": args.clean_steps, "cotenant": True, "false_positives": len(long["stragglers"]),
                         "status": long["status"], "incidents": [i["evidence"] for i in long["stragglers"]]}
    finally:
        cluster.stop(discard_storage=True)
    out = {"steps": STEPS, "fault_step": AT, "cases": cases, "clean": clean_run, "wall_s": round(time.time() - t0, 1)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for c in cases:
            print(f"{c['factor']:>5}x {c['mode']:<8} cotenant={c['cotenant']!s:<5} after={c['detected_after_steps']!s:>5} "
                  f"culprit={c['culprit_correct']!s:<5} lost reported={c['seconds_lost_reported']} "
                  f"true={c['seconds_lost_true']}")
        print(f"clean: {clean_run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
