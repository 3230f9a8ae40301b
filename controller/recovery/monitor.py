"""The monitor: the loop that fires injected faults, runs the detectors, asks the policy and acts.

``Monitor.step()`` is one pass (tests drive it one iteration at a time); the controller runs it in a
background thread every ``interval`` seconds (:class:`~vigil.contract.background.BackgroundLoop`). A pass:

1. fires the pending faults whose job reached their step (fault injection, :mod:`controller.faults`, which
   lives outside recovery: recovery must find injected faults as it finds real ones);
2. nodes: closes ``node_lost`` incidents of nodes heard from again, marks silent nodes DEAD;
3. for every running job, in order: rank death, loss, hang (or the diagnosis of an open hang),
   stragglers, the NIC detector (under ``adapt``, after following the job's adaptations:
   :mod:`~controller.recovery.adapt`), then the job's restarts after earlier actions
   (:mod:`~controller.recovery.detectors`, :mod:`~controller.recovery.stragglers`). For each finding the
   facts the policy needs are gathered once (:func:`controller.recovery.facts.gather`: recovery under way,
   the Ray head, room left, restarts so far and progress), the job's policy decides once
   (:func:`controller.recovery.policy.policy_for`), and :func:`controller.recovery.actions.carry_out`
   carries the decision out as it is, before the next detector runs (a recovery started by one finding
   quiets the detectors after it);
4. undoes the faults of jobs that ended, and settles their incidents
   (:mod:`~controller.recovery.incidents`).

Detection thresholds are per job (``recovery.thresholds``); the heartbeat timeout, which judges nodes,
is the monitor's (``node_timeout_s``). Silence is counted from the monitor's start at the earliest
(``started_at``, set again by every ``start()``): after a controller restart, or a standby's takeover
(controller/leader.py), nodes and ranks get a full timeout to be heard again.

The monitor itself decides nothing: besides running the detectors, it records each restart on the job
(``restarts``, ``stalled_restarts``, ``progress_mark``, as the facts counted them) and keeps a finding the
policy closed at once from being recorded again every pass (``ON_RECORD_S``). The actions live in
:mod:`controller.recovery.actions`; ``HeadNodeError``, ``is_head_node``, ``evict_node`` and ``readmit_node``
are re-exported here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from controller import faults
from controller.db import session_scope
from controller.launcher import ClusterControl, JobLauncher
from controller.models import Incident, Job
from controller.prometheus import MONITOR_LAST_PASS_SECONDS, MONITOR_PASS_SECONDS
from controller.recovery import (
    actions,
    adapt,
    collective_hang,
    detectors,
    facts,
    failslow,
    heal_timeline,
    incidents,
    policy,
    reads,
    stragglers,
)
from controller.recovery import nic as nic_detector
from controller.recovery.actions import HeadNodeError, evict_node, is_head_node, readmit_node
from controller.recovery.agents import AgentWatch
from controller.recovery.detectors import Finding
from vigil.contract.background import BackgroundLoop
from vigil.contract.schemas import IncidentKind, JobCreate, RecoveryPolicy

__all__ = ["NODE_TIMEOUT_S", "HeadNodeError", "Monitor", "evict_node", "is_head_node", "readmit_node"]

log = logging.getLogger(__name__)

NODE_TIMEOUT_S = 4.0
ON_RECORD_S = 60.0
"""A finding the policy closes at once (a slow node that cannot be evicted: the job runs on there) is
on record for this long after it was last seen: the same finding on every pass while the node stays
slow is that one incident, not one each pass. Seen again after a gap this long, it is a new one."""
ACTING_TIMEOUT_S = 180.0
"""Longest Vigil waits for the restart an action promised (Ray Train's restart, an eviction's drain)."""
"""Default heartbeat timeout: a node not heard from for this long is lost (heartbeats every 1 s)."""


class Monitor(BackgroundLoop):
    """Detectors -> policy -> actions, one :meth:`step` at a time (module docstring)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        launcher: JobLauncher | None = None,
        cluster: ClusterControl | None = None,
        interval: float = 1.0,
        node_timeout_s: float = NODE_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        reconnect_grace_s: float = 0.0,
        acting_timeout_s: float = ACTING_TIMEOUT_S,
    ) -> None:
        self.sessions = sessions
        self.launcher = launcher
        self.cluster = cluster
        self.interval = interval
        self.node_timeout_s = node_timeout_s
        self.clock = clock
        self.reconnect_grace_s = reconnect_grace_s
        self.acting_timeout_s = acting_timeout_s
        """An action after which the job has made no step for this long has failed (FAILED): its
        incident no longer mutes the job's detectors, which judge the job afresh."""
        self.started_at = clock()
        """Silence that began before this (the controller's start) counts from here, plus
        ``reconnect_grace_s``: a restarted controller's own absence is not the nodes' or the ranks'
        (node_lost, hang), and an agent that found it down comes back only at its next retry."""
        super().__init__()
        self._agents = AgentWatch(cluster, clock)  # silent agents on live nodes, across passes
        self._nic = nic_detector.NicDetector()  # keeps each node's heartbeat history across passes
        self._on_record: dict[tuple[str, str, str | None], float] = {}  # ON_RECORD_S: (job, kind, node) -> last seen

    def start(self) -> None:
        if not self.running:
            # A standby that became the leader (or a leader that got its lock back) judges no silence
            # that began before it took over: from here, nodes and ranks get a full timeout.
            self.started_at = self.clock()
        super().start()

    # -- one pass ---------------------------------------------------------------------------------
    def step(self) -> None:
        now = self.clock()
        t0 = time.perf_counter()
        try:
            with session_scope(self.sessions) as s:
                faults.fire_due(s, self.cluster)
                self._nodes(s, now)
                for job in reads.running_jobs(s):
                    self._job(s, job, JobCreate.model_validate(job.spec), now)
                faults.clear_for_ended_jobs(s)
                incidents.close_for_ended_jobs(s)
                heal_timeline.settle(s, now)
        finally:
            # Detection must not starve under a flood of telemetry: the pass time is exported.
            took = time.perf_counter() - t0
            MONITOR_PASS_SECONDS.observe(took)
            MONITOR_LAST_PASS_SECONDS.set(took)

    def _nodes(self, s: Session, now: float) -> None:
        for inc in detectors.nodes_heard_again(s):
            incidents.close(inc, (f"{inc.action}; " if inc.action else "") + "heartbeats resumed")
        lost_nodes = detectors.lost_nodes(s, now, self.node_timeout_s, since=self.started_at + self.reconnect_grace_s)
        self._agents.heard(s, {n.id for n in reads.alive_nodes(s)} - {lost.node_id for lost in lost_nodes})
        for lost in lost_nodes:
            if self._agents.agent_only(s, lost.node_id, lost.age_s):
                continue  # its agent died, the node lives: an event, no incident (controller/recovery/agents.py)
            actions.mark_node_dead(s, lost.node_id, lost.age_s)
            for finding in lost.findings:
                job = s.get(Job, finding.job_id) if finding.job_id else None
                self._respond(s, job, JobCreate.model_validate(job.spec) if job else None, finding)

    def _job(self, s: Session, job: Job, spec: JobCreate, now: float) -> None:
        th = spec.recovery.thresholds
        live = spec.recovery.policy == RecoveryPolicy.LIVE
        self._give_up_stale_actions(s, job, now)
        self._detect(s, job, spec, IncidentKind.RANK_DIED,
                     lambda: detectors.rank_died(s, job, spec.steps, th, self.clock(), live=live))
        self._respond_all(s, job, spec, detectors.loss(s, job, th))
        hang = reads.under_way(s, job.id, IncidentKind.HANG)
        if hang is not None:
            self._respond_all(s, job, spec, detectors.diagnose_hang(s, job, hang, th, now))
        else:
            self._detect(s, job, spec, IncidentKind.HANG, lambda: collective_hang.detect(s, job, th, now) or detectors.hang(
                s, job, spec.steps, th, now, since=self.started_at + self.reconnect_grace_s, per_rank=live))
        self._detect(s, job, spec, IncidentKind.STRAGGLER,
                     lambda: stragglers.detect(s, job, th, spec.checkpoint.interval_steps,
                                               since=reads.last_recovered_ts(s, job.id) if live else None)
                     or failslow.detect(s, job, th, stragglers.checkpoint_busy(
                         s, job.id, spec.checkpoint.interval_steps, th.checkpoint_settle_s), spec.steps))
        nic_found = self._detect_nic(s, job, spec, now)  # every pass: it keeps each node's history
        self._respond_all(s, job, spec, [f for f in nic_found if reads.under_way(s, job.id, f.kind) is None])
        for finding in detectors.resumed(s, job, th, live=live):
            self._resumed(s, job, spec, finding)

    def _give_up_stale_actions(self, s: Session, job: Job, now: float) -> None:
        """An incident ACTING for longer than ``acting_timeout_s`` with no step since the action: FAILED.
        Without this a restart that never comes (a group that cannot be placed) would leave the job
        RUNNING for ever with every detector muted."""
        for inc in reads.acting(s, job.id):
            acted = inc.acted_at.timestamp() if inc.acted_at is not None else None
            if acted is None or now - acted <= self.acting_timeout_s:
                continue
            last = reads.last_step_ts(s, job.id)
            if last is None or last <= acted:
                incidents.fail(s, inc, f"no step within {self.acting_timeout_s:.0f} s of the action; judged afresh")

    def _detect(self, s: Session, job: Job, spec: JobCreate, kind: IncidentKind,
                detect: Callable[[], list[Finding]]) -> None:
        """Run a detector unless the policy would ignore its findings now (a recovery under way), or an
        incident of its kind is still under way for the job (under observe one stays OPEN: found once)."""
        if policy.waits(kind, facts.recovering(s, job)) or reads.under_way(s, job.id, kind) is not None:
            return
        self._respond_all(s, job, spec, detect())

    def _detect_nic(self, s: Session, job: Job, spec: JobCreate, now: float) -> list[Finding]:
        try:
            found = self._nic.detect(s, job, now)  # every pass, even mid-recovery: it keeps the history
        except Exception:  # a bug there must not cost the other detectors their pass
            log.exception("NIC detector failed for job %s", job.id)
            return []
        if spec.recovery.policy == RecoveryPolicy.ADAPT:  # its nodes' adaptations: followed, not found again
            found = adapt.follow(s, job, spec, found, now, lambda f: self._respond(s, job, spec, f))
        return detectors.nic_degraded(job, found)

    # -- findings -> policy -> actions ---------------------------------------------------------------
    def _respond_all(self, s: Session, job: Job, spec: JobCreate, findings: list[Finding]) -> None:
        for finding in findings:
            self._respond(s, job, spec, finding)

    def _respond(self, s: Session, job: Job | None, spec: JobCreate | None, finding: Finding,
                 known: facts.Facts | None = None) -> Incident | None:
        """Facts gathered once (unless given), one decision by the job's policy, carried out as it is."""
        if known is None:
            known = facts.gather(s, self.cluster, job, spec, finding)
        decision = policy.policy_for(spec.recovery if spec else None).decide(finding, known)
        if (decision.action == policy.Action.CLOSE and job is not None and finding.incident_id is None
                and self._already_on_record(s, job, finding)):
            return None
        deadline = spec.recovery.thresholds.drain_deadline_s if spec else 0.0
        return actions.carry_out(s, decision, finding, job, cluster=self.cluster, launcher=self.launcher,
                                 deadline_s=deadline, clock=self.clock)

    def _already_on_record(self, s: Session, job: Job, finding: Finding) -> bool:
        """Whether the incident this finding would open and close at once is on record already
        (``ON_RECORD_S``): seen in an earlier pass of this monitor, or closed in the database lately
        (by this controller before a restart, or by the leader before a takeover)."""
        now = self.clock()
        key = (job.id, finding.kind.value, finding.node_id)
        last = self._on_record.get(key)
        self._on_record = {k: t for k, t in self._on_record.items() if now - t < ON_RECORD_S}
        self._on_record[key] = now
        if last is not None and now - last < ON_RECORD_S:
            return True
        return reads.closed_since(s, job.id, finding.kind, finding.node_id, now - ON_RECORD_S) is not None

    def _resumed(self, s: Session, job: Job, spec: JobCreate, finding: Finding) -> None:
        """The job restarted after Vigil acted on an incident: the restart counted as the facts count it (with
        or without progress since the last one, :mod:`vigil.contract.restarts`), RECOVERED, and the policy
        asked whether to go on."""
        inc = s.get(Incident, finding.incident_id)
        assert inc is not None, finding
        known = facts.gather(s, self.cluster, job, spec, finding)
        job.restarts, job.stalled_restarts, job.progress_mark = (known.restarts, known.stalled_restarts,
                                                                 known.resume_point)
        incidents.recover(s, inc, finding.evidence["restarted_at"], job.restarts)
        if spec.recovery.policy == RecoveryPolicy.LIVE and inc.kind != IncidentKind.NAN_LOSS.value:
            inc.evidence = {**(inc.evidence or {}), "timeline": heal_timeline.build(s, inc)}
        self._respond(s, job, spec, finding, known)

    # -- manual recovery (the API calls actions.restart_job; kept for callers of the monitor) ------------
    def restart_job(self, s: Session, job: Job, reason: str, evict_node: str | None = None) -> Incident:
        """Manual recovery (``POST /jobs/{id}/recover``): :func:`controller.recovery.actions.restart_job`."""
        return actions.restart_job(s, self.cluster, job, reason, evict_node, clock=self.clock)

    # -- background thread (BackgroundLoop: start, stop, wake) --------------------------------------
    thread_name = "vigil-monitor"
    wait_first = True

    def tick(self) -> None:
        self.step()
