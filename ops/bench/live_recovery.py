"""``vigil bench recovery --policy live``: the same faults under live recovery and under today's restart.

Live recovery (``recovery.policy: live``, :mod:`vigil.live`): every rank is a torchft replica; a failed
one is replaced and heals from a live peer while the others train on. Each fault kind runs on a 2-rank
job under live and, beside it on the same cluster, under evict_restart (``--no-baseline``: live alone),
a checkpoint every 10 steps for both, and reports per fault:

- ``time_to_detect_s``: fault fired -> the controller's incident; ``culprit_correct``: it names the rank
  (and node) the fault hit (the node, for a node lost);
- ``time_to_rejoin_s``: fault fired -> the replaced rank stepping again with the others (live: the first
  step of the rank after a pause of its own; restart: the first step of the restarted group);
- ``survivor_lost_steps``: steps the surviving rank ran again (its step before the fault minus the first
  step it ran after it, plus one; 0 when its step counter went on); ``survivor_max_pause_s``: the longest
  pause in its steps from the fault until the rank was back.

And ETTR for a long job with a ``kill_rank`` every ``--fault-every-s`` seconds (alternating ranks): the
time its unique steps would take at its own steady pace (the mean time from one step to the next, outages
left out) over its wall time from first step to last, for each policy; ``replica_step_ratio`` (live): the share of the ranks' steps run while
some rank was missing is what ETTR does not show, so the ranks' step samples over (ranks x steps).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import statistics
import time
from typing import Any

from ops.bench.faultrun import FaultRun
from ops.bench.faultrun import parse_ts as _ts
from vigil.contract.probe import poll
from vigil.contract.schemas import JobCreate

log = logging.getLogger("vigil.bench.live_recovery")

LIVE_FAULTS = ("kill_rank", "kill_9", "hang_rank", "slow_rank", "kill_node")
"""The faults the issue asks of live recovery: a rank killed from inside and from outside, a hang, a 2x
straggler, a node lost."""
EXPECTED = {"kill_rank": "rank_died", "kill_9": "rank_died", "hang_rank": "hang", "slow_rank": "straggler",
            "kill_node": "node_lost"}
OUTAGE_X = 5.0
"""ETTR: a gap between consecutive steps over this many times the median gap is an outage."""
REJOIN_GAP_S = 2.5
"""A pause this long in a rank's own steps is its process restarting (the controller's rule too:
``controller.recovery.detectors.LIVE_REJOIN_GAP_S``)."""


def spec(name: str, steps: int, policy: str, *, batch: int = 32, ckpt: int = 10,
         quorum_every: int | None = None, spares: int = 0) -> JobCreate:
    """The GPT example, 2 ranks. Live: a quorum of 1 (the survivor trains on alone while the other heals);
    ``quorum_every``: ``recovery.quorum_every_steps`` (None: the default); ``spares``: ``recovery.spares``."""
    live = policy == "live"
    every = {} if quorum_every is None else {"quorum_every_steps": quorum_every}
    if live and spares:
        every["spares"] = spares
    return JobCreate.model_validate({
        "name": name,
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64},
        "data": {"max_bytes": 300_000},
        "optimizer": {"kind": "adamw", "lr": 0.01},
        "scaling": {"min_workers": 1 if live else 2, "max_workers": 2, "cpus_per_worker": 1},
        "steps": steps, "batch_size": batch,
        "lr_schedule": {"kind": "constant"},
        "checkpoint": {"interval_steps": ckpt, "keep_last": 3},
        "recovery": {"policy": policy, "max_restarts": 5, **every},
    })


class Series:
    """Each rank's (step, ts) rows of a job, in the order they ran."""

    def __init__(self, run: FaultRun, job_id: str) -> None:
        self.by_rank: dict[int, list[tuple[float, int, float]]] = {}
        for s in run.client.job_metrics(job_id, max_points=100_000).ranks:
            self.by_rank[s.rank] = sorted(zip(s.ts, s.step, s.step_time_s, strict=True))
        raw = run.client.job_collectives(job_id, ops=["heal"], raw=True).raw or []
        self.heals: list[tuple[float, int]] = sorted((c.ts, c.rank) for c in raw)
        """(ts, rank) of each replacement's heal (``op=heal``): a warm spare comes back without a pause."""

    def rank(self, r: int) -> list[tuple[float, int, float]]:
        return self.by_rank.get(r, [])

    def rejoin(self, r: int, since: float) -> float | None:
        """Rank ``r``'s replacement stepping: its first step from its first heal after ``since`` on (live), else
        the first step of rank ``r`` after ``since`` that follows a pause of its own (a new process)."""
        heal = next((ts for ts, rank in self.heals if rank == r and ts > since), None)
        if heal is not None:
            return next((ts for ts, _, _ in self.rank(r) if ts >= heal), None)
        prev = since  # (after a restart the metrics may hold the new run's rows only)
        for ts, _, _ in self.rank(r):
            if ts > since and ts - prev > REJOIN_GAP_S:
                return ts
            prev = max(prev, ts) if ts <= since else ts
        return None

    def lost_and_pause(self, r: int, fired: float, until: float | None, before: int | None) -> tuple[int | None, float]:
        """(steps rank ``r`` ran again after ``fired``, its longest pause from then until ``until``)."""
        rows = self.rank(r)
        own_before = max((st for ts, st, _ in rows if ts <= fired), default=None)
        start = before if before is not None else own_before
        after = [st for ts, st, _ in rows if ts > fired]
        lost = max(0, start - min(after) + 1) if start is not None and after else None
        times = [ts for ts, _, _ in rows if ts <= (until or float("inf"))]
        last_before = max((t for t in times if t <= fired), default=fired)
        later = [t for t in times if t > fired]
        pause = max((b - a for a, b in zip([last_before, *later], later, strict=False)), default=0.0)
        return lost, round(pause, 2)

    def job_ettr(self) -> dict[str, Any]:
        """ETTR of the job's step counter (per step, the first time any rank finished it): its unique steps
        at its own steady pace over its wall time. The pace is the mean time from one step to the next,
        leaving out the outages (gaps over :data:`OUTAGE_X` times the median); measured between steps,
        not from the ranks' step timers, because under live recovery each step also waits for its quorum,
        outside the timer: a steady-state cost, not a loss."""
        first: dict[int, float] = {}
        for rows in self.by_rank.values():
            for ts, st, _ in rows:
                first[st] = min(first.get(st, ts), ts)
        if len(first) < 3:
            return {"ettr": None}
        order = sorted(first.items())
        gaps = [b[1] - a[1] for a, b in itertools.pairwise(order) if b[0] == a[0] + 1 and b[1] > a[1]]
        limit = OUTAGE_X * statistics.median(gaps)
        steady = [g for g in gaps if g <= limit]  # longer: an outage, which is what ETTR counts
        pace = sum(steady) / len(steady)
        ts_sorted = sorted(first.values())
        wall = ts_sorted[-1] - ts_sorted[0] + pace
        samples = sum(len(rows) for rows in self.by_rank.values())
        step_times = [dt for rows in self.by_rank.values() for _, _, dt in rows]
        return {"ettr": round(min(1.0, pace * len(first) / wall), 3), "steps": len(first), "wall_s": round(wall, 1),
                "pace_s": round(pace, 4), "median_step_s": round(statistics.median(step_times), 4),
                "replica_step_ratio": round(samples / (max(1, len(self.by_rank)) * len(first)), 3)}


class LiveRunner(FaultRun):
    """One fault on a fresh 2-rank job of a policy; the cluster's evicted node readmitted afterwards.
    ``spares``: the live jobs' ``recovery.spares`` (the steady-state jobs have none)."""

    spares = 0

    def run_fault(self, kind: str, policy: str, steps: int, at: int, slow_factor: float = 2.0) -> dict[str, Any]:
        slow = kind == "slow_rank"  # ~0.2 s steps, so a 2x slower compute stands out of the noise
        job = self.client.submit_job(spec(f"bench-{policy}-{kind}", steps // 3 if slow else steps, policy,
                                          batch=96 if slow else 32, spares=self.spares))
        out: dict[str, Any] = {"kind": kind, "policy": policy, "job_id": job.id, "detected": False,
                               "culprit_correct": False, "time_to_detect_s": None, "time_to_rejoin_s": None,
                               "survivor_lost_steps": None, "survivor_max_pause_s": None}
        if not self.reach(job.id, at):
            out["error"] = "job did not reach the fault step"
            return out
        target, survivor = 1, 0
        loc = self.rank_location(job.id, target)
        if loc is None:
            out["error"] = "rank not found"
            return out
        node, pid = loc
        fault_step = self.last_step(job.id)
        fired = time.time()
        if kind == "kill_9":
            os.kill(pid, signal.SIGKILL)
        else:
            body: dict[str, Any] = {"kind": kind, "rank": target, "step": 0}
            if kind == "slow_rank":
                body["params"] = {"factor": slow_factor, "mode": "compute"}
            if kind == "kill_node":
                body = {"kind": kind, "node_id": node, "step": 0}
            self.inject(job.id, body)
            fault = poll(lambda: next((f for f in self.faults(job.id) if f["fired_at"]), None), 60, 0.5)
            if fault:
                fired = _ts(fault["fired_at"]) or fired
        expected = EXPECTED[kind]
        inc = poll(lambda: next((i for i in self.incidents(job.id) if i["kind"] == expected
                                 and (expected != "hang" or i["rank"] is not None)), None), 180, 0.5)
        out["status"] = self.finish(job.id)
        if inc is not None:
            out["detected"] = True
            out["time_to_detect_s"] = round((_ts(inc["detected_at"]) or fired) - fired, 2)
            out["culprit_correct"] = (inc["node_id"] == node if expected == "node_lost"
                                      else inc["rank"] == target and inc["node_id"] == node)
            out["action"] = inc.get("action")
        series = Series(self, job.id)
        if policy == "live":
            back = series.rejoin(target, fired)
        else:  # the restarted group's first step: the survivor's steps go back or pause
            back = series.rejoin(survivor, fired)
        out["time_to_rejoin_s"] = round(back - fired, 2) if back is not None else None
        lost, pause = series.lost_and_pause(survivor, fired, back, None if policy == "live" else fault_step)
        out["survivor_lost_steps"], out["survivor_max_pause_s"] = lost, pause
        self.readmit_evicted()
        return out

    def readmit_evicted(self) -> None:
        for n in self.client.list_nodes().data:
            if n.state.value == "EVICTED":
                self.client.readmit_node(n.id)
                poll(lambda n=n: any(x.id == n.id and x.state.value == "ALIVE"
                                     for x in self.client.list_nodes().data), 60)
                time.sleep(10)  # the fresh raylet registers with Ray

    def restart_node_processes(self) -> None:
        """A killed node's raylet and agent started again as ``vigil up`` started them (the next fault needs
        the whole cluster), then until Ray and Vigil both have it."""
        from ops.bench.faultrun import node_index, ray_alive_nodes, with_ray_start_pid

        alive = ray_alive_nodes(self.cluster.dashboard_url)
        from ops.localcluster import node_name

        for name in (n for n in self.cluster.node_ids if n != node_name(0)):
            if name in alive:
                continue
            idx = node_index(name)
            raylet = self.start_again(f"ray-node-{idx}")
            self.start_again(f"agent-{idx}", lambda argv, pid=raylet.proc.pid: with_ray_start_pid(argv, pid))

        def whole() -> bool:
            now = ray_alive_nodes(self.cluster.dashboard_url)
            return all(n.state.value == "ALIVE" and n.id in now for n in self.client.list_nodes().data)

        if not poll(whole, 180, 2.0, (Exception,)):
            log.warning("not every node came back within 180 s")

    def steady(self, policy: str, steps: int, quorum_every: int | None = None) -> dict[str, Any]:
        """A fault-free job of ``steps`` under ``policy``: its steady pace (mean time from one step to the next,
        outages left out: :meth:`Series.job_ettr`). Under live a step may also wait for a quorum."""
        job = self.client.submit_job(spec(f"bench-steady-{policy}", steps, policy, quorum_every=quorum_every))
        status = self.finish(job.id, timeout=600)
        time.sleep(3)  # the agents' last batches
        out = Series(self, job.id).job_ettr()
        return {"policy": policy, "quorum_every_steps": job.spec.recovery.quorum_every_steps if policy == "live"
                else None, "job_id": job.id, "status": status, "steps": out.get("steps"), "pace_s": out.get("pace_s"),
                "median_step_s": out.get("median_step_s")}

    def ettr(self, policy: str, minutes: float, fault_every_s: float) -> dict[str, Any]:
        """A long job (cancelled after ``minutes``) with a kill_rank every ``fault_every_s`` of training."""
        job = self.client.submit_job(spec(f"bench-ettr-{policy}", 10_000_000, policy, ckpt=100, spares=self.spares))
        if not self.reach(job.id, 5, timeout=300):
            return {"ettr": None, "error": "job did not start"}
        end = time.time() + minutes * 60
        faults = 0
        next_fault = time.time() + fault_every_s
        while time.time() < end:
            if time.time() >= next_fault:
                self.inject(job.id, {"kind": "kill_rank", "rank": faults % 2, "step": 0})
                faults += 1
                next_fault += fault_every_s
            time.sleep(0.5)
        self.client.cancel_job(job.id)
        self.finish(job.id, timeout=120)
        time.sleep(3)  # the agents' last batches
        out = Series(self, job.id).job_ettr()
        return {**out, "policy": policy, "faults": faults, "fault_every_s": fault_every_s, "minutes": minutes}
