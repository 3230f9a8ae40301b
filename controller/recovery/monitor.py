"""The monitor: fires injected faults, runs the detectors, and applies each job's recovery policy.

``Monitor.step()`` is one pass (tests drive it one iteration at a time); the controller runs it in
a background thread every ``interval`` seconds. Every finding is an :class:`Incident` with its
evidence (the numbers that triggered it), its suspect node and/or rank, and the times it was
detected, acted on and recovered. Thresholds are per job (``recovery.params`` is not in the spec
yet: :class:`Thresholds` holds the documented defaults, see docs/RECOVERY.md).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controller.background import BackgroundLoop
from controller.db import session_scope
from controller.jobs import record_event, transition
from controller.launcher import ClusterControl, JobLauncher, LaunchError
from controller.models import Checkpoint, CollectiveMetric, Incident, Job, Node, StackDump, StepMetric
from controller.recovery import commands, faults, nic
from controller.recovery.stacks import group_stacks
from controller.schemas import (
    CommandKind,
    IncidentKind,
    IncidentStatus,
    JobCreate,
    JobStatus,
    NodeState,
    RecoveryPolicy,
)

log = logging.getLogger(__name__)

LIVE_INCIDENT = (IncidentStatus.OPEN.value, IncidentStatus.ACTING.value)


@dataclass(frozen=True)
class Thresholds:
    """Detection thresholds (defaults documented in docs/RECOVERY.md)."""

    node_timeout_s: float = 4.0  # no heartbeat for this long: node lost
    death_grace_s: float = 1.5  # after a rank is seen dead, wait this long for the other agents' reports
    hang_k: float = 10.0  # hang: no new step for max(hang_k x median step time, hang_floor_s)
    hang_floor_s: float = 15.0
    stack_wait_s: float = 10.0  # how long to wait for py-spy stacks before acting without them
    straggler_ratio: float = 1.7  # straggler: over the last m scored steps, a rank's median compute this
    #   many times its peers' median ...
    straggler_own_ratio: float = 1.4  # ... and this many times its own recent median ...
    straggler_step_ratio: float = 1.2  # ... slower than its peers by this much in at least k of those steps ...
    straggler_k: int = 6
    straggler_m: int = 10
    straggler_min_excess_s: float = 0.025  # ... and its compute exceeds its peers' by this much ...
    straggler_min_share: float = 0.25  # ... and by this share of the median step time
    checkpoint_settle_s: float = 0.25  # straggler scoring resumes this long after a checkpoint completes
    spike_ratio: float = 3.0  # loss above this x the median of the recent window: a spike
    drain_deadline_s: float = 5.0  # eviction: ranks on the node get this long to checkpoint
    restart_gap_s: float = 5.0  # a pause this long in a job's steps after an action counts as its restart


class Monitor(BackgroundLoop):
    def __init__(
        self,
        sessions: sessionmaker[Session],
        launcher: JobLauncher | None = None,
        cluster: ClusterControl | None = None,
        interval: float = 1.0,
        thresholds: Thresholds | None = None,
        clock=time.time,  # type: ignore[no-untyped-def]
    ) -> None:
        self.sessions = sessions
        self.launcher = launcher
        self.cluster = cluster
        self.interval = interval
        self.th = thresholds or Thresholds()
        self.clock = clock
        super().__init__()
        self._nic = nic.NicDetector()  # NIC detector hook (issue 6): keeps each node's heartbeat history

    # -- one pass ---------------------------------------------------------------------------------
    def step(self) -> None:
        now = self.clock()
        with session_scope(self.sessions) as s:
            faults.fire_due(s)
            self._detect_nodes(s, now)
            for job in s.scalars(select(Job).where(Job.status == JobStatus.RUNNING.value)).all():
                spec = JobCreate.model_validate(job.spec)
                self._detect_rank_death(s, job, spec)
                self._detect_loss(s, job, spec)
                self._detect_hang(s, job, spec, now)
                self._detect_stragglers(s, job, spec)
                self._detect_nic(s, job, spec, now)  # NIC detector hook (issue 6)
                self._follow(s, job, spec, now)
            faults.clear_for_ended_jobs(s)
            self._close_ended(s)

    # -- detectors --------------------------------------------------------------------------------
    def _detect_nodes(self, s: Session, now: float) -> None:
        # A node that is heard from again closes its open node_lost incident (a late heartbeat, or a
        # host that came back); one whose job was restarted elsewhere is followed by _follow.
        for inc in s.scalars(select(Incident).where(Incident.kind == IncidentKind.NODE_LOST.value,
                                                    Incident.status == IncidentStatus.OPEN.value)).all():
            node = s.get(Node, inc.node_id) if inc.node_id else None
            if node is not None and node.state == NodeState.ALIVE.value:
                inc.status = IncidentStatus.CLOSED.value
                inc.action = (inc.action or "") + "heartbeats resumed"
        for node in s.scalars(select(Node).where(Node.state == NodeState.ALIVE.value)).all():
            if node.last_heartbeat is None:
                continue
            age = now - node.last_heartbeat.timestamp()
            if age <= self.th.node_timeout_s:
                continue
            node.state = NodeState.DEAD.value
            record_event(s, "node_dead", f"no heartbeat from {node.id} for {age:.1f}s", node_id=node.id)
            jobs = {r.get("job_id") for r in node.ranks or []}
            running = [j for j in jobs if j and (job := s.get(Job, j)) and job.status == JobStatus.RUNNING.value]
            for job_id in running or [None]:
                ranks = sorted(int(r["rank"]) for r in node.ranks or [] if r.get("job_id") == job_id)
                inc = self._open(s, IncidentKind.NODE_LOST, job_id, node.id, ranks[0] if len(ranks) == 1 else None,
                                 {"heartbeat_age_s": round(age, 2), "timeout_s": self.th.node_timeout_s,
                                  "ranks": ranks})
                if job_id:
                    self._act(s, inc, s.get(Job, job_id), "Ray Train restarts the worker group without the node")

    def _detect_rank_death(self, s: Session, job: Job, spec: JobCreate) -> None:
        if self._live_any(s, job.id):
            return  # a worker group being torn down for a recovery loses every rank: not new findings
        if job.last_step is not None and job.last_step >= spec.steps:
            return  # the job is finishing: its ranks exit
        dead = {rank: loc for rank, loc in faults.rank_locations(s, job.id).items() if not loc.alive}
        for rank, loc in list(dead.items()):
            seen = s.scalar(select(Incident.id).where(
                Incident.job_id == job.id, Incident.kind == IncidentKind.RANK_DIED.value,
                Incident.rank == rank, Incident.evidence["pid"].as_integer() == loc.pid))
            if seen is not None:
                return  # this death is already an incident; the rest of its group went down after it
        if not dead:
            return
        # When one rank dies, Ray Train takes the rest of the group down after it: the culprit is the
        # rank whose death was seen first. Wait a moment for every agent to report before naming it.
        first_rank, first = min(dead.items(), key=lambda kv: (kv[1].dead_since or float("inf"), kv[0]))
        if first.dead_since is not None and self.clock() - first.dead_since < self.th.death_grace_s:
            return
        inc = self._open(s, IncidentKind.RANK_DIED, job.id, first.node_id, first_rank, {
            "pid": first.pid, "last_step": job.last_step, "dead_since": first.dead_since,
            "also_dead": {str(r): loc.dead_since for r, loc in dead.items() if r != first_rank}})
        self._act(s, inc, job, "Ray Train restarts the worker group from the newest valid checkpoint")

    def _detect_loss(self, s: Session, job: Job, spec: JobCreate) -> None:
        if self._live(s, job.id, IncidentKind.NAN_LOSS):
            return
        recent = s.execute(
            select(StepMetric.rank, StepMetric.step, StepMetric.loss, StepMetric.ts)
            .where(StepMetric.job_id == job.id).order_by(StepMetric.id.desc()).limit(200)
        ).all()
        if not recent:
            return
        since = self._last_action_ts(s, job.id)
        bad = [r for r in recent if r.loss is None and r.ts > since]
        if bad:
            first = min(bad, key=lambda r: (r.step, r.rank))
            inc = self._open(s, IncidentKind.NAN_LOSS, job.id, None, first.rank,
                             {"step": first.step, "ranks": sorted({r.rank for r in bad}), "loss": None})
            if spec.recovery.policy in (RecoveryPolicy.ROLLBACK, RecoveryPolicy.EVICT_RESTART):
                self._restart_job(s, inc, job, "rollback: restart every rank from the last checkpoint before the NaN")
            return
        finite = [r.loss for r in recent if r.loss is not None]
        if len(finite) >= 50 and not self._live(s, job.id, IncidentKind.LOSS_SPIKE):
            newest = recent[0]
            base = statistics.median(finite[5:])
            if newest.loss is not None and base > 0 and newest.loss > self.th.spike_ratio * base:
                self._open(s, IncidentKind.LOSS_SPIKE, job.id, None, newest.rank,
                           {"step": newest.step, "loss": newest.loss, "median": base})

    def _detect_hang(self, s: Session, job: Job, spec: JobCreate, now: float) -> None:
        live = self._live(s, job.id, IncidentKind.HANG)
        if live is not None:
            self._diagnose_hang(s, job, spec, live, now)
            return
        if self._live_any(s, job.id):
            return  # a recovery is under way: its restart is not a hang
        if job.last_step is not None and job.last_step >= spec.steps:
            return  # the last step is done: the ranks are saving and exiting
        last_ts = s.scalar(select(func.max(StepMetric.ts)).where(StepMetric.job_id == job.id))
        if last_ts is None:
            return
        times = s.scalars(select(StepMetric.step_time_s).where(StepMetric.job_id == job.id)
                          .order_by(StepMetric.id.desc()).limit(100)).all()
        median = statistics.median(times) if times else 0.0
        limit = max(self.th.hang_k * median, self.th.hang_floor_s)
        idle = now - last_ts
        if idle <= limit:
            return
        inc = self._open(s, IncidentKind.HANG, job.id, None, None,
                         {"idle_s": round(idle, 2), "limit_s": round(limit, 2), "median_step_s": round(median, 4),
                          "last_step": job.last_step})
        locs = faults.rank_locations(s, job.id)
        by_node: dict[str, dict[str, int]] = defaultdict(dict)
        for rank, loc in locs.items():
            by_node[loc.node_id][str(rank)] = loc.pid
        for node_id, pids in by_node.items():
            commands.enqueue(s, node_id, CommandKind.PYSPY_DUMP, {"job_id": job.id, "pids": pids}, job_id=job.id,
                             incident_id=inc.id)
        inc.action = "collecting py-spy stacks of every rank"

    def _diagnose_hang(self, s: Session, job: Job, spec: JobCreate, inc: Incident, now: float) -> None:
        if inc.status != IncidentStatus.OPEN.value:
            return
        dumps = s.scalars(select(StackDump).where(StackDump.incident_id == inc.id)).all()
        expected = len(faults.rank_locations(s, job.id))
        waited = now - inc.detected_at.timestamp()
        if len({d.rank for d in dumps}) < expected and waited < self.th.stack_wait_s:
            return
        stacks = {d.rank: d.stack for d in dumps}
        groups, odd = group_stacks(stacks)
        locs = faults.rank_locations(s, job.id)
        inc.evidence = {**inc.evidence, "stack_groups": [{"ranks": g.ranks, "signature": g.signature} for g in groups],
                        "odd_ranks": odd, "stacks_from": sorted(stacks)}
        if len(odd) == 1:
            inc.rank = odd[0]
            inc.node_id = locs[odd[0]].node_id if odd[0] in locs else None
        if spec.recovery.policy == RecoveryPolicy.OBSERVE:
            inc.action = "observe: stacks collected, no action"
            return
        victims = odd or sorted(locs)
        evicted = ""
        if inc.node_id and spec.recovery.policy == RecoveryPolicy.EVICT_RESTART:
            evicted = (f", evicted {inc.node_id}" if self._evict(s, inc.node_id, f"hang of job {job.id} (rank {inc.rank})",
                                                                inc) else f", {inc.node_id} is the Ray head: not evicted")
        for rank in victims:
            if rank in locs:
                commands.enqueue(s, locs[rank].node_id, CommandKind.KILL_PID, {"pid": locs[rank].pid, "signal": 9},
                                 job_id=job.id, incident_id=inc.id)
        self._act(s, inc, job, f"killed hung rank(s) {victims}{evicted}; Ray Train restarts the group")

    def _detect_stragglers(self, s: Session, job: Job, spec: JobCreate) -> None:
        if self._live_any(s, job.id):
            return
        th = self.th
        rows = s.execute(
            select(StepMetric.rank, StepMetric.step, StepMetric.fwd_bwd_s, StepMetric.step_time_s, StepMetric.ts)
            .where(StepMetric.job_id == job.id).order_by(StepMetric.id.desc()).limit(th.straggler_m * 3 * 64)
        ).all()
        by_step: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
        step_ts: dict[int, float] = {}
        for r in rows:  # newest first: after a restart, a replayed step keeps the new incarnation's row
            by_step[r.step].setdefault(r.rank, (r.fwd_bwd_s or 0.0, r.step_time_s or 0.0))
            step_ts.setdefault(r.step, r.ts)
        busy = self._checkpoint_busy(s, job.id, spec.checkpoint.interval_steps)
        steps = sorted((st for st, ranks in by_step.items() if len(ranks) >= 2 and not busy(st, step_ts[st])),
                       reverse=True)[: th.straggler_m]
        if len(steps) < th.straggler_m:
            return
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
            # Individual score: slower than this rank's own recent past too. A rank that was always a
            # little behind its peers (a busier host, say) is an imbalance, not a new straggler.
            history = s.scalars(
                select(StepMetric.fwd_bwd_s).where(StepMetric.job_id == job.id, StepMetric.rank == rank,
                                                   StepMetric.step < steps[-1], StepMetric.fwd_bwd_s.is_not(None))
                .order_by(StepMetric.step.desc()).limit(50)).all()
            if len(history) < th.straggler_m:
                continue
            own = statistics.median(window) / max(statistics.median(history), 1e-9)
            if own < th.straggler_own_ratio:
                continue
            # And slower by a margin that matters: on a busy host a few-millisecond compute phase
            # doubles from scheduling noise alone. The excess must be a real share of the step.
            step_median = statistics.median(t for st in steps for _, t in by_step[st].values())
            excess = statistics.median(window) - peer_window
            if excess < max(th.straggler_min_excess_s, th.straggler_min_share * step_median):
                continue
            loc = faults.rank_locations(s, job.id).get(rank)
            inc = self._open(s, IncidentKind.STRAGGLER, job.id, loc.node_id if loc else None, rank, {
                "class": "compute-slow", "slow_steps": len(ratios), "window": th.straggler_m,
                "median_ratio_to_peers": round(to_peers, 3), "threshold": th.straggler_ratio,
                "step_threshold": th.straggler_step_ratio, "own_threshold": th.straggler_own_ratio,
                "ratio_to_own_history": round(own, 3), "excess_s": round(excess, 4),
                "steps": [steps[-1], steps[0]]})
            if spec.recovery.policy == RecoveryPolicy.EVICT_RESTART and inc.node_id:
                if self._evict(s, inc.node_id, f"straggler rank {rank} of job {job.id}", inc):
                    self._act(s, inc, job, f"evicted {inc.node_id}; Ray Train restarts the group on healthy nodes")
                else:
                    self._head_kept(inc)
            return
        self._detect_late_rank(s, job, spec, steps)

    def _detect_late_rank(self, s: Session, job: Job, spec: JobCreate, steps: list[int]) -> None:
        """Straggler score on collective wait: a rank whose peers wait for it in the step's collectives.

        The compute score above sees a slow forward+backward; a rank can be late for the rest of its
        step too (a data loader starved of I/O, a slow optimizer step, a host stalling the process).
        Then it arrives last at every collective: its peers' wait (their duration of a call minus the
        fastest rank's) grows by its lateness while its own stays near 0 (C4's "non-communication
        slow"). Per step, lateness = median of the peers' wait - the rank's own wait, over its peers'
        work outside collectives (step time - comm). The verdict mirrors the compute score's:
        late by ``straggler_step_ratio`` in ``straggler_k`` of the window's steps, by
        ``straggler_ratio`` in the window's median, its own work ``straggler_own_ratio`` x its recent
        past, and by at least ``straggler_min_excess_s`` and ``straggler_min_share`` of the step.
        """
        th = self.th
        # Bounded like the compute score's read (up to 64 ranks, here with up to 32 calls per step): a
        # job beyond that is not scored on wait in this pass rather than read whole every 0.5 s.
        cap = th.straggler_m * 64 * 32
        calls = s.execute(select(CollectiveMetric.rank, CollectiveMetric.step, CollectiveMetric.seq,
                                 CollectiveMetric.duration_s)
                          .where(CollectiveMetric.job_id == job.id, CollectiveMetric.step.in_(steps))
                          .limit(cap + 1)).all()
        if len(calls) > cap:
            return
        work_rows = s.execute(select(StepMetric.rank, StepMetric.step, StepMetric.step_time_s,
                                     StepMetric.comm_s)
                              .where(StepMetric.job_id == job.id, StepMetric.step.in_(steps))
                              .order_by(StepMetric.id.desc())).all()
        work: dict[int, dict[int, float]] = defaultdict(dict)
        step_time: dict[int, dict[int, float]] = defaultdict(dict)
        for r in work_rows:  # newest first: a replayed step keeps the new incarnation's row
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
            fastest = min(per_rank.values())
            for rank, d in per_rank.items():
                wait[st][rank] += d - fastest
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
            return
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
            history = [t - (c or 0.0) for t, c in s.execute(
                select(StepMetric.step_time_s, StepMetric.comm_s).where(
                    StepMetric.job_id == job.id, StepMetric.rank == rank, StepMetric.step < steps[-1])
                .order_by(StepMetric.step.desc()).limit(50)).all()]
            if len(history) < th.straggler_m:
                continue
            own = statistics.median(window) / max(statistics.median(history), 1e-9)
            if own < th.straggler_own_ratio:
                continue
            loc = faults.rank_locations(s, job.id).get(rank)
            inc = self._open(s, IncidentKind.STRAGGLER, job.id, loc.node_id if loc else None, rank, {
                "class": "compute-slow", "basis": "collective-wait",
                "late_steps": hits, "window": th.straggler_m,
                "median_ratio_to_peers": round(to_peers, 3), "threshold": th.straggler_ratio,
                "peers_wait_s": round(lateness, 4), "ratio_to_own_history": round(own, 3),
                "steps": [steps[-1], steps[0]]})
            if spec.recovery.policy == RecoveryPolicy.EVICT_RESTART and inc.node_id:
                why = f"straggler rank {rank} of job {job.id} (its peers wait for it)"
                if self._evict(s, inc.node_id, why, inc):
                    self._act(s, inc, job, f"evicted {inc.node_id}; Ray Train restarts the group on healthy nodes")
                else:
                    self._head_kept(inc)
            return

    def _checkpoint_busy(self, s: Session, job_id: str, interval: int) -> Callable[[int, float], bool]:
        """Whether a step (number, time) falls in a checkpoint's shadow, where it is not scored.

        The rank that writes a checkpoint (rank 0 computes the manifest's checksums, an async save runs
        beside the next steps) is busy on purpose and must not look like a straggler. A step is in the
        shadow when it is within a third of the interval after a checkpoint step, unless that checkpoint
        is known complete (its sample's time) more than ``checkpoint_settle_s`` before the step ran.
        """
        if interval <= 1:
            return lambda st, ts: False
        done = {step: (c if c.tzinfo else c.replace(tzinfo=UTC)).timestamp() for step, c in s.execute(
            select(Checkpoint.step, Checkpoint.created_at).where(Checkpoint.job_id == job_id)).all()}
        settle = self.th.checkpoint_settle_s

        def busy(st: int, ts: float) -> bool:
            if st % interval > interval // 3:
                return False
            finished = done.get(st - st % interval)
            return finished is None or ts <= finished + settle

        return busy

    # -- NIC detector hook (controller/recovery/nic.py, issue 6) -------------------------------------
    def _detect_nic(self, s: Session, job: Job, spec: JobCreate, now: float) -> None:
        try:
            findings = self._nic.detect(s, job, now)  # always: it keeps the history
        except Exception:  # a bug there must not cost the other detectors their pass
            log.exception("NIC detector failed for job %s", job.id)
            return
        if self._live_any(s, job.id):
            return
        for f in nic.incidents(findings):
            inc = self._open(s, f.kind, job.id, f.node_id, f.rank, f.evidence)
            if spec.recovery.policy == RecoveryPolicy.EVICT_RESTART:
                if self._evict(s, f.node_id, f"{f.cls} NIC of job {job.id}", inc):
                    self._act(s, inc, job, f"evicted {f.node_id}; Ray Train restarts the group on healthy nodes")
                else:
                    self._head_kept(inc)
            return

    # -- follow-up: recovered? bounded restarts --------------------------------------------------------
    def _follow(self, s: Session, job: Job, spec: JobCreate, now: float) -> None:
        for inc in s.scalars(select(Incident).where(Incident.job_id == job.id,
                                                    Incident.status == IncidentStatus.ACTING.value)).all():
            assert inc.acted_at is not None
            restart_ts = self._restart_seen(s, job.id, inc.acted_at.timestamp())
            if restart_ts is None:
                continue
            inc.status = IncidentStatus.RECOVERED.value
            inc.recovered_at = datetime.fromtimestamp(restart_ts, UTC)
            job.restarts += 1
            progressed = job.progress_mark is None or (job.last_step or 0) > job.progress_mark
            job.stalled_restarts = 0 if progressed else job.stalled_restarts + 1
            job.progress_mark = max(job.progress_mark or 0, inc.step_at_detect or 0)
            record_event(s, "incident_recovered", f"{inc.kind}: job resumed after restart {job.restarts}",
                         job_id=job.id, node_id=inc.node_id, data={"incident_id": inc.id})
            if job.stalled_restarts >= max(1, spec.recovery.max_restarts):
                self._fail(s, job, f"no progress across {job.stalled_restarts} restarts")

    def _restart_seen(self, s: Session, job_id: str, since: float) -> float | None:
        """Time of the first step after ``since`` that shows the worker group restarted.

        A restart resumes from a checkpoint, so a rank's step number goes back (or repeats); a
        restart right after a checkpoint at the last step shows as a pause in the steps instead.
        """
        before = s.scalar(select(func.max(StepMetric.step)).where(StepMetric.job_id == job_id, StepMetric.rank == 0,
                                                                   StepMetric.ts <= since))
        rows = s.execute(select(StepMetric.step, StepMetric.ts).where(
            StepMetric.job_id == job_id, StepMetric.rank == 0, StepMetric.ts > since).order_by(StepMetric.ts)).all()
        prev_step = before if before is not None else -1
        prev_ts = since
        for r in rows:
            if r.step <= prev_step or r.ts - prev_ts > self.th.restart_gap_s:
                return r.ts
            prev_step, prev_ts = r.step, r.ts
        return None

    def _close_ended(self, s: Session) -> None:
        rows = s.scalars(select(Incident).join(Job, Job.id == Incident.job_id).where(
            Incident.status.in_(LIVE_INCIDENT), Job.status.in_([x.value for x in JobStatus if x.is_terminal()]))).all()
        for inc in rows:
            job = s.get(Job, inc.job_id)
            if job is not None and job.status == JobStatus.SUCCEEDED.value and inc.status == IncidentStatus.ACTING.value:
                inc.status = IncidentStatus.RECOVERED.value
                inc.recovered_at = inc.recovered_at or job.finished_at
            else:
                inc.status = IncidentStatus.CLOSED.value

    # -- actions ----------------------------------------------------------------------------------
    def _open(self, s: Session, kind: IncidentKind, job_id: str | None, node_id: str | None, rank: int | None,
              evidence: dict) -> Incident:
        job = s.get(Job, job_id) if job_id else None
        inc = Incident(job_id=job_id, kind=kind.value, status=IncidentStatus.OPEN.value, node_id=node_id, rank=rank,
                       evidence=evidence, step_at_detect=job.last_step if job else None,
                       detected_at=datetime.fromtimestamp(self.clock(), UTC))
        s.add(inc)
        s.flush()
        where = ", ".join(x for x in (f"node {node_id}" if node_id else "", f"rank {rank}" if rank is not None else "")
                          if x)
        record_event(s, "incident", f"{kind.value} detected" + (f" ({where})" if where else ""), job_id=job_id,
                     node_id=node_id, data={"incident_id": inc.id, "evidence": evidence})
        log.warning("incident %s: %s job=%s node=%s rank=%s %s", inc.id, kind.value, job_id, node_id, rank, evidence)
        return inc

    def _act(self, s: Session, inc: Incident, job: Job | None, action: str) -> None:
        spec = JobCreate.model_validate(job.spec) if job else None
        if spec is not None and spec.recovery.policy == RecoveryPolicy.OBSERVE:
            inc.action = f"observe: {action} (no action by Vigil)"
            return
        inc.status = IncidentStatus.ACTING.value
        inc.action = action
        inc.acted_at = datetime.fromtimestamp(self.clock(), UTC)
        record_event(s, "recovery_action", f"{inc.kind}: {action}", job_id=inc.job_id, node_id=inc.node_id,
                     data={"incident_id": inc.id})

    def _restart_job(self, s: Session, inc: Incident, job: Job, action: str) -> None:
        """Kill every rank of the job: Ray Train restarts the group from the newest valid checkpoint."""
        for rank, loc in sorted(faults.rank_locations(s, job.id).items()):
            commands.enqueue(s, loc.node_id, CommandKind.KILL_PID, {"pid": loc.pid, "signal": 9}, job_id=job.id,
                             incident_id=inc.id)
        self._act(s, inc, job, action)

    def restart_job(self, s: Session, job: Job, reason: str, evict_node: str | None = None) -> Incident:
        """Manual recovery (``POST /jobs/{id}/recover``)."""
        inc = Incident(job_id=job.id, kind=IncidentKind.MANUAL.value,
                       status=IncidentStatus.OPEN.value, node_id=evict_node, rank=None,
                       evidence={"manual": True, "reason": reason}, step_at_detect=job.last_step,
                       detected_at=datetime.fromtimestamp(self.clock(), UTC))
        s.add(inc)
        s.flush()
        if evict_node:
            self._evict(s, evict_node, f"manual recovery of {job.id}: {reason}", inc)
        self._restart_job(s, inc, job, f"manual: {reason}")
        return inc

    def _evict(self, s: Session, node_id: str, reason: str, inc: Incident | None = None) -> bool:
        """Evict ``node_id``; False (and an event saying why) when it is the Ray head, which stays."""
        try:
            evict_node(s, self.cluster, node_id, reason, self.th.drain_deadline_s)
        except HeadNodeError as exc:
            record_event(s, "eviction_refused", str(exc), job_id=inc.job_id if inc else None, node_id=node_id,
                         data={"incident_id": inc.id if inc else None, "reason": reason})
            return False
        return True

    @staticmethod
    def _head_kept(inc: Incident) -> None:
        # A restart would land on the same slow node: the finding stays on record, the job runs on.
        inc.status = IncidentStatus.CLOSED.value
        inc.action = f"not evicted: {inc.node_id} is the Ray head (GCS, job drivers); the job runs on there"

    def _fail(self, s: Session, job: Job, reason: str) -> None:
        if self.launcher is not None and job.ray_job_id:
            try:
                self.launcher.stop(job.ray_job_id)
            except LaunchError as exc:
                log.warning("could not stop %s: %s", job.id, exc)
        transition(s, job, JobStatus.FAILED, reason)

    # -- queries ----------------------------------------------------------------------------------
    def _live(self, s: Session, job_id: str, kind: IncidentKind) -> Incident | None:
        return s.scalar(select(Incident).where(Incident.job_id == job_id, Incident.kind == kind.value,
                                               Incident.status.in_(LIVE_INCIDENT)).limit(1))

    def _live_any(self, s: Session, job_id: str) -> bool:
        return s.scalar(select(Incident.id).where(Incident.job_id == job_id, Incident.status.in_(LIVE_INCIDENT),
                                                  Incident.kind != IncidentKind.LOSS_SPIKE.value).limit(1)) is not None

    def _last_action_ts(self, s: Session, job_id: str) -> float:
        ts = s.scalar(select(func.max(Incident.acted_at)).where(Incident.job_id == job_id))
        if ts is None:
            return 0.0
        return (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp()

    # -- background thread (BackgroundLoop: start, stop, wake) --------------------------------------
    thread_name = "vigil-monitor"
    wait_first = True

    def tick(self) -> None:
        self.step()


class HeadNodeError(ValueError):
    """Eviction refused: the node is the Ray head."""


def is_head_node(cluster: ClusterControl | None, node_id: str) -> bool:
    """Whether ``node_id`` is the live Ray head (unknown, e.g. Ray unreachable, counts as no)."""
    if cluster is None:
        return False
    try:
        return any(n.is_head for n in cluster.nodes() if n.name == node_id and n.state == "ALIVE")
    except LaunchError:
        return False


def evict_node(s: Session, cluster: ClusterControl | None, node_id: str, reason: str, deadline_s: float) -> str:
    """Drain ``node_id`` in Ray (ranks there checkpoint, then restart elsewhere) and mark it EVICTED.

    The Ray head is refused (HeadNodeError): the GCS, every job driver and every Ray Train controller
    live there (Ray Train pins each worker group's synchronization actor to the driver's node), so a
    drained head takes every job down with it instead of moving one job's ranks.
    """
    node = s.get(Node, node_id)
    if node is None:
        raise LookupError(node_id)
    if is_head_node(cluster, node_id):
        raise HeadNodeError(f"node {node_id!r} is the Ray head (GCS, job drivers, Ray Train controllers) and is never "
                            "evicted; run no ranks there (`ray start --head --num-cpus=0`) or replace the head")
    outcome = "marked evicted"
    if cluster is not None:
        try:
            accepted = cluster.drain_node(node_id, deadline_s, reason)
            outcome = f"drained in Ray with a {deadline_s:.0f}s deadline" if accepted else "Ray refused the drain"
        except LaunchError as exc:
            outcome = f"drain failed: {exc}"
    node.state = NodeState.EVICTED.value
    record_event(s, "node_evicted", f"{node_id} evicted ({reason}): {outcome}", node_id=node_id,
                 data={"reason": reason, "deadline_s": deadline_s})
    return outcome


def readmit_node(s: Session, node_id: str) -> None:
    """Put an evicted node back: its agent starts a fresh raylet (Ray never un-drains a node)."""
    node = s.get(Node, node_id)
    if node is None:
        raise LookupError(node_id)
    if node.state != NodeState.EVICTED.value:
        raise ValueError(f"node {node_id} is {node.state}, not EVICTED")
    commands.enqueue(s, node_id, CommandKind.STOP_RAYLET, {})
    commands.enqueue(s, node_id, CommandKind.START_RAYLET, {})
    node.state = NodeState.ALIVE.value
    record_event(s, "node_readmitted", f"{node_id} readmitted", node_id=node_id)
