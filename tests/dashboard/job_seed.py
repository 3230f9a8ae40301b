"""A job with something to diagnose, fed to the REAL controller through its API (the job page's tests).

:func:`seed_diagnosis` stores, in the order things happen in production: a 12-rank job (two nodes,
``node-a`` ranks 0-5, ``node-b`` ranks 6-11) whose ranks report steps 0-29 with their breakdown and
two kinds of collective (``all_reduce/grads`` at 32 bits per parameter, ``all_gather/weights`` at 4),
rank 5 a straggler (0.5 s steps against 0.1 s); checkpoints at steps 10, 20 and 28; a ``hang_rank``
fault on rank 7 fired at step 29. Then the job stops stepping: the ranks' watchers report where they
stand in their collectives (rank 7 never entered the all-reduce the others wait in), the controller's
monitor detects the hang, asks both nodes' agents for py-spy stacks, which answer (rank 7 stopped in
``forward``, the others waiting in ``all_reduce``), and acts on rank 7. The checkpoint at step 28 is then
reported corrupt, and the ranks, restarted from step 20, re-run steps 21-39; the monitor sees the
restart.

:func:`seed_torch_only` stores a small job whose only collectives are torch's own (tag
:data:`~vigil.contract.schemas.CAPTURED_TAG`, bytes estimated), as :mod:`vigil.capture` reports them.

Only Ray is faked (:mod:`tests.live_controller`); every sample, stack and answer goes
through the REST API with the token an agent or an admin has.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tests.live_controller import LiveController, checkpoint_path
from vigil.contract.schemas import (
    CAPTURED_TAG,
    CheckpointSample,
    CollectiveRef,
    CollectiveSample,
    CommandResult,
    GroupProgress,
    JobStatus,
    ProgressSample,
    RankProcess,
    Role,
    StepSample,
)

RANKS = 12
NODES = {"node-a": tuple(range(6)), "node-b": tuple(range(6, 12))}
SLOW = 5
"""The straggler: 0.5 s steps, the others 0.1 s."""
ODD = 7
"""The rank that hangs (stopped by the fault); its stack differs from the others'."""
FIRST_RUN = range(30)
RERUN = range(21, 40)
"""After the restart from the checkpoint at step 20."""
CHECKPOINTS = (10, 20, 28)
CORRUPT = 28
ELEMENTS = 1_000_000
"""Model elements each collective call communicates (per rank)."""

WAITING = ('Thread 0x1 (active): "vigil-train"\n    all_reduce (torch/distributed/distributed_c10d.py:2800)\n'
           "    all_reduce (vigil/comm.py:90)\n    step (vigil/optim/adamw.py:40)\n    train (vigil/loop.py:200)\n")
STOPPED = ('Thread 0x1 (idle): "vigil-train"\n    forward (vigil/model.py:120)\n'
           "    _call_impl (torch/nn/modules/module.py:1700)\n    train (vigil/loop.py:190)\n")


@dataclass
class Diagnosis:
    job_id: str
    incident_id: int | None
    """The hang's incident."""
    restart_step: int | None
    """The step of the restart marker the overview places (the first step run after the restart)."""


def _node(rank: int) -> str:
    return next(n for n, ranks in NODES.items() if rank in ranks)


def _step_samples(job_id: str, rank: int, step: int, ts: float, attempt: int = 1) -> list[Any]:
    slow = rank == SLOW
    fwd = 0.45 if slow else 0.05
    wait = 0.0 if slow else 0.008  # the others wait for the straggler inside the all-reduce
    comm = 0.02 + wait
    samples: list[Any] = [StepSample(
        job_id=job_id, rank=rank, world_size=RANKS, step=step, attempt=attempt, ts=ts,
        loss=4.0 / (1 + 0.05 * step) + 0.001 * rank,
        val_loss=(3.9 / (1 + 0.05 * step)) if step % 10 == 0 else None, tokens=512,
        step_time_s=0.01 + fwd + 0.01 + comm, tokens_per_s=512 / (0.04 + fwd + wait), data_s=0.01, fwd_bwd_s=fwd,
        optim_s=0.01, comm_s=comm, pid=1000 + rank)]
    for seq, (op, tag, wire) in enumerate((("all_reduce", "grads", 4 * ELEMENTS),
                                           ("all_gather", "weights", ELEMENTS // 2))):
        samples.append(CollectiveSample(
            job_id=job_id, rank=rank, step=step, attempt=attempt, seq=seq, op=op, tag=tag, payload_bytes=wire,
            wire_bytes=wire,
            elements=ELEMENTS, duration_s=0.01 + (wait if seq == 0 else 0.0), ts=ts))
    return samples


def _post_steps(ctl: LiveController, job_id: str, steps: range, t0: float, dt: float,
                nodes: dict[str, tuple[int, ...]] = NODES, attempt: int = 1) -> None:
    """Each node's agent posts its ranks' ``steps`` (of run ``attempt``), the first ending at ``t0 + dt``,
    then every ``dt``."""
    for node, ranks in nodes.items():
        samples = [s for i, step in enumerate(steps) for r in ranks
                   for s in _step_samples(job_id, r, step, t0 + dt * (i + 1), attempt)]
        procs = [RankProcess(job_id=job_id, rank=r, pid=1000 + r) for r in ranks]
        ctl.heartbeat(node, procs, samples)


def _checkpoint(ctl: LiveController, job_id: str, step: int, ts: float, *, valid: bool = True, message: str = ""
                ) -> CheckpointSample:
    return CheckpointSample(job_id=job_id, rank=0, step=step, ts=ts, path=checkpoint_path(ctl.app, job_id, step),
                            valid=valid, world_size=RANKS, files=RANKS + 1, bytes=48_000_000, manifest_sha256="ab" * 32,
                            message=message)


HUNG_SEQ = 60
"""The world's all-reduce the others wait in when rank 7 stops (two collectives a step: 60 after step 29)."""
HANG_SUMMARY = f"wait in all_reduce #{HUNG_SEQ} of group world; rank {ODD} never entered it"
"""What the hang's collective evidence says of rank 7 (``controller/recovery/collectives.py`` summary)."""


def _progress(job_id: str, rank: int, ts: float) -> ProgressSample:
    """Where ``rank`` stands while the job is stalled: inside the world's all-reduce :data:`HUNG_SEQ`,
    except rank :data:`ODD`, which never entered it."""
    inside = rank != ODD
    last = HUNG_SEQ if inside else HUNG_SEQ - 1
    return ProgressSample(
        job_id=job_id, rank=rank, attempt=1, ts=ts, step=29, idle_s=1.2,
        groups=[GroupProgress(group="world", last_enqueued=last, last_completed=HUNG_SEQ - 1)],
        in_flight=[CollectiveRef(group="world", seq=HUNG_SEQ, op="all_reduce", enqueued_ts=ts - 1.2)] if inside else [],
        last_done=CollectiveRef(group="world", seq=HUNG_SEQ - 1, op="all_reduce"))


def _sleep_until(t: float) -> None:
    time.sleep(max(t - time.time(), 0.0))


DT = 0.05
"""Seconds between steps (real time: the whole story takes a few seconds)."""
THRESHOLDS = {"hang_floor_s": 1.0, "hang_k": 5.0, "stack_wait_s": 5.0, "restart_gap_s": 0.5,
              "straggler_ratio": 100.0}
"""A hang after 1 s of silence (real time stays short); the straggler detector off, so that the hang is
the incident (rank 5 is left for the page to find)."""


def seed_diagnosis(ctl: LiveController, name: str = "diagnose-me") -> Diagnosis:
    job = ctl.submit_job(name, steps=100, optimizer={"kind": "adamw"},
                         scaling={"min_workers": RANKS, "max_workers": RANKS}, checkpoint={"interval_steps": 10},
                         recovery={"policy": "evict_restart", "max_restarts": 3, "thresholds": THRESHOLDS})
    job_id = job.id
    ctl.set_job_status(job_id, JobStatus.RUNNING)
    aggregate = ctl.app.state.telemetry.flush  # the aggregator's pass (its background loop is off here)
    # The first run: steps 0-29, reported once they happened.
    t0 = time.time()
    _sleep_until(t0 + DT * len(FIRST_RUN))
    _post_steps(ctl, job_id, FIRST_RUN, t0, DT)
    ctl.post_batch("node-a", [_checkpoint(ctl, job_id, s, t0 + DT * (s + 1) + 0.01) for s in CHECKPOINTS])
    aggregate()
    # The fault fires at step 29 (rank 7 stopped); the job makes no progress: a hang, diagnosed from
    # both nodes' py-spy stacks.
    ctl.inject_fault(job_id, "hang_rank", rank=ODD, step=29)
    ctl.monitor_pass()
    _sleep_until(t0 + DT * len(FIRST_RUN) + THRESHOLDS["hang_floor_s"] + 0.3)
    for node, ranks in NODES.items():  # the ranks' watchers: where each stands in its collectives
        ctl.post_batch(node, [_progress(job_id, r, time.time()) for r in ranks])
    ctl.monitor_pass()
    with ctl.client(Role.AGENT) as agent:
        for node, ranks in NODES.items():
            for cmd in ctl.pending_commands(node):
                if cmd.kind.value != "pyspy_dump":
                    continue
                stacks = {str(r): (STOPPED if r == ODD else WAITING) for r in ranks}
                states = {str(r): ("stopped" if r == ODD else "running") for r in ranks}
                agent.post_command_result(node, cmd.id, CommandResult(ok=True, output={"stacks": stacks,
                                                                                       "states": states}))
    ctl.monitor_pass()  # diagnosed: the odd rank out is killed, its node evicted
    # The restore finds the newest checkpoint corrupt and goes back to step 20; the ranks (those of the
    # evicted node now on node-c) re-run steps 21-39.
    acted = time.time()
    ctl.post_batch("node-a", [_checkpoint(ctl, job_id, CORRUPT, acted + 0.05, valid=False,
                                          message="sha256 mismatch in model.pt")])
    _sleep_until(acted + 0.6 + DT * len(RERUN))
    _post_steps(ctl, job_id, RERUN, acted + 0.6, DT, {"node-a": NODES["node-a"], "node-c": NODES["node-b"]},
                attempt=2)
    aggregate()
    ctl.monitor_pass()  # the job resumed: the incident is RECOVERED
    with ctl.client(Role.ADMIN) as admin:
        incidents = [i for i in admin.job_incidents(job_id).data if i.kind.value == "hang"]
        overview = admin.job_overview(job_id)
    restarts = [m.step for m in overview.markers if m.kind == "restart"]
    return Diagnosis(job_id=job_id, incident_id=incidents[0].id if incidents else None,
                     restart_step=restarts[0] if restarts else None)


TORCH_STEPS = range(8)
TORCH_RANKS = 2
CAPTURED_SEQ = 1 << 30
"""Where captured calls' ``seq`` starts (``vigil.capture.SEQ_BASE``; that module is not imported here)."""


def seed_torch_only(ctl: LiveController, name: str = "plain-ddp") -> str:
    """A 2-rank job whose steps come with torch's DDP all-reduce and a start-up broadcast only, both
    read from the Flight Recorder (tag :data:`CAPTURED_TAG`); returns its id."""
    job_id = ctl.submit_job(name, steps=100, scaling={"min_workers": TORCH_RANKS, "max_workers": TORCH_RANKS}).id
    ctl.set_job_status(job_id, JobStatus.RUNNING)
    t0 = time.time() - len(TORCH_STEPS) * 0.1
    samples: list[Any] = []
    for rank in range(TORCH_RANKS):
        for step in TORCH_STEPS:
            ts = t0 + 0.1 * (step + 1)
            samples.append(StepSample(job_id=job_id, rank=rank, world_size=TORCH_RANKS, step=step, attempt=1, ts=ts,
                                      loss=2.0, tokens=512, step_time_s=0.1, tokens_per_s=5120.0, comm_s=0.02))
            calls = [("all_reduce", 1, 4 * ELEMENTS)] + ([("broadcast", 0, 4 * ELEMENTS)] if step == 0 else [])
            for op, seq, payload in calls:
                samples.append(CollectiveSample(
                    job_id=job_id, rank=rank, step=step, attempt=1, seq=CAPTURED_SEQ + seq + 2 * step, op=op,
                    group="world", tag=CAPTURED_TAG, payload_bytes=payload, wire_bytes=payload, elements=ELEMENTS,
                    duration_s=0.01 + 0.002 * rank, ts=ts))
    ctl.heartbeat("node-t", [RankProcess(job_id=job_id, rank=r, pid=2000 + r) for r in range(TORCH_RANKS)], samples)
    ctl.app.state.telemetry.flush()
    return job_id
