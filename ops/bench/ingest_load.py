"""The load the ingest benchmark plays (:mod:`ops.bench.ingest`): node agents' batches of a job of N
ranks, each rank a StepSample and ``collectives`` CollectiveSamples per step, as JSON bodies or as the
agents' columnar bodies, built before the clock starts; and the same rows as columns for the database's
own bound. Split from the benchmark's runner; the values are the same whichever form they take.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass

import numpy as np

_STEP = ('{{"kind":"step","job_id":"{job}","rank":{rank},"world_size":{world},"step":{step},"ts":{ts:.3f},'
         '"loss":{loss:.4f},"lr":0.001,"tokens":512,"step_time_s":{st:.5f},"tokens_per_s":4096.0,"data_s":0.002,'
         '"fwd_bwd_s":0.06,"optim_s":0.004,"comm_s":{comm:.5f},"pid":{pid}}}')
_COLL = ('{{"kind":"collective","job_id":"{job}","rank":{rank},"step":{step},"seq":{seq},"op":"all_reduce",'
         '"group":"world","tag":"grads","payload_bytes":4194304,"wire_bytes":8386560,"elements":1048576,'
         '"duration_s":{d:.6f},"ts":{ts:.3f}}}')


def build_bodies(job_id: str, ranks: int, collectives: int, samples: int, agents: int, batch: int) -> list[bytes]:
    """Gzip TelemetryBatch bodies holding ``samples`` samples in total, steps in order, ranks split over agents."""
    agents = max(1, min(agents, ranks))
    slices = [range(a * ranks // agents, (a + 1) * ranks // agents) for a in range(agents)]
    pending: list[list[str]] = [[] for _ in range(agents)]
    seqs = [0] * agents
    bodies: list[bytes] = []
    t0 = time.time()
    made = 0
    step = 0

    def cut(a: int) -> None:
        items = pending[a]
        body = (f'{{"agent_id":"bench-agent-{a}","node_id":"bench-node-{a}","seq":{seqs[a]},'
                f'"sent_at":{time.time():.3f},"samples":[' + ",".join(items) + "]}")
        bodies.append(gzip.compress(body.encode(), compresslevel=1))
        seqs[a] += 1
        pending[a] = []

    while made < samples:
        ts = t0 + step * 0.1
        for a, rs in enumerate(slices):
            for rank in rs:
                if pending[a] and len(pending[a]) + 1 + collectives > batch:
                    cut(a)
                slow = 1.0 + (0.5 if rank == ranks - 1 else 0.0)  # one straggler, for realism
                pending[a].append(_STEP.format(job=job_id, rank=rank, world=ranks, step=step, ts=ts,
                                               loss=3.0 - step * 1e-3, st=0.1 * slow, comm=0.02 * collectives,
                                               pid=10_000 + rank))
                for seq in range(collectives):
                    pending[a].append(_COLL.format(job=job_id, rank=rank, step=step, seq=seq,
                                                   d=0.002 + 0.0001 * (rank % 7) + 0.001 * (slow - 1.0), ts=ts))
                made += 1 + collectives
                if made >= samples:
                    break
            if made >= samples:
                break
        step += 1
    for a in range(agents):
        if pending[a]:
            cut(a)
    return bodies


@dataclass
class Batch:
    """One agent batch of the columnar load: its rank groups (a step sample and ``collectives``
    collective samples per (rank, step)), as arrays."""

    agent: int
    seq: int
    rank: np.ndarray
    step: np.ndarray


def plan_batches(ranks: int, collectives: int, samples: int, agents: int, batch: int) -> list[Batch]:
    """The same load as :func:`build_bodies` (steps in order, ranks split over agents, whole rank
    groups per batch), as arrays: group ``g`` is rank ``g % ranks`` at step ``g // ranks``."""
    agents = max(1, min(agents, ranks))
    per = 1 + collectives
    groups = -(-samples // per)
    g = np.arange(groups, dtype=np.int64)
    rank, step = g % ranks, g // ranks
    bounds = [a * ranks // agents for a in range(agents + 1)]
    owner = np.searchsorted(bounds, rank, side="right") - 1
    per_batch = max(1, batch // per)
    out: list[tuple[int, Batch]] = []
    for a in range(agents):
        idx = np.flatnonzero(owner == a)
        for seq, start in enumerate(range(0, len(idx), per_batch)):
            part = idx[start:start + per_batch]
            out.append((int(part[-1]), Batch(a, seq, rank[part], step[part])))
    out.sort(key=lambda x: x[0])  # in the order the JSON generator cuts them
    return [b for _, b in out]


_STRINGS = ["", "all_reduce", "world", "grads"]  # string 0 is the job id, filled in per run


def batch_columns(b: Batch, ranks: int, collectives: int, t0: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The batch's step and collective columns (the values :func:`build_bodies` writes as JSON)."""
    n = len(b.rank)
    slow = 1.0 + 0.5 * (b.rank == ranks - 1)
    ts = t0 + b.step * 0.1
    step = {
        "job_id": np.zeros(n, "<u4"), "rank": b.rank, "world_size": np.full(n, ranks, "<i8"), "step": b.step,
        "ts": ts, "loss": 3.0 - b.step * 1e-3, "lr": np.full(n, 0.001), "tokens": np.full(n, 512, "<i8"),
        "step_time_s": 0.1 * slow, "tokens_per_s": np.full(n, 4096.0), "data_s": np.full(n, 0.002),
        "fwd_bwd_s": np.full(n, 0.06), "optim_s": np.full(n, 0.004), "comm_s": np.full(n, 0.02 * collectives),
        "pid": 10_000 + b.rank,
    }
    k = collectives
    r = np.repeat(b.rank, k)
    coll = {
        "job_id": np.zeros(n * k, "<u4"), "rank": r, "step": np.repeat(b.step, k),
        "seq": np.tile(np.arange(k, dtype=np.int64), n), "op": np.full(n * k, 1, "<u4"),
        "group": np.full(n * k, 2, "<u4"), "tag": np.full(n * k, 3, "<u4"),
        "payload_bytes": np.full(n * k, 4194304, "<i8"), "wire_bytes": np.full(n * k, 8386560, "<i8"),
        "elements": np.full(n * k, 1048576, "<i8"),
        "duration_s": 0.002 + 0.0001 * (r % 7) + 0.001 * (np.repeat(slow, k) - 1.0), "ts": np.repeat(ts, k),
    }
    return step, coll


def build_columnar_bodies(job_id: str, ranks: int, collectives: int, samples: int, agents: int, batch: int
                          ) -> list[bytes]:
    """Gzip columnar bodies (:mod:`agent.columnar`) of the same load as :func:`build_bodies`."""
    from agent.columnar import encode_blocks
    from vigil.contract.schemas.columnar import ColumnBlock, column_specs

    strings = [job_id, *_STRINGS[1:]]
    t0 = time.time()
    bodies = []
    for b in plan_batches(ranks, collectives, samples, agents, batch):
        step, coll = batch_columns(b, ranks, collectives, t0)
        blocks = []
        for kind, cols in (("step", step), ("collective", coll)):
            specs = column_specs(kind)
            n = len(cols["job_id"])
            blocks.append(ColumnBlock(n=n, columns={k: np.ascontiguousarray(v, specs[k].dtype).tobytes()
                                                    for k, v in cols.items()}) if n else None)
        header = json.dumps({"agent_id": f"bench-agent-{b.agent}", "node_id": f"bench-node-{b.agent}",
                             "seq": b.seq, "sent_at": time.time()}).encode()
        bodies.append(gzip.compress(encode_blocks(header, strings, blocks[0], blocks[1]), compresslevel=1))
    return bodies
