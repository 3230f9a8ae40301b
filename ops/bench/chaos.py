"""``vigil bench chaos``: one long job under random faults of every kind, then a score.

Starts a local Vigil (a head with no CPUs + ``--nodes`` worker raylets of one CPU each, real agents, the
real controller; ``--netns``: every worker in its own network namespace), measures the step rate of the
job on a short calibration job, then runs one 2-rank job (policy ``evict_restart``, a checkpoint every
:data:`CKPT_INTERVAL` steps) sized so that its training lasts about ``--minutes``, and for those minutes
injects faults into it, one at a time. Then the same spec and seed run again without faults, to the
same final step, on the same cluster.

**Schedule** (:func:`draw_schedule`, reproducible from ``--seed``): fault times over the fault phase, gaps
drawn uniformly in [0.5, 1.5] x ``--fault-gap-s``; the first faults are every eligible kind once, in a
seeded random order, the rest drawn at random; each with a target rank, a step a little ahead of the
job's last step (10 to 25 steps), and its parameters. A fault is injected no earlier than its time,
after the previous one was resolved (its incident RECOVERED/CLOSED and the job past the step it had, or
the job stepping on for a no-incident kind; every evicted node readmitted, every killed node, agent or
raylet started again) and the job ran :data:`SETTLE_STEPS` more steps; faults that no longer fit in the
fault phase are not injected. A job that makes no step for :data:`STUCK_S` gets no more faults and is
cancelled (``status`` says so). The bench's home (database, logs) stays in /tmp for a look afterwards.

**Kinds** (:data:`EXPECT`): the API's ``kill_rank``, ``kill_node``, ``hang_rank``, ``slow_rank`` (mode
``compute``, factor 3-4), ``nan_loss``; from outside, ``kill_9`` (SIGKILL of the rank's pid),
``agent_kill_9`` (SIGKILL of the node agent's process, started again at once) and
``controller_kill_9`` (SIGKILL of the controller's session, started again after 2-12 s on the same
database); ``corrupt_checkpoint`` as a restore would meet it: the target rank is stopped (SIGSTOP) so
no newer checkpoint completes, the newest complete checkpoint is corrupted through the API, then the
stopped rank is killed and Ray Train restarts the group, whose restore must skip the corrupt
checkpoint; with ``--netns`` also ``degrade_nic``, ``nic_loss``, ``partition_node`` and ``flap_nic``
on the node of the target rank (cleared once detected).

**Scoring** (:func:`score`, pure): an incident detected in a fault's window (injection - 1 s to
resolution + :data:`GRACE_S`) is that fault's when it is the first of an expected kind there (its
incident), another of an expected kind blaming the same target (the same finding again), or of a kind
the fault may cause besides (``EXPECT[kind].also``); any other incident (one blaming another rank or
node, any incident during a no-incident fault, or during the calibration or fault-free job) is a false
positive. Per fault (``faults``; ``other_incidents``: the rest of its window):

- ``detected``: the expected signal was seen: an incident of an expected kind; for
  ``corrupt_checkpoint`` a ``checkpoint_invalid`` event naming the corrupted step; for
  ``agent_kill_9`` a heartbeat from the new agent, for ``controller_kill_9`` the controller answering
  again (no incident is expected for those two);
- ``culprit_correct``: the incident names the rank and node hit (a node fault: the node; a NaN: the rank,
  at or after the step asked); the checkpoint skipped is the corrupted one and the restore went back
  past it; a no-incident kind: no incident at all in its window;
- ``recovered``: after the fault the rank-0 steps show a restart (the step going back, or a pause of
  5 s) followed by a step past the one the job had reached (the fault's step, or the incident's), or,
  without a restart, an incident settled without an action (nothing to restart) and steps past it; for
  a no-incident kind: no restart at all and steps past the fault's step. Only until the bench gave up
  waiting for the fault to be resolved (after that it clears the fault itself).

**Samples** (:func:`sample_counts`, read from the controller's database: an operator tool may):
``samples_lost`` counts the (rank, step) pairs, every rank of the job and every step 1..final, with no
row in ``step_metrics`` (step rows only: collective rows are not checked); ``samples_duplicated`` counts
the ``step_metrics`` rows beyond one per (job, rank, step, attempt) (``ts`` in place of ``attempt`` on a
database without that column). ``ettr`` is the controller's goodput view of the faulted job;
``final_loss`` / ``final_loss_fault_free``: the mean over ranks of the newest loss of each rank at the
final step.

Prints one JSON object with ``--json`` (also written to ``--out``), else a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from controller.db import make_engine
from ops.bench.chaos_db import final_loss, incidents_since, missing_samples, rank_rows, sample_counts
from ops.bench.chaos_plan import BASE_KINDS, CKPT_INTERVAL, NET_KINDS, draw_schedule, eligible_kinds, score
from ops.bench.chaos_run import Chaos
from ops.bench.faultrun import safely
from ops.localcluster import free_port, start_local_cluster
from vigil.contract.probe import poll

log = logging.getLogger("vigil.bench.chaos")  # also the logger of ops.bench.chaos_run: `main` sets its level

# -- entry point -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = eligible_kinds(args.netns, args.kinds.split(",") if args.kinds else None)
    plans = draw_schedule(args.seed, args.minutes, args.fault_gap_s, kinds)
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-chaos-"))
    t_start = time.time()
    cluster = start_local_cluster(home, nodes=args.nodes, cpus_per_node=1, port=free_port(),
                                  database_url=args.database_url, netns=args.netns)
    engine = make_engine(cluster.database_url)
    try:
        if args.netns and cluster.netns is None:
            raise RuntimeError("--netns: the network namespaces could not be made (see the log)")
        ch = Chaos(cluster, engine, args.nodes, args.seed)
        calibration = ch.calibrate()
        rate = calibration["steps_per_s"]
        warm = 2 * CKPT_INTERVAL + 10
        steps = args.steps or warm + math.ceil((rate or 5.0) * args.minutes * 60)
        job_id, records = ch.run_faulted(plans, steps, args.minutes)
        job = ch.client.get_job(job_id)
        final = job.last_step or 0
        world = job.spec.scaling.max_workers
        # The agents replay what they spooled (a controller kill): give them a minute to catch up.
        samples = poll(lambda: (c := sample_counts(engine, job_id, final, world))["samples_lost"] == 0 and c,
                       60, 3.0) or sample_counts(engine, job_id, final, world)
        gone = missing_samples(engine, job_id, final, world) if samples["samples_lost"] else {}
        goodput = safely(lambda: ch.client.job_goodput(job_id), None)
        loss = final_loss(engine, job_id, final)
        # Rank 0's rows now, before the fault-free run: the controller prunes raw rows older than its
        # retention (an hour), which a 30-minute run followed by its fault-free twin outlasts.
        rank0 = rank_rows(engine, job_id)
        fault_free = ch.run_fault_free(final, rate) if final > 0 else None
        loss_free = final_loss(engine, fault_free["job_id"], final) if fault_free else None
        if fault_free:
            fault_free.update(sample_counts(engine, fault_free["job_id"], final, world))
        scored = score(records, incidents_since(engine, t_start), rank0)
    finally:
        engine.dispose()
        cluster.stop(discard_storage=True)
    return {
        "faults_injected": scored["faults_injected"],
        "detected": scored["detected"],
        "culprit_correct": scored["culprit_correct"],
        "recovered": scored["recovered"],
        "false_positives": scored["false_positives"],
        "samples_lost": samples["samples_lost"],
        "samples_duplicated": samples["samples_duplicated"],
        "ettr": round(goodput.ettr, 4) if goodput is not None and goodput.ettr is not None else None,
        "final_loss": loss,
        "final_loss_fault_free": loss_free,
        "minutes": args.minutes,
        "seed": args.seed,
        "nodes": args.nodes,
        "steps": final,
        "kinds": kinds,
        "faults": scored["faults"],
        "false_positive_incidents": scored["false_positive_incidents"],
        "job_id": job_id,
        "status": job.status.value,
        "steps_planned": steps,
        "faults_planned": len(plans),
        "samples_dropped_reported": samples["samples_dropped_reported"],
        "samples_missing": {str(r): s for r, s in gone.items()},
        "duplicate_key": samples["duplicate_key"],
        "goodput": goodput.model_dump(mode="json") if goodput is not None else None,
        "calibration": calibration,
        "fault_free": fault_free,
        "netns": args.netns,
        "wall_s": round(time.time() - t_start, 1),
    }


def _table(out: dict[str, Any]) -> str:
    head = (f"{'kind':<18} {'rank':>4} {'node':<13} {'asked':>6} {'hit':>6} {'incident':<10} "
            f"{'det':>5} {'culprit':>7} {'recov':>5} {'detect s':>8} {'recover s':>9}")
    lines = [head]
    for f in out["faults"]:
        lines.append(f"{f['kind']:<18} {f['rank']!s:>4} {f['node']!s:<13} {f['step_asked']!s:>6} {f['step_hit']!s:>6} "
                     f"{f['incident_kind']!s:<10} {f['detected']!s:>5} {f['culprit_correct']!s:>7} "
                     f"{f['recovered']!s:>5} {f['seconds_to_detect']!s:>8} {f['seconds_to_recover']!s:>9}")
    lines.append("")
    for k in ("faults_injected", "detected", "culprit_correct", "recovered", "false_positives", "samples_lost",
              "samples_duplicated", "ettr", "final_loss", "final_loss_fault_free", "steps", "status"):
        lines.append(f"{k}: {out[k]}")
    for inc in out["false_positive_incidents"]:
        lines.append(f"false positive: {inc}")
    return "\n".join(lines)


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vigil bench chaos", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="Print one JSON object only.")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="Length of the fault phase of the faulted job, in minutes (default 10); the job is sized "
                        "from a calibration run to train that long, then runs to its end.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the schedule and of the job's data and model.")
    p.add_argument("--netns", action="store_true",
                   help="Every worker node in its own network namespace (root, ip, tc), and network faults.")
    p.add_argument("--nodes", type=int, default=3,
                   help="Worker nodes of one CPU each (default 3: an eviction leaves room for the 2 ranks).")
    p.add_argument("--fault-gap-s", type=float, default=50.0,
                   help="Mean seconds between fault times (default 50: about 10 faults in 10 minutes).")
    p.add_argument("--kinds", default=None,
                   help=f"Comma-separated kinds to draw from (default all: {','.join(BASE_KINDS)}; with --netns "
                        f"also {','.join(NET_KINDS)}).")
    p.add_argument("--steps", type=int, default=None, help="Steps of the job (default: from the calibration).")
    p.add_argument("--database-url", default=None, help="Controller database (default: SQLite in the bench's home).")
    p.add_argument("--out", type=Path, default=None, help="Also write the JSON report to this file.")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.nodes < 2:
        p.error("--nodes: at least 2 worker nodes (the job has 2 ranks)")
    try:
        eligible_kinds(args.netns, args.kinds.split(",") if args.kinds else None)
    except ValueError as exc:
        p.error(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    # Stopped (SIGTERM, or SIGINT even where a background shell ignores it): the cluster is torn down.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.setLevel(logging.INFO)
    out = run(args)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2) if args.json else _table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
