"""Re-score the 30-minute chaos run with rank 0's step series rebuilt from what its database still held.

Usage: ``python docs/bench/rescore_chaos_30min.py docs/bench/chaos_30min.json <bench home>/vigil.db OUT.json``

That run read rank 0's rows only after the fault-free twin had run (85 minutes after the faulted job
began), when the controller had pruned raw rows older than its retention (an hour): the faults of the
first half found no steps after them and scored ``recovered: false``. Fixed in the bench since (it reads
them before the fault-free run). Here the series is the raw rows still there plus rank 0's per-step
aggregates (``rank_step_stats``: every step, its latest attempt), with which a restart shows as the
pause before the first step after it (``RESTART_GAP_S``). Everything else is scored as the bench does.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from sqlalchemy import text

from ops.bench.chaos_db import incidents_since
from ops.bench.chaos_plan import FaultRecord, score
from controller.db import make_engine


def main(report: str, database: str, out: str) -> None:
    d = json.load(open(report))
    engine = make_engine(f"sqlite:///{database}")
    with engine.connect() as c:
        raw = c.execute(text("SELECT ts, step FROM step_metrics WHERE job_id = :j AND rank = 0"), {"j": d["job_id"]}).all()
        agg = c.execute(text("SELECT ts, step FROM rank_step_stats WHERE job_id = :j AND rank = 0"),
                        {"j": d["job_id"]}).all()
    rank0 = sorted({(float(t), int(s)) for t, s in [*raw, *agg]})
    names = {f.name for f in dataclasses.fields(FaultRecord)}
    records = []
    for f in d["faults"]:
        kw = {k: v for k, v in f.items() if k in names}
        kw["signal_seen"] = bool(f["detected"]) if f["kind"] in ("agent_kill_9", "controller_kill_9") else False
        records.append(FaultRecord(**kw))
    scored = score(records, incidents_since(engine, 0.0), rank0)
    scored["rank0_rows"] = {"raw": len(raw), "aggregates": len(agg)}
    with open(out, "w") as f:
        json.dump(scored, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
