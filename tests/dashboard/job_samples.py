"""Wire-schema values of the job page's views for the unit tests of its pure functions: the overview,
the binned heatmap, step and collective series, incidents, faults, checkpoints, stacks, goodput, a
hang's collective evidence.

Plain :mod:`vigil.contract.schemas` objects built in memory with known numbers (no server); the hang's
evidence is built by the controller's own pure functions (``controller/recovery/collectives.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from controller.recovery import collectives as hang_collectives
from vigil.contract.schemas import (
    CheckpointPublic,
    CollectiveSeriesPublic,
    FaultKind,
    FaultPublic,
    FaultStatus,
    GoodputPublic,
    IncidentKind,
    IncidentPublic,
    IncidentStatus,
    JobCollectivesPublic,
    JobMarker,
    JobOverviewPublic,
    JobStepsPublic,
    NodeLost,
    RankLost,
    RankStepsPublic,
    RankSummary,
    SecondsLostPublic,
    StackGroup,
    StacksPublic,
    StepHeatmapPublic,
    bytes_estimated,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
TS0 = T0.timestamp()


def marker(kind: str, step: int | None, label: str = "", ref: str | None = None, ts: float | None = None) -> JobMarker:
    return JobMarker(kind=kind, step=step, ts=TS0 + (step or 0) if ts is None else ts, label=label or f"{kind} {step}",
                     ref=ref)


def overview(job_id: str = "job", steps: range = range(10), *, ranks: int = 12, slow: int | None = 5,
             markers: list[JobMarker] | None = None, val_every: int = 0, forming: int = 0) -> JobOverviewPublic:
    """Steps ``steps`` of a job of ``ranks`` ranks: step time p50 0.1 s, p90 0.12 s, max 0.5 s on
    rank ``slow``; loss 5 / (1 + 0.1 step); 1000 tokens/s per rank; validation loss every ``val_every``.
    The last ``forming`` steps are still forming: half the ranks reported (loss + 1, half the tokens)."""
    xs = list(steps)
    part = [i >= len(xs) - forming for i in range(len(xs))]
    slowest = [RankSummary(rank=slow, node_id="node-2", steps=len(xs), step_time_mean_s=0.5, step_time_max_s=0.6,
                           vs_median=5.0, comm_wait_mean_s=0.01)] if slow is not None else []
    slowest += [RankSummary(rank=r, node_id="node-1", steps=len(xs), step_time_mean_s=0.1, step_time_max_s=0.11,
                            vs_median=1.0) for r in (0, 1) if r != slow]
    return JobOverviewPublic(
        job_id=job_id, ranks=ranks, step=xs, ts=[TS0 + s for s in xs],
        loss=[5.0 / (1 + 0.1 * s) + (1.0 if f else 0.0) for s, f in zip(xs, part, strict=True)],
        val_loss=[(4.0 / (1 + 0.1 * s) if val_every and s % val_every == 0 else None) for s in xs],
        tokens_per_s=[1000.0 * (ranks // 2 if f else ranks) for f in part],
        step_time_p50_s=[0.1] * len(xs), step_time_p90_s=[0.12] * len(xs),
        step_time_max_s=[0.5 if slow is not None else 0.13] * len(xs),
        slowest_rank=[slow if slow is not None else 0] * len(xs), reporting=[ranks // 2 if f else ranks for f in part],
        final=[not f for f in part],
        wire_bytes=[1000 * ranks] * len(xs), slowest_ranks=slowest, markers=list(markers or []),
        last_step=xs[-1] if xs else None,
    )


def heatmap(job_id: str = "job", ranks: int = 12, steps: int = 10, per_bin: int = 1, slow: int = 5) -> StepHeatmapPublic:
    lo = list(range(0, ranks, per_bin))
    return StepHeatmapPublic(
        job_id=job_id, rank_lo=lo, rank_hi=[min(r + per_bin - 1, ranks - 1) for r in lo],
        step_lo=list(range(steps)), step_hi=list(range(steps)),
        z=[[0.5 if r <= slow <= r + per_bin - 1 else 0.1 for _ in range(steps)] for r in lo],
    )


def rank_steps(rank: int, steps: range, *, slow: bool = False, node: str = "node-1") -> RankStepsPublic:
    """data 0.01, fwd+bwd 0.05 (0.45 when ``slow``), optim 0.01, comm 0.03 of which wait 0.01: step
    0.1 s (0.5 s) with 0.0 (and 0.0) unexplained."""
    xs = list(steps)
    n = len(xs)
    fb = 0.45 if slow else 0.05
    return RankStepsPublic(
        rank=rank, node_id=node, step=xs, ts=[TS0 + s for s in xs], final=[True] * n, loss=[1.0] * n,
        step_time_s=[0.01 + fb + 0.01 + 0.03] * n, data_s=[0.01] * n, fwd_bwd_s=[fb] * n, optim_s=[0.01] * n,
        comm_s=[0.03] * n, comm_wait_s=[0.01] * n, collectives=[2] * n, wire_bytes=[1000] * n,
    )


def job_steps(job_id: str = "job", ranks: int = 4, steps: range = range(5), slow: int | None = None) -> JobStepsPublic:
    data = [rank_steps(r, steps, slow=r == slow) for r in range(ranks)]
    return JobStepsPublic(job_id=job_id, data=data, count=len(data))


def collective(op: str, tag: str, steps: range, *, ranks: int = 4, p50: float = 0.02, mx: float = 0.05,
               transfer: float = 0.015, wait_p50: float = 0.005, wait_max: float = 0.03, wire_per_rank: int = 4_000_000,
               elements_per_rank: int = 1_000_000, slowest: int = 3, group: str = "world") -> CollectiveSeriesPublic:
    xs = list(steps)
    n = len(xs)
    return CollectiveSeriesPublic(
        op=op, group=group, tag=tag, estimated=bytes_estimated(tag), step=xs, ts=[TS0 + s for s in xs], final=[True] * n, calls=[1] * n,
        ranks=[ranks] * n, p50_s=[p50] * n, max_s=[mx] * n, min_s=[transfer] * n, slowest_rank=[slowest] * n,
        transfer_s=[transfer] * n, wait_p50_s=[wait_p50] * n, wait_max_s=[wait_max] * n,
        most_waiting_rank=[0] * n, payload_bytes=[wire_per_rank * ranks] * n, wire_bytes=[wire_per_rank * ranks] * n,
        elements=[elements_per_rank * ranks] * n,
    )


def collectives(job_id: str = "job", *series: CollectiveSeriesPublic) -> JobCollectivesPublic:
    return JobCollectivesPublic(job_id=job_id, data=list(series), count=len(series))


def incident(inc_id: int, kind: IncidentKind = IncidentKind.HANG, *, status: IncidentStatus = IncidentStatus.RECOVERED,
             rank: int | None = 1, node_id: str | None = "node-2", evidence: dict | None = None,
             detected_s: float = 100.0, acted_s: float | None = 102.0, recovered_s: float | None = 130.0
             ) -> IncidentPublic:
    """Detected ``detected_s`` after :data:`T0`, acted and recovered at their offsets (None: not yet)."""
    return IncidentPublic(
        id=inc_id, job_id="job", kind=kind, status=status, node_id=node_id, rank=rank, evidence=evidence or {},
        action="killed rank 1, evicted node-2" if acted_s is not None else None, step_at_detect=40,
        detected_at=T0 + timedelta(seconds=detected_s),
        acted_at=T0 + timedelta(seconds=acted_s) if acted_s is not None else None,
        recovered_at=T0 + timedelta(seconds=recovered_s) if recovered_s is not None else None,
    )


def fault(fault_id: int, kind: FaultKind = FaultKind.HANG_RANK, *, rank: int | None = 1, node_id: str | None = None,
          fired_s: float | None = 80.0, status: FaultStatus = FaultStatus.FIRED) -> FaultPublic:
    return FaultPublic(id=fault_id, job_id="job", kind=kind, rank=rank, node_id=node_id, step=40, params={},
                       status=status, message=None, created_at=T0,
                       fired_at=T0 + timedelta(seconds=fired_s) if fired_s is not None else None, cleared_at=None)


def checkpoint(ck_id: int, step: int, *, valid: bool = True, created_s: float | None = None,
               size: int = 2_500_000) -> CheckpointPublic:
    return CheckpointPublic(id=ck_id, job_id="job", step=step, path=f"/ckpt/step-{step}", valid=valid, world_size=4,
                            files=5, bytes=size, manifest_sha256="ab" * 32, loss=1.0,
                            created_at=T0 + timedelta(seconds=step if created_s is None else created_s))


WAITING_STACK = ('Thread 0x1 (idle): "vigil-train"\n    all_reduce (torch/distributed/distributed_c10d.py:2800)\n'
                 "    all_reduce (vigil/comm.py:90)\n    step (vigil/optim/adamw.py:40)\n"
                 "    train (vigil/loop.py:200)\n")
STOPPED_STACK = ('# process state: stopped\nThread 0x1 (idle): "vigil-train"\n    forward (vigil/model.py:120)\n'
                 "    _call_impl (torch/nn/modules/module.py:1700)\n    train (vigil/loop.py:190)\n")


def stacks(ranks: int = 4, odd: int = 1) -> StacksPublic:
    majority = [r for r in range(ranks) if r != odd]
    return StacksPublic(
        job_id="job", collected_at=T0,
        groups=[StackGroup(signature="all_reduce (distributed_c10d.py) < all_reduce (comm.py)", ranks=majority,
                           sample=WAITING_STACK),
                StackGroup(signature="forward (model.py) < _call_impl (module.py)", ranks=[odd], sample=STOPPED_STACK)],
        odd_ranks=[odd], stacks={r: (STOPPED_STACK if r == odd else WAITING_STACK) for r in range(ranks)},
    )


def goodput(job_id: str = "job") -> GoodputPublic:
    return GoodputPublic(job_id=job_id, wall_s=200.0, productive_s=150.0,
                         lost_s={"startup": 10.0, "restart": 20.0, "lost_steps": 12.0, "checkpoint": 3.0, "hang": 5.0,
                                 "other": 0.0},
                         ettr=0.75, restarts=1, steps_rerun=9)


def seconds_lost(job_id: str = "job", steps: int = 50) -> SecondsLostPublic:
    """Rank 2 on n1 cost 6 s of a 200 s job over 50 steps, rank 0 a little jitter, rank 1 (at the median
    pace, listed by the controller at 0 s) nothing; nothing known with 0 steps."""
    ranks = [RankLost(rank=2, node_id="n1", seconds_lost=6.0, share_of_wall=0.03, steps_charged=48,
                      last_step_lost_s=0.12),
             RankLost(rank=0, node_id="n0", seconds_lost=0.2, share_of_wall=0.001, steps_charged=2,
                      last_step_lost_s=0.0),
             RankLost(rank=1, node_id="n0", seconds_lost=0.0, share_of_wall=0.0, steps_charged=0,
                      last_step_lost_s=0.0)] if steps else []
    return SecondsLostPublic(job_id=job_id, wall_s=200.0, seconds_lost=6.2 if steps else 0.0,
                             share_of_wall=0.031 if steps else 0.0, steps=steps, ranks=ranks,
                             nodes=[NodeLost(node_id="n1", seconds_lost=6.0, share_of_wall=0.03, ranks=[2])]
                             if steps else [], step=list(range(1, steps + 1)), lost_s=[0.124] * steps)


def hang_evidence(ranks: int = 4, late: int = 1, seq: int = 82) -> dict[str, Any]:
    """The ``collectives`` of a hang's evidence, as the controller's diagnosis writes it: every rank but
    ``late`` inside ``all_reduce #seq`` of the world (done with ``#seq - 1``); ``late`` never entered it,
    idle since ``#seq - 1`` with nothing in flight."""
    reports: dict[int, dict[str, Any]] = {}
    for r in range(ranks):
        inside = r != late
        reports[r] = {"step": 40 if inside else 39, "idle_s": 31.25 if inside else 32.5, "state": {
            "groups": [{"group": "world", "last_enqueued": seq if inside else seq - 1, "last_completed": seq - 1}],
            "in_flight": [{"group": "world", "seq": seq, "op": "all_reduce", "enqueued_ts": TS0 + r}] if inside else [],
            "last_done": {"group": "world", "seq": seq - 1, "op": "all_reduce"},
        }}
    found = hang_collectives.analyse(reports)
    assert found is not None
    return {**found, "summary": hang_collectives.summary(found)}
