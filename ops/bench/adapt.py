"""``vigil bench adapt``: a sick link answered by communicating less, against doing nothing and against eviction.

On a ``--netns`` local cluster (head with no CPUs + 3 worker nodes of one CPU, each in its own network
namespace behind a shaped ``LINK`` veth; real agents and controller), the same 2-rank DSM job (``TAU`` local
steps between synchronisations, a model large enough that a synchronisation is megabytes) runs four times:

* ``fault_free``: nothing happens (``recovery.policy: observe``);
* ``nothing``: at step ``AT`` the link of rank 1's node is cut to ``FRACTION`` of its rate (``degrade_nic``:
  1 Gbit/s -> 50 Mbit/s) for the rest of the run, and Vigil only observes;
* ``evict``: the same cut under ``evict_restart``: the node is found and evicted, Ray Train restarts the group
  on the spare node from the newest checkpoint;
* ``adapt``: the same cut under ``adapt`` (``recovery.adapt.params: {tau: ADAPT_TAU}``): every rank switches to
  the longer local period at a checkpoint boundary, without a restart.

Per run: ``wall_s``, rank 0's first step to its last (what the job took to train, restarts included);
``final_loss``, the mean training loss of both ranks over the last ``FINAL_STEPS`` steps; ``steps_lost``, the steps run twice after a restart (the step the job had reached when the incident was
detected minus the step it resumed from, 0 without a restart). ``adapt`` also reports its incident's evidence
(the version asked for, the switch step, step time before and after). Prints one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.bench.faultrun import FaultRun
from ops.localcluster import free_port, start_local_cluster
from vigil.contract.link import LinkSpec
from vigil.contract.schemas import JobCreate

log = logging.getLogger("vigil.bench.adapt")

STEPS, AT, CKPT = 300, 60, 20
TAU, ADAPT_TAU = 4, 16
LINK, FRACTION = "1gbit", 0.05
RUNS = ("fault_free", "nothing", "evict", "adapt")
FINAL_STEPS = 20
POLICY = {"fault_free": "observe", "nothing": "observe", "evict": "evict_restart", "adapt": "adapt"}


def job_spec(name: str, policy: str, steps: int = STEPS) -> JobCreate:
    """The benchmark's job: DSM with a short local period over a ~1M-parameter GPT (4 MB per synchronisation)."""
    recovery: dict[str, Any] = {"policy": policy, "max_restarts": 3}
    if policy == "adapt":
        recovery["adapt"] = {"params": {"tau": ADAPT_TAU}}
    return JobCreate.model_validate({
        "name": name,
        "model": {"n_layer": 2, "n_head": 4, "d_model": 192, "context": 64},
        "data": {"max_bytes": 300_000},
        "optimizer": {"kind": "dsm", "lr": 0.003, "params": {"tau": TAU}},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "steps": steps, "batch_size": 16,
        "lr_schedule": {"kind": "constant"},
        "checkpoint": {"interval_steps": CKPT, "keep_last": 3},
        "recovery": recovery,
    })


class Bench(FaultRun):
    def run(self, kind: str, steps: int) -> dict[str, Any]:
        """One run of the job to its end (module docstring)."""
        job = self.client.submit_job(job_spec(f"adapt-bench-{kind}", POLICY[kind], steps)).id
        if kind != "fault_free":
            self.inject(job, {"kind": "degrade_nic", "rank": 1, "step": AT, "params": {"fraction": FRACTION}})
        status = self.finish(job, timeout=1800)
        time.sleep(3)  # the last steps' aggregates
        steps_, ts, _ = self.rank0_series(job)
        incidents = self.incidents(job)
        out: dict[str, Any] = {"job_id": job, "status": status, "wall_s": _wall(steps_, ts),
                               "final_loss": self._final_loss(job, steps), "steps_lost": _steps_lost(steps_, ts, incidents),
                               "incidents": [{k: i.get(k) for k in ("kind", "status", "node_id", "action")}
                                             for i in incidents]}
        adapted = [i["evidence"]["adapt"] for i in incidents if isinstance(i["evidence"].get("adapt"), dict)]
        if adapted:
            out["adapt"] = adapted[0]
        return out

    def _final_loss(self, job: str, steps: int) -> float | None:
        """The mean training loss of every rank over the last ``FINAL_STEPS`` steps."""
        tail = [x for r in self.client.job_metrics(job, max_points=100_000).ranks
                for st, x in zip(r.step, r.loss, strict=True) if x is not None and st > steps - FINAL_STEPS]
        return round(statistics.mean(tail), 4) if tail else None


def _wall(steps: list[int], ts: list[float]) -> float | None:
    return round(max(ts) - min(ts), 2) if ts else None


def _steps_lost(steps: list[int], ts: list[float], incidents: list[dict[str, Any]]) -> int:
    """Steps run twice: the step reached at the restart's incident minus the step the group resumed from."""
    acted = [i for i in incidents if i.get("acted_at")]
    if not acted:
        return 0
    reached = max(int(i.get("step_at_detect") or 0) for i in acted)
    for i in range(1, len(steps)):
        if steps[i] <= steps[i - 1] or ts[i] - ts[i - 1] > 5.0:
            return max(0, reached - (steps[i] - 1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vigil bench adapt", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    p.add_argument("--steps", type=int, default=STEPS, help=f"Steps per run (default {STEPS}).")
    p.add_argument("--runs", default=",".join(RUNS), help="Comma-separated runs (default: all four).")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        p.error(f"--runs: unknown {unknown}; known: {', '.join(RUNS)}")
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-adapt-"))
    t0 = time.time()
    cluster = start_local_cluster(home, nodes=3, cpus_per_node=1, port=free_port(), netns=True,
                                  link=LinkSpec(rate=LINK))
    try:
        b = Bench(cluster, timeout=30)
        out: dict[str, Any] = {kind: b.run(kind, args.steps) for kind in runs}
    finally:
        cluster.stop(discard_storage=True)
    out["setup"] = {"steps": args.steps, "fault_step": AT, "link": LINK, "cut_to": FRACTION, "tau": TAU,
                    "adapt_tau": ADAPT_TAU, "netns": cluster.netns is not None, "bench_wall_s": round(time.time() - t0, 1)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for kind in runs:
            r = out[kind]
            print(f"{kind:<10} wall {r['wall_s']} s  final loss {r['final_loss']}  steps lost {r['steps_lost']}  "
                  f"{r['status']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
