"""The live part of ``vigil bench chaos`` (:mod:`ops.bench.chaos`): the job, the calibration, the faulted
job with each fault injected, awaited and cleared, and its fault-free twin, on a running local cluster."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from typing import Any

from sqlalchemy import Engine, text

from ops.bench.chaos_db import rank_rows
from ops.bench.chaos_plan import (
    API_KINDS,
    AWAIT_DEFAULT_S,
    AWAIT_S,
    CALIBRATION_STEPS,
    CKPT_INTERVAL,
    CLEARED_AFTER,
    END_MARGIN_STEPS,
    EXPECT,
    FINAL_STATUSES,
    IN_RANK,
    NET_KINDS,
    QUIET_S,
    SETTLE_STEPS,
    STUCK_S,
    Expect,
    FaultRecord,
    Planned,
)
from ops.bench.faultrun import (
    FaultRun,
    node_index,
    parse_ts,
    ray_alive_nodes,
    safely,
    step_at,
    with_ray_start_pid,
)
from ops.localcluster import LocalCluster, node_name
from vigil.contract.checkpoint_layout import job_checkpoint_root, list_step_dirs, newest_complete
from vigil.contract.client import ApiError
from vigil.contract.probe import poll
from vigil.contract.schemas import JobCreate, JobPublic

log = logging.getLogger("vigil.bench.chaos")  # the bench's logger: `main` sets its level


def chaos_spec(name: str, steps: int, seed: int) -> JobCreate:
    """The benchmark's job: small enough for a 2-core machine, big enough that a slow rank stands out."""
    return JobCreate.model_validate({
        "name": name,
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64},
        "data": {"max_bytes": 300_000, "seed": seed},
        "optimizer": {"kind": "adamw", "lr": 0.01},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        # batch 32: ~60 ms of compute per step, so a 3x slower rank stands out of scheduling noise.
        "steps": steps, "batch_size": 32,
        "lr_schedule": {"kind": "constant"},
        "checkpoint": {"interval_steps": CKPT_INTERVAL, "keep_last": 3},
        "recovery": {"policy": "evict_restart", "max_restarts": 5},
    })


_RESTORED = re.compile(r"rank 0:? restored step (\d+) from")


class Chaos(FaultRun):
    """The live part: calibration, the faulted job, each fault and its aftermath, the fault-free job."""

    def __init__(self, cluster: LocalCluster, engine: Engine, nodes: int, seed: int) -> None:
        super().__init__(cluster, timeout=30)
        self.engine = engine
        self.seed = seed
        self.workers = [node_name(i) for i in range(1, nodes + 1)]
        self.storage = cluster.storage
        self._submitted: dict[str, float] = {}

    def submit(self, name: str, steps: int) -> JobPublic:
        job = self.client.submit_job(chaos_spec(name, steps, self.seed))
        self._submitted[job.id] = time.time()
        return job

    # -- jobs ------------------------------------------------------------------------------------
    def calibrate(self) -> dict[str, Any]:
        """Steps per second of the benchmark's job on this cluster, from a short job."""
        job = self.submit("chaos-calibration", CALIBRATION_STEPS)
        status = self.finish_or_cancel(job.id)
        rows = [r for r in rank_rows(self.engine, job.id) if r[1] >= 30]
        rate = None
        if len(rows) >= 2 and rows[-1][0] > rows[0][0]:
            rate = (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0])
        log.info("calibration job %s: %s, %s steps/s", job.id, status, f"{rate:.2f}" if rate else "?")
        return {"job_id": job.id, "status": status, "steps_per_s": round(rate, 3) if rate else None}

    def run_faulted(self, plans: list[Planned], steps: int, minutes: float) -> tuple[str, list[FaultRecord]]:
        job = self.submit("chaos", steps)
        records: list[FaultRecord] = []
        warm = 2 * CKPT_INTERVAL + 10  # two checkpoints: a corrupt one has one to fall back on
        if not self.reach(job.id, warm, timeout=900):
            log.error("job %s did not reach step %d", job.id, warm)
            return job.id, records
        t0 = time.time()
        end = t0 + minutes * 60
        log.info("job %s: %d steps; fault phase of %.1f min, %d faults scheduled", job.id, steps, minutes, len(plans))
        settle_from = self.last_step(job.id)
        for n, plan in enumerate(plans, 1):
            if not self._wait_until(job.id, min(t0 + plan.at_s, end), settle_from + SETTLE_STEPS) or time.time() >= end:
                break
            last = safely(lambda: self.last_step(job.id), 0)
            if last + plan.ahead + END_MARGIN_STEPS >= steps:
                log.info("job near its end (step %d of %d): no more faults", last, steps)
                break
            log.info("fault %d/%d at %.0fs: %s on rank %d, %d steps ahead %s", n, len(plans), time.time() - t0,
                     plan.kind, plan.rank, plan.ahead, plan.params or "")
            rec = self.inject_planned(job.id, plan)
            if rec.error is None:
                self.await_effect(job.id, rec)
            self.aftermath(job.id, rec)
            rec.resolved_at = time.time()
            records.append(rec)
            log.info("  -> %s (hit step %s) resolved after %.0fs%s", rec.kind, rec.step_hit,
                     rec.resolved_at - rec.injected_at, f"; error: {rec.error}" if rec.error else "")
            settle_from = safely(lambda: self.last_step(job.id), settle_from)
        status = self.finish_or_cancel(job.id)
        log.info("job %s ended %s", job.id, status)
        return job.id, records

    def finish_or_cancel(self, job_id: str, stuck_s: float = STUCK_S) -> str:
        """The job's final status once it ended; a job that made no step for ``stuck_s`` is cancelled."""
        while True:
            job = safely(lambda: self.client.get_job(job_id), None)
            if job is not None and job.status.is_terminal():
                return job.status.value
            if self._stuck(job_id, stuck_s):
                log.error("job %s made no step for %.0fs: cancelled", job_id, stuck_s)
                safely(lambda: self.client.cancel_job(job_id), None)
                self.finish(job_id, 120)
                return safely(lambda: self.client.get_job(job_id).status.value, "UNKNOWN")
            time.sleep(2.0)

    def _stuck(self, job_id: str, stuck_s: float) -> bool:
        """Whether the job's newest step row (or, before its first, its submission) is older than ``stuck_s``."""
        with self.engine.connect() as c:
            newest = c.execute(text("SELECT MAX(ts) FROM step_metrics WHERE job_id = :j"), {"j": job_id}).scalar()
        started = self._submitted.get(job_id, time.time())
        return time.time() - max(float(newest or 0.0), started) > stuck_s

    def run_fault_free(self, steps: int, rate: float | None) -> dict[str, Any]:
        job = self.submit("chaos-fault-free", steps)
        status = self.finish_or_cancel(job.id)
        log.info("fault-free job %s ended %s", job.id, status)
        return {"job_id": job.id, "status": status, "steps": steps}

    def _wait_until(self, job_id: str, when: float, step: int, stuck_s: float = STUCK_S) -> bool:
        """Until ``when`` and the job at ``step``; False if the job ended, or made no step for ``stuck_s``."""
        def ready() -> bool | None:
            job = self.client.get_job(job_id)
            if job.status.is_terminal():
                return None
            return time.time() >= when and (job.last_step or 0) >= step

        while True:
            ok = safely(ready, False)
            if ok is None:
                return False
            if ok:
                return True
            if self._stuck(job_id, stuck_s):
                log.error("job %s made no step for %.0fs: no more faults", job_id, stuck_s)
                return False
            time.sleep(1.0)

    # -- one fault -------------------------------------------------------------------------------
    def inject_planned(self, job_id: str, plan: Planned) -> FaultRecord:
        rec = FaultRecord(plan.kind, plan.rank, params=dict(plan.params), injected_at=time.time())
        try:
            self._inject(job_id, plan, rec)
        except (ApiError, OSError, LookupError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        return rec

    def _inject(self, job_id: str, plan: Planned, rec: FaultRecord) -> None:
        kind = plan.kind
        if kind == "controller_kill_9":
            rec.rank = None
            rec.step_asked = self.last_step(job_id) + plan.ahead
            self.reach(job_id, rec.step_asked)
            rec.step_hit = self.last_step(job_id)
            rec.fired_at = time.time()
            self.cluster.procs.restart("controller", down_s=float(plan.params.get("down_s", 5.0)))
            rec.signal_seen = bool(poll(lambda: self.client.health().status == "ok", 120, 0.5,
                                        (Exception,)))
            return
        loc = self.rank_location(job_id, plan.rank)
        if loc is None:
            raise LookupError(f"rank {plan.rank} not found in any heartbeat")
        rec.node, pid = loc
        rec.step_asked = self.last_step(job_id) + plan.ahead
        if kind in API_KINDS:
            body: dict[str, Any] = {"kind": kind, "rank": plan.rank, "step": rec.step_asked, "params": plan.params}
            if kind == "kill_node" or kind in NET_KINDS:
                body["node_id"] = rec.node
            rec.fault_id = int(self.inject(job_id, body)["id"])
            return
        if kind == "corrupt_checkpoint":
            self._corrupt(job_id, rec, pid)
            return
        if not self.reach(job_id, rec.step_asked, 120):
            raise LookupError(f"the job did not reach step {rec.step_asked}")
        if kind == "kill_9":
            loc = self.rank_location(job_id, plan.rank) or loc  # the pid now (unchanged unless it restarted)
            rec.node, pid = loc
            rec.step_hit = self.last_step(job_id)
            rec.fired_at = time.time()
            os.kill(pid, signal.SIGKILL)
        elif kind == "agent_kill_9":
            name = f"agent-{node_index(rec.node)}"
            child = self.child(name)
            if child is None:
                raise LookupError(name)
            rec.step_hit = self.last_step(job_id)
            rec.fired_at = time.time()
            os.kill(child.proc.pid, signal.SIGKILL)  # the agent alone: a raylet it started lives on
            child.proc.wait(10)
            time.sleep(float(plan.params.get("down_s", 0.0)))
            self.start_again(name)
        else:
            raise ValueError(f"unknown kind {kind}")

    def _corrupt(self, job_id: str, rec: FaultRecord, pid: int) -> None:
        """Freeze the job (SIGSTOP of the target rank), corrupt its newest complete checkpoint, kill the rank."""
        root = job_checkpoint_root(self.storage, job_id)
        if not self.reach(job_id, rec.step_asked or 0, 120):
            raise LookupError(f"the job did not reach step {rec.step_asked}")
        if len(list_step_dirs(root)) < 2:
            raise LookupError("fewer than two checkpoints on storage")
        os.kill(pid, signal.SIGSTOP)
        try:
            def frozen() -> int | None:
                before = self.last_step(job_id)
                time.sleep(2)
                return before if self.last_step(job_id) == before else None

            frozen_step = poll(frozen, 30, 0)
            found = newest_complete(root)
            if frozen_step is None or found is None:
                raise LookupError("the job did not freeze, or has no complete checkpoint")
            newest, newest_dir = found
            rec.fault_id = int(self.inject(job_id, {"kind": "corrupt_checkpoint", "step": 0})["id"])

            def corrupted() -> bool:
                return any(b"VIGIL-CORRUPTED!" in f.read_bytes() for f in newest_dir.glob("*.distcp"))

            if not poll(corrupted, 30, 0.5, (OSError,)):
                raise LookupError(f"{newest_dir.name} was not corrupted")
        except BaseException:
            os.kill(pid, signal.SIGCONT)
            raise
        rec.corrupted_step, rec.step_hit = newest, frozen_step
        rec.restores_before = len(_RESTORED.findall(self._logs(job_id)))
        rec.fired_at = time.time()
        os.kill(pid, signal.SIGKILL)

    def _logs(self, job_id: str) -> str:
        return safely(lambda: self.client.job_logs(job_id).logs, "")

    def await_effect(self, job_id: str, rec: FaultRecord) -> None:
        """Until the fault's effect is resolved (module docstring), or its time is up."""
        exp = EXPECT[rec.kind]
        deadline = time.time() + AWAIT_S.get(rec.kind, AWAIT_DEFAULT_S)
        while time.time() < deadline:
            job = safely(lambda: self.client.get_job(job_id), None)
            if job is not None and job.status.is_terminal():
                rec.notes.append(f"job ended {job.status.value} while the fault was under way")
                return
            if rec.fault_id is not None and rec.kind in API_KINDS and rec.fired_at is None:
                f = next((x for x in safely(lambda: self.faults(job_id), []) if x["id"] == rec.fault_id), None)
                if f is not None and f["status"] == "FAILED":
                    rec.error = f"fault failed: {f['message']}"
                    return
                if f is not None and f["fired_at"]:
                    rec.fired_at = parse_ts(f["fired_at"])
                    rec.step_hit = step_at(f["message"])
                    # A fault the rank carries out itself (a fault file) hits at the step asked, not when sent.
                    rec.in_rank = rec.kind in IN_RANK or (f["message"] or "").startswith("write_fault_file")
            if rec.fault_id is not None and not rec.hit_read:
                # The fault's own record of the step it hit (the rank's report, or the agent's answer).
                f = next((x for x in safely(lambda: self.faults(job_id), []) if x["id"] == rec.fault_id), None)
                if f is not None and f.get("hit_step") is not None:
                    rec.step_hit, rec.hit_read = int(f["hit_step"]), True
            if rec.in_rank and not rec.hit_read:
                self._in_rank_hit(job_id, rec)
            if rec.kind == "agent_kill_9" and not rec.signal_seen:
                rec.signal_seen = self._heard_from(rec.node, after=rec.fired_at or rec.injected_at)
            if job is not None and self._resolved(job_id, rec, exp, job.last_step or 0):
                return
            time.sleep(1.0)
        rec.gave_up_at = time.time()
        rec.notes.append(f"not resolved within {AWAIT_S.get(rec.kind, AWAIT_DEFAULT_S):.0f}s")

    def _in_rank_hit(self, job_id: str, rec: FaultRecord) -> None:
        """The step (and time) at which the rank fired its fault file, from the step rows: a NaN, the rank's
        first non-finite loss; else the first step at or after the one asked (and after the file was
        written), starting when the step before it ended."""
        asked = rec.step_asked or 0
        with self.engine.connect() as c:
            if rec.kind == "nan_loss":
                row = c.execute(text("SELECT step, ts FROM step_metrics WHERE job_id = :j AND rank = :r AND ts >= :t "
                                     "AND step >= :s AND loss IS NULL ORDER BY ts LIMIT 1"),
                                {"j": job_id, "r": rec.rank, "t": rec.injected_at, "s": asked}).first()
            else:
                hit = max(asked, (rec.step_hit or 0) + 1)  # the step the job had when the file was written, + 1
                row = c.execute(text("SELECT step + 1, ts FROM step_metrics WHERE job_id = :j AND ts >= :t "
                                     "AND step = :s ORDER BY ts LIMIT 1"),
                                {"j": job_id, "t": rec.injected_at, "s": hit - 1}).first()
        if row is not None:
            rec.step_hit, rec.fired_at, rec.hit_read = int(row[0]), float(row[1]), True

    def _heard_from(self, node: str | None, after: float) -> bool:
        def heard() -> bool:
            n = next((x for x in self.client.list_nodes().data if x.id == node), None)
            return bool(n and n.state.value == "ALIVE" and n.last_heartbeat and n.last_heartbeat.timestamp() > after)

        return safely(heard, False)

    def _window_incidents(self, job_id: str, rec: FaultRecord) -> list[dict[str, Any]]:
        incs = safely(lambda: [i.model_dump(mode="json") for i in self.client.list_incidents(limit=200).data], [])
        return [i for i in incs if i["job_id"] in (job_id, None)
                and (parse_ts(i["detected_at"]) or 0) >= rec.injected_at - 1.0]

    def _resolved(self, job_id: str, rec: FaultRecord, exp: Expect, last_step: int) -> bool:
        if rec.fired_at is None:
            return False
        incs = self._window_incidents(job_id, rec)
        if exp.kinds:
            inc = next((i for i in incs if i["kind"] in exp.kinds
                        and (i["kind"] != "hang" or i["rank"] is not None or i["status"] != "OPEN")), None)
            return bool(inc and inc["status"] in FINAL_STATUSES
                        and last_step > max(inc["step_at_detect"] or 0, rec.step_hit or 0) + 5)
        if rec.kind == "corrupt_checkpoint":
            return (last_step > (rec.step_hit or 0) + 5
                    and all(i["status"] in FINAL_STATUSES for i in incs if i["job_id"] == job_id))
        return (time.time() - rec.fired_at >= QUIET_S and last_step >= (rec.step_hit or 0) + 40
                and (rec.signal_seen or exp.signal != "heartbeat"))

    def aftermath(self, job_id: str, rec: FaultRecord) -> None:
        """Undo what stays (a slow rank, a sick link, a stopped rank), read a corrupt checkpoint's outcome,
        and give the cluster back its nodes."""
        if rec.fault_id is not None and rec.kind in CLEARED_AFTER:
            f = next((x for x in safely(lambda: self.faults(job_id), []) if x["id"] == rec.fault_id), None)
            if f is not None and f["status"] == "FIRED":
                try:
                    self.client.clear_fault(job_id, rec.fault_id)
                except (ApiError, OSError) as exc:
                    rec.notes.append(f"clear failed: {exc}")
        if rec.kind == "corrupt_checkpoint" and rec.fired_at is not None:
            events = [e for e in safely(lambda: self.events(job_id), []) if e["kind"] == "checkpoint_invalid"
                      and (parse_ts(e["ts"]) or 0) >= rec.injected_at]
            rec.invalid_steps = sorted({int(e["data"].get("step", -1)) for e in events})
            rec.invalid_at = min((parse_ts(e["ts"]) or 0 for e in events), default=None)
            restores = [int(s) for s in _RESTORED.findall(self._logs(job_id))]
            rec.restored_step = restores[rec.restores_before] if len(restores) > rec.restores_before else None
        self.ensure_nodes(rec)

    def ensure_nodes(self, rec: FaultRecord) -> None:
        """Every worker node whole again: evicted ones readmitted, a killed node's raylet and agent started
        again, a raylet lost (a partition) started again; then until Ray and Vigil both have them."""
        try:
            ray_before = ray_alive_nodes(self.cluster.dashboard_url)
        except Exception as exc:  # noqa: BLE001 - Ray's dashboard busy: ask again below
            log.warning("Ray's node list: %s", exc)
            ray_before = {}
        states = {n.id: n.state.value for n in safely(lambda: self.client.list_nodes().data, [])}
        fresh: dict[str, set[str]] = {}
        for name in self.workers:
            idx = node_index(name)
            agent = self.child(f"agent-{idx}")
            agent_up = agent is not None and agent.proc.poll() is None
            if states.get(name) == "EVICTED" and agent_up:
                fresh[name] = ray_before.get(name, set())
                try:
                    self.client.readmit_node(name)
                    rec.notes.append(f"readmitted {name}")
                except ApiError as exc:
                    rec.notes.append(f"readmit of {name} refused: {exc}")
                continue
            if name in ray_before and agent_up:
                continue
            if name not in ray_before:
                # The raylet is gone (a killed node, a partition): start it as `vigil up` did.
                fresh[name] = set()
                raylet = self.start_again(f"ray-node-{idx}")
                rec.notes.append(f"started the raylet of {name} again")
                if not agent_up:
                    self.start_again(f"agent-{idx}", lambda argv, pid=raylet.proc.pid: with_ray_start_pid(argv, pid))
                    rec.notes.append(f"started the agent of {name} again")
            elif not agent_up:
                self.start_again(f"agent-{idx}")
                rec.notes.append(f"started the agent of {name} again")

        def whole() -> bool:
            ray_now = ray_alive_nodes(self.cluster.dashboard_url)
            vigil = {n.id: n.state.value for n in self.client.list_nodes().data}
            return all(vigil.get(name) == "ALIVE" and bool(ray_now.get(name, set()) - fresh.get(name, set()))
                       for name in self.workers)

        if not poll(whole, 180, 2.0, (Exception,)):
            rec.notes.append("not every node came back within 180s")
            log.warning("not every worker node came back within 180s")
