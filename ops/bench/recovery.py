"""``vigil bench recovery``: time to detect and to recover from each fault kind on a real local cluster.

Starts a local Vigil (head with no CPUs + 3 worker raylets, one CPU each, real agents and controller), then runs
one 2-rank job per fault kind, injects the fault through the API (or from outside for ``kill_9``
and ``remove_node``), and reads the controller's incidents:

- ``time_to_detect_s``: fault fired -> incident detected (``steps_to_detect``: the same in rank 0's steps);
- ``time_to_recover_s``: fault fired -> the first step the job ran after restoring;
- ``lost_steps``: steps run twice because of the restart (last step before the fault, minus the
  step the job resumed after);
- ``culprit_correct``: the incident names the rank/node the fault hit.

Also a clean run (no incidents expected: ``false_positives_clean_run``) and ETTR, the effective
training time ratio of a job with a fault injected every ``--fault-every`` steps: the time its
unique steps took, over its wall time from first step to last.

Prints JSON with ``--json``. ``--quick`` runs one fault of each kind on short jobs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from ops.bench.faultrun import FaultRun, step_at
from ops.bench.faultrun import parse_ts as _ts
from ops.localcluster import LocalCluster, free_port, start_local_cluster
from vigil.contract.checkpoint_layout import job_checkpoint_root, newest_complete
from vigil.contract.probe import poll
from vigil.contract.schemas import JobCreate

log = logging.getLogger("vigil.bench.recovery")



def job_spec(name: str, steps: int, policy: str = "evict_restart", ckpt: int = 10, batch: int = 32) -> JobCreate:
    return JobCreate.model_validate({
        "name": name,
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64},
        "data": {"max_bytes": 300_000},
        "optimizer": {"kind": "adamw", "lr": 0.01},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        # batch 32: ~60 ms of compute per step, so a 2x slower rank adds more than scheduling noise
        # (the straggler detector ignores excesses under 25 ms; docs/RECOVERY.md).
        "steps": steps, "batch_size": batch,
        "lr_schedule": {"kind": "constant"},
        "checkpoint": {"interval_steps": ckpt, "keep_last": 3},
        "recovery": {"policy": policy, "max_restarts": 5},
    })


def _result(kind: str, job_id: str) -> dict[str, Any]:
    """One fault's entry of ``faults``, before anything is known."""
    return {"kind": kind, "job_id": job_id, "detected": False, "culprit_correct": False, "time_to_detect_s": None,
            "steps_to_detect": None, "time_to_recover_s": None, "lost_steps": None}


class Runner(FaultRun):
    def __init__(self, cluster: LocalCluster, slow_factor: float = 2.0, slow_mode: str = "compute") -> None:
        super().__init__(cluster, timeout=30)
        self.slow_factor = slow_factor
        self.slow_mode = slow_mode

    def restart_point(self, job_id: str, after: float, fault_step: int | None) -> tuple[float | None, int | None]:
        """(time of the first step after the restart, steps run twice).

        The metrics keep one row per step, the newest: a replayed step's first run is gone, so in
        time order the restart shows as the pause (or step going back) before the first replayed step,
        which is the restored checkpoint's step + 1. Steps run twice: the step the job had reached
        when the fault fired minus the restored step.
        """
        steps, ts, _ = self.rank0_series(job_id)
        for i in range(1, len(steps)):
            if ts[i] > after and (steps[i] <= steps[i - 1] or ts[i] - ts[i - 1] > 5.0):
                lost = max(0, fault_step - (steps[i] - 1)) if fault_step is not None else None
                return ts[i], lost
        return None, None

    # -- one fault -------------------------------------------------------------------------------
    def run_fault(self, kind: str, steps: int, at: int) -> dict[str, Any]:
        if kind == "corrupt_checkpoint":
            return self.run_corrupt_checkpoint(steps, at)
        policy = "rollback" if kind == "nan_loss" else "evict_restart"
        # A slow rank is scored only outside checkpoints' shadows (docs/RECOVERY.md): with a checkpoint
        # every 10 steps a third of the steps would not count, so its job checkpoints every 50. And its
        # steps are ~0.2 s (batch 96) rather than ~0.07 s: telemetry reaches the controller within about
        # a second, which would otherwise be 15 steps of the 20 the goal allows.
        slow = kind == "slow_rank"
        job = self.client.submit_job(job_spec(f"bench-{kind}", steps, policy, ckpt=50 if slow else 10,
                                              batch=96 if slow else 32))
        out = _result(kind, job.id)
        if not self.reach(job.id, at):
            out["error"] = "job did not reach the fault step"
            return out
        target_rank = 1
        loc = self.rank_location(job.id, target_rank)
        if loc is None:
            out["error"] = "rank not found"
            return out
        node, pid = loc
        fired = time.time()
        fault_step = self.client.get_job(job.id).last_step  # updated with every batch of telemetry
        expected_kind = {"kill_rank": "rank_died", "kill_9": "rank_died", "hang_rank": "hang",
                         "slow_rank": "straggler", "nan_loss": "nan_loss", "kill_node": "node_lost",
                         "remove_node": "node_lost"}[kind]
        # Faults a rank fires itself (from a fault file) are set a few steps ahead, so they hit a known step.
        in_rank = kind == "nan_loss" or (kind == "slow_rank" and self.slow_mode == "compute")
        hit_step: int | None = (fault_step or at) + 10 if in_rank else None
        fired, fault_step = self._fire(job.id, kind, target_rank, node, pid, at if not in_rank else hit_step,
                                       fired, fault_step)
        inc = poll(lambda: next((i for i in self.incidents(job.id)
                                  if i["kind"] == expected_kind and (expected_kind != "hang" or i["rank"] is not None)),
                                 None), 180, 0.5)
        # The step the fault hit: a fault file's own step, or the step the job had reached when the
        # controller fired the fault.
        if not in_rank:
            hit_step = fault_step
        else:
            # The rank fires it at the first step at or after the one asked for (its file can land after that
            # step when the steps are fast): the step it says it hit. The clock starts when that step ran, not
            # when the file was written. Read now, before a restart replays the step (the series keeps a
            # step's newest run).
            hit_step = next((f["hit_step"] for f in self.faults(job.id) if f.get("hit_step") is not None), hit_step)
            steps, ts, _ = self.rank0_series(job.id)
            fired = next((t for st, t in zip(steps, ts, strict=True) if st == hit_step and t >= fired), fired)
        status = self.finish(job.id)
        out["status"] = status
        if kind == "slow_rank":
            out["slow_mode"] = self.slow_mode
            out["observed_slowdown"] = self.observed_slowdown(
                job.id, target_rank, hit_step, inc.get("step_at_detect") if inc else None)
        if inc is None:
            return out
        inc = next(i for i in self.incidents(job.id) if i["id"] == inc["id"])
        self._score(out, inc, kind, expected_kind, target_rank, node, hit_step, fault_step, fired)
        self._readmit_evicted()
        return out

    def _fire(self, job_id: str, kind: str, rank: int, node: str, pid: int, step: int | None, fired: float,
              fault_step: int | None) -> tuple[float, int | None]:
        """Fire the fault (``kill_9`` and ``remove_node`` from here, the rest through the controller at
        ``step``); returns when it fired and the step it fired at, as far as the controller says."""
        if kind == "kill_9":
            os.kill(pid, signal.SIGKILL)
        elif kind == "remove_node":
            self._remove_node(node)
        else:
            body: dict[str, Any] = {"kind": kind, "rank": rank, "step": step}
            if kind == "slow_rank":
                body["params"] = {"factor": self.slow_factor, "mode": self.slow_mode}
            self.inject(job_id, body)
            fault = poll(lambda: next((f for f in self.faults(job_id)
                                        if f["fired_at"]), None), 60, 0.5)
            if fault:
                fired = _ts(fault["fired_at"]) or fired
                fault_step = self._step_at(fault.get("message", "")) or fault_step
        return fired, fault_step

    def _score(self, out: dict[str, Any], inc: dict[str, Any], kind: str, expected_kind: str, rank: int, node: str,
               hit_step: int | None, fault_step: int | None, fired: float) -> None:
        """The incident's figures into ``out``: time and steps to detect, culprit, time to recover, lost steps."""
        out["detected"] = True
        out["time_to_detect_s"] = round((_ts(inc["detected_at"]) or fired) - fired, 2)
        if kind == "nan_loss":
            out["culprit_correct"] = inc["evidence"].get("step", 0) >= (hit_step or 0)
        elif expected_kind == "node_lost":
            out["culprit_correct"] = inc["node_id"] == node
        else:
            out["culprit_correct"] = inc["rank"] == rank and inc["node_id"] == node
        if hit_step is not None and inc.get("step_at_detect") is not None:
            out["steps_to_detect"] = max(0, inc["step_at_detect"] - hit_step)
        # Steps run twice: from the restored checkpoint up to where the job had got when the restart
        # began. A NaN, a slow rank or a dead node leaves the job stepping until it is detected.
        known = [x for x in (hit_step, fault_step, inc.get("step_at_detect")) if x is not None]
        reached = max(known) if known else None
        restart_ts, lost = self.restart_point(out["job_id"], fired, reached)
        if restart_ts is not None:
            out["time_to_recover_s"] = round(restart_ts - fired, 2)
            out["lost_steps"] = lost
        out["action"] = inc.get("action")

    def _readmit_evicted(self) -> None:
        """Give an evicted node back for the next fault."""
        for n in self.client.list_nodes().data:
            if n.state.value == "EVICTED":
                self.client.readmit_node(n.id)
                poll(lambda n=n: any(x.id == n.id and x.state.value == "ALIVE"
                                      for x in self.client.list_nodes().data), 60)
                time.sleep(10)  # the fresh raylet registers with Ray

    def run_corrupt_checkpoint(self, steps: int, at: int) -> dict[str, Any]:
        """The newest checkpoint corrupted, then the group restarted: found on restore, the one before used.

        As tests/e2e/test_faults.py does it: the job (policy observe) is frozen first (rank 1 stopped,
        so no newer checkpoint can complete), the newest complete checkpoint on storage is corrupted,
        then the stopped rank is killed and Ray Train restarts the group. Detected: the ranks'
        ``checkpoint_invalid`` event for that step (timed from the kill); culprit right: the event
        names the corrupted step and the restart restored the checkpoint before it; lost steps: the
        frozen step minus the restored one (a corrupt checkpoint costs a whole interval more).
        """
        kind = "corrupt_checkpoint"
        job = self.client.submit_job(job_spec(f"bench-{kind}", steps, "observe"))
        out = _result(kind, job.id)
        if not self.reach(job.id, at):
            out["error"] = "job did not reach the fault step"
            return out
        self.inject(job.id, {"kind": "hang_rank", "rank": 1, "step": 0})

        def frozen() -> int | None:
            before = self.client.get_job(job.id).last_step
            time.sleep(2)
            return before if self.client.get_job(job.id).last_step == before else None

        frozen_step = poll(frozen, 60, 0)
        found = newest_complete(job_checkpoint_root(self.cluster.storage, job.id))
        if frozen_step is None or found is None:
            out["error"] = "the job did not freeze, or has no complete checkpoint"
            return out
        newest, newest_dir = found
        self.inject(job.id, {"kind": "corrupt_checkpoint", "step": 0})
        def corrupted() -> bool:
            return any(b"VIGIL-CORRUPTED!" in f.read_bytes() for f in newest_dir.glob("*.distcp"))

        if not poll(corrupted, 60):
            out["error"] = "the checkpoint was not corrupted"
            return out
        fired = time.time()
        # Through its agent: a rank stopped with SIGSTOP reads no fault file of its own (seen: the in-rank kill
        # waited 7.5 min for Ray Train's own timeout).
        self.inject(job.id, {"kind": "kill_rank", "rank": 1, "step": 0, "params": {"mode": "agent"}})
        out["status"] = self.finish(job.id)
        events = [e for e in self.events(job.id)
                  if e["kind"] == "checkpoint_invalid"]
        restored = re.search(r"rank 0 restored step (\d+) from", self.client.job_logs(job.id).logs)
        out["corrupted_step"] = newest
        out["restored_step"] = int(restored.group(1)) if restored else None
        if events:
            out["detected"] = True
            out["time_to_detect_s"] = round(min(_ts(e["ts"]) or fired for e in events) - fired, 2)
            # (a newer partial folder, being written when the rank stopped, may be found out too)
            found = [e["data"].get("step") for e in events]
            out["culprit_correct"] = (newest in found and all(x > newest for x in found if x != newest)
                                      and out["restored_step"] is not None and out["restored_step"] < newest)
        restart_ts, lost = self.restart_point(job.id, fired, frozen_step)
        if restart_ts is not None:
            out["time_to_recover_s"] = round(restart_ts - fired, 2)
            out["lost_steps"] = lost
        return out

    def observed_slowdown(self, job_id: str, rank: int, first: int | None, last: int | None) -> float | None:
        """Median, over the steps between the fault and its detection, of the slowed rank's compute time
        (forward+backward) over its peers' median: how much slower the fault really made it."""
        if first is None:
            return None
        rows = self.client.job_steps(job_id, since_step=first + 1, until_step=last or first + 40,
                                     max_points=100_000).model_dump(mode="json")["data"]
        by_step: dict[int, dict[int, float]] = {}
        for series in rows:
            for st, c in zip(series["step"], series["fwd_bwd_s"], strict=True):
                if c:
                    by_step.setdefault(st, {})[series["rank"]] = c
        ratios = [v[rank] / statistics.median(c for k, c in v.items() if k != rank)
                  for v in by_step.values() if rank in v and len(v) > 1]
        return round(statistics.median(ratios), 3) if ratios else None

    _step_at = staticmethod(step_at)

    def _remove_node(self, node: str) -> None:
        idx = node.rsplit("-", 1)[1]
        for child in self.cluster.procs.children:
            if child.name in (f"ray-node-{idx}", f"agent-{idx}"):
                try:
                    procs = [*psutil.Process(child.proc.pid).children(recursive=True),
                             psutil.Process(child.proc.pid)]
                except psutil.Error:
                    continue
                for p in procs:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass

    # -- clean run and ETTR -----------------------------------------------------------------------
    def clean_run(self, steps: int) -> dict[str, Any]:
        job = self.client.submit_job(job_spec("bench-clean", steps))
        status = self.finish(job.id, timeout=steps * 2 + 300)
        incidents = self.incidents(job.id)
        return {"job_id": job.id, "status": status, "steps": steps, "incidents": len(incidents),
                "kinds": sorted({i["kind"] for i in incidents})}

    def ettr(self, steps: int, fault_every: int) -> dict[str, Any]:
        # A checkpoint every 100 steps (~10 s of training here), as a job with faults minutes apart would.
        job = self.client.submit_job(job_spec("bench-ettr", steps, ckpt=100))
        at = fault_every
        faults = 0
        while at < steps:
            if not self.reach(job.id, at, timeout=600):
                break
            self.inject(job.id, {"kind": "kill_rank", "rank": faults % 2, "step": at})
            faults += 1
            at += fault_every
        self.finish(job.id, timeout=3600)
        step_nums, ts, times = self.rank0_series(job.id)
        if not ts:
            return {"ettr": None, "faults": faults}
        wall = ts[-1] - ts[0] + (times[0] if times else 0.0)
        productive = statistics.median(times) * (max(step_nums) - min(step_nums) + 1)
        return {"ettr": round(min(1.0, productive / wall), 3), "faults": faults, "wall_s": round(wall, 1),
                "status": self.client.get_job(job.id).status.value}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vigil bench recovery", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    p.add_argument("--quick", action="store_true", help="One fault of each kind on short jobs (about 10 min).")
    p.add_argument("--kinds",
                   default="kill_rank,kill_9,hang_rank,slow_rank,nan_loss,corrupt_checkpoint,kill_node",
                   help="Comma-separated fault kinds (kill_node/remove_node last: they shrink the cluster).")
    p.add_argument("--clean-steps", type=int, default=None, help="Steps of the clean run (default 1000; quick 200).")
    p.add_argument("--fault-every", type=int, default=1500,
                   help="ETTR run: a kill_rank every N steps (default 1500: about 2 minutes of training here).")
    p.add_argument("--slow-factor", type=float, default=2.0, help="slow_rank: how many times slower the rank runs.")
    p.add_argument("--slow-mode", choices=("compute", "throttle"), default="compute",
                   help="slow_rank: the rank's compute phase made longer (a slow accelerator), or its process "
                        "duty-cycled by SIGSTOP/SIGCONT (diluted on a host with more runnable threads than cores).")
    p.add_argument("--policy", choices=("evict_restart", "live"), default="evict_restart",
                   help="live: the faults of live recovery (kill_rank, kill_9, hang_rank, a 2x slow_rank, kill_node) "
                        "under recovery.policy live and, beside them in the same run, under evict_restart.")
    p.add_argument("--no-baseline", action="store_true", help="--policy live: skip the evict_restart runs.")
    p.add_argument("--fault-every-s", type=float, default=60.0,
                   help="--policy live, ETTR run: a kill_rank every this many seconds of training (default 60).")
    p.add_argument("--ettr-minutes", type=float, default=5.0,
                   help="--policy live: length of each ETTR run in minutes (default 5; 0: none).")
    p.add_argument("--steady-steps", type=int, default=400,
                   help="--policy live: a fault-free job of this many steps under live and under evict_restart, "
                        "for steady_step_ratio (the live pace over the evict_restart one; 0: none).")
    p.add_argument("--spares", type=int, default=1,
                   help="--policy live: recovery.spares of the live fault and ETTR jobs (default 1; 0: Ray restarts "
                        "a lost replica's process, which imports torch again before it heals).")
    p.add_argument("--steady-repeats", type=int, default=2,
                   help="--policy live: the steady jobs taken in turn this many times; each keeps its fastest.")
    p.add_argument("--attached", action="store_true",
                   help="On a Ray cluster built with `ray start` (no vigil up), Vigil attached with --deploy-agents, "
                        "checkpoints on a local S3-compatible server (moto): ops/bench/attached.py.")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.policy == "live":
        return _main_live(args)
    steps, at = (70, 20) if args.quick else (120, 30)
    clean_steps = args.clean_steps if args.clean_steps is not None else (200 if args.quick else 1000)
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-recovery-"))
    t0 = time.time()
    s3 = None
    if args.attached:
        from ops.bench.attached import start_attached_cluster, start_s3

        s3 = start_s3()
        cluster: Any = start_attached_cluster(home, nodes=3, storage=f"s3://{s3.bucket}/bench", extra_env=s3.env)
    else:
        cluster = start_local_cluster(home, nodes=3, cpus_per_node=1, port=free_port())
    try:
        r = Runner(cluster, slow_factor=args.slow_factor, slow_mode=args.slow_mode)
        results = [r.run_fault(k.strip(), steps, at) for k in args.kinds.split(",") if k.strip()]
        clean = r.clean_run(clean_steps) if clean_steps > 0 else None
        ettr = r.ettr(3 * args.fault_every + 20, args.fault_every) if not args.quick else None
    finally:
        cluster.stop(discard_storage=True)
        if s3 is not None:
            s3.stop()
    out = {
        "cluster": "attached (ray start, --deploy-agents, s3 storage)" if args.attached else "vigil up",
        "faults": results,
        "false_positives_clean_run": clean["incidents"] if clean else None,
        "clean_run": clean,
        "ettr": ettr["ettr"] if ettr else None,
        "ettr_run": ettr,
        "wall_s": round(time.time() - t0, 1),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{'kind':<12} {'detected':>8} {'culprit':>8} {'detect s':>9} {'steps':>6} {'recover s':>10} {'lost':>5}")
        for f in results:
            print(f"{f['kind']:<12} {f['detected']!s:>8} {f['culprit_correct']!s:>8} {f['time_to_detect_s']!s:>9} "
                  f"{f['steps_to_detect']!s:>6} {f['time_to_recover_s']!s:>10} {f['lost_steps']!s:>5}")
        print(f"false positives over {clean_steps} clean steps: {out['false_positives_clean_run']}; "
              f"ETTR: {out['ettr']}")
    return 0


def _main_live(args: argparse.Namespace) -> int:
    from ops.bench.live_recovery import LIVE_FAULTS, LiveRunner

    asked = [k.strip() for k in args.kinds.split(",") if k.strip()]
    kinds = [k for k in asked if k in LIVE_FAULTS] or ([] if not asked else list(LIVE_FAULTS))  # "": none
    if "kill_node" in kinds:  # it shrinks the cluster: last
        kinds = [k for k in kinds if k != "kill_node"] + ["kill_node"]
    # Long enough that the replaced rank is back before the end (a hang takes ~16 s to find, a lost
    # node ~20 s for Ray to give up on): ~0.07 s steps.
    steps, at = (450, 30) if args.quick else (900, 40)
    policies = ["live"] if args.no_baseline else ["live", "evict_restart"]
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-recovery-"))
    t0 = time.time()
    cluster = start_local_cluster(home, nodes=3, cpus_per_node=1, port=free_port())
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    ettr: dict[str, dict[str, Any]] = {}
    try:
        r = LiveRunner(cluster)
        r.spares = args.spares
        for kind in kinds:
            for policy in policies:
                results[policy].append(r.run_fault(kind, policy, steps, at, slow_factor=args.slow_factor))
                if kind == "kill_node":  # the killed node's processes come back for the next run
                    r.restart_node_processes()
        if args.ettr_minutes > 0:
            for policy in policies:
                ettr[policy] = r.ettr(policy, args.ettr_minutes, args.fault_every_s)
        steady = _steady(r, args.steady_steps, args.steady_repeats) if args.steady_steps > 0 else {}
    finally:
        cluster.stop(discard_storage=True)
    out: dict[str, Any] = {
        "policy": "live", "spares": args.spares, "faults": results["live"],
        "ettr": ettr.get("live", {}).get("ettr"), "ettr_run": ettr.get("live"),
        "steady_step_ratio": _ratio(steady), "steady_step_ratio_quorum_every_step": _ratio(steady, "live_every_step"),
        "steady": steady,
        "wall_s": round(time.time() - t0, 1),
    }
    if "evict_restart" in results:
        out["baseline"] = {"policy": "evict_restart", "faults": results["evict_restart"],
                           "ettr": ettr.get("evict_restart", {}).get("ettr"), "ettr_run": ettr.get("evict_restart")}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'kind':<10} {'policy':<14} {'detected':>8} {'culprit':>8} {'detect s':>9} {'rejoin s':>9} "
          f"{'surv. lost':>10} {'surv. pause s':>13}")
    for kind_rows in zip(*(results[p] for p in policies), strict=True):
        for f in kind_rows:
            print(f"{f['kind']:<10} {f['policy']:<14} {f['detected']!s:>8} {f['culprit_correct']!s:>8} "
                  f"{f['time_to_detect_s']!s:>9} {f['time_to_rejoin_s']!s:>9} {f['survivor_lost_steps']!s:>10} "
                  f"{f['survivor_max_pause_s']!s:>13}")
    for policy, e in ettr.items():
        print(f"ETTR {policy}: {e.get('ettr')} ({e.get('faults')} kills, one every {args.fault_every_s:g} s)")
    print(f"steady_step_ratio (live pace / evict_restart pace, fault-free): {out['steady_step_ratio']}; "
          f"with a quorum at every step: {out['steady_step_ratio_quorum_every_step']}")
    return 0


def _steady(r: Any, steps: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Fault-free jobs, taken in turn ``repeats`` times (the machine's load drifts): live at the default
    ``recovery.quorum_every_steps``, live with a quorum at every step, evict_restart. Each keeps its fastest
    run (the least disturbed by other load) and lists every run's pace."""
    runs: dict[str, list[dict[str, Any]]] = {"live": [], "live_every_step": [], "evict_restart": []}
    for _ in range(max(1, repeats)):
        runs["live"].append(r.steady("live", steps))
        runs["live_every_step"].append(r.steady("live", steps, quorum_every=1))
        runs["evict_restart"].append(r.steady("evict_restart", steps))
    out = {}
    for name, rs in runs.items():
        timed = [x for x in rs if x.get("pace_s")]
        best = min(timed, key=lambda x: x["pace_s"]) if timed else rs[0]
        out[name] = {**best, "paces_s": [x.get("pace_s") for x in rs]}
    return out


def _ratio(steady: dict[str, dict[str, Any]], live_key: str = "live") -> float | None:
    """A live job's steady pace over the evict_restart job's (None if either has none)."""
    live, base = (steady.get(p, {}).get("pace_s") for p in (live_key, "evict_restart"))
    return round(live / base, 3) if live and base else None


if __name__ == "__main__":
    sys.exit(main())
