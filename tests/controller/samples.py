"""Telemetry samples as ranks send them, for the controller tests: the one step-sample and the one
collective-sample factory (wire dicts of :mod:`vigil.contract.schemas`), and a random run built from them.

* :data:`KINDS`: the two collective kinds (op, group, tag) ``coll_sample`` alternates between by call seq;
* :func:`step_sample`, :func:`coll_sample`: one sample of a rank at a step (a world of 4 ranks);
* :func:`random_run`: every rank's step sample and collectives for a few steps, seeded.

Plain dicts built in memory: needs nothing (no app, no database).
"""

from __future__ import annotations

import random
import time

KINDS = [("all_reduce", "world", "grads"), ("all_gather", "world", "weights")]


def step_sample(job: str, rank: int, step: int, st: float, ts: float, comm: float | None = None) -> dict:
    return {"kind": "step", "job_id": job, "rank": rank, "world_size": 4, "step": step, "ts": ts, "loss": 2.0 + rank,
            "step_time_s": st, "tokens": 64, "tokens_per_s": 64 / st, "data_s": 0.01, "fwd_bwd_s": 0.05,
            "optim_s": 0.01, "comm_s": comm}


def coll_sample(job: str, rank: int, step: int, seq: int, d: float, ts: float) -> dict:
    op, group, tag = KINDS[seq % 2]
    return {"kind": "collective", "job_id": job, "rank": rank, "step": step, "seq": seq, "op": op, "group": group,
            "tag": tag, "payload_bytes": 1000 + seq, "wire_bytes": 1500 + seq, "elements": 250, "duration_s": d,
            "ts": ts}


def random_run(job: str, ranks: int = 4, steps: int = 3, calls: int = 5, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    now = time.time()
    out = []
    for st in range(steps):
        for r in range(ranks):
            out.append(step_sample(job, r, st, rng.uniform(0.05, 0.3), now + st))
            out += [coll_sample(job, r, st, q, round(rng.uniform(0.001, 0.02), 6), now + st) for q in range(calls)]
    return out
