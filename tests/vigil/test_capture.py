"""Collectives of code that never calls Vigil's optimizer, read from torch's Flight Recorder (vigil.capture).

Pure tests of the entry, byte and window rules on recorder dumps written out by hand; then 2 gloo ranks
(``run_ranks``: 127.0.0.1, free port, under a timeout, ``TORCH_FR_BUFFER_SIZE`` set before the group)
run a plain DDP loop with torch's own optimizer and Vigil's ``init/step/report/checkpoint`` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.vigil.optim.harness import run_ranks
from tests.vigil.telemetry_sink import Sink
from vigil import sdk as vigil
from vigil.capture import (
    FR_BUFFER_ENV,
    SEQ_BASE,
    CollectiveCapture,
    Window,
    assign,
    busy_seconds,
    entries,
    estimate_bytes,
    group_label,
    op_name,
)
from vigil.contract.schemas import CAPTURED_TAG, JobCreate


def _entry(record_id: int, seq: int, created_ns: int, *, op: str = "gloo:all_reduce", pg: tuple[str, str] = ("0", "default_pg"),
           retired: bool = True, sizes: list[list[int]] | None = None) -> dict[str, Any]:
    return {"record_id": record_id, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": seq,
            "p2p_seq_id": 0, "profiling_name": op, "time_created_ns": created_ns,
            "input_sizes": sizes if sizes is not None else [[1000]], "input_dtypes": ["Float"],
            "state": "scheduled", "retired": retired, "is_p2p": False}


def test_names_and_bytes_follow_the_op_and_the_ring() -> None:
    assert op_name("gloo:all_reduce") == "all_reduce" and op_name("nccl:_allgather_base") == "all_gather"
    assert op_name("nccl:_reduce_scatter_base") == "reduce_scatter" and op_name("gloo:barrier") == "barrier"
    assert group_label(("0", "default_pg")) == "world" and group_label(("3", "undefined")) == "pg3"
    assert group_label(("2", "mesh_dp")) == "mesh_dp"
    assert estimate_bytes("all_reduce", ["Float"], [[1000]], 4) == (4000, 6000, 1000)
    assert estimate_bytes("all_gather", ["BFloat16"], [[10, 10]], 4) == (200, 600, 100)
    assert estimate_bytes("reduce_scatter", ["Float"], [[400]], 4) == (1600, 1200, 400)
    assert estimate_bytes("broadcast", ["Long"], [[3]], 2) == (24, 24, 3)
    assert estimate_bytes("all_reduce", ["Float"], [[1000]], 1)[1] == 0  # a group of one sends nothing
    assert estimate_bytes("barrier", [], [], 4) == (0, 0, 0)


def test_entries_land_in_their_step_and_end_where_the_rank_had_to_have_them() -> None:
    s = 1_000_000_000
    dump = {"entries": [
        _entry(0, 1, 1 * s),                      # start-up (DDP's broadcast), before the first step
        _entry(1, 2, 10 * s),                     # step 1, before its optimizer step: ends there
        _entry(2, 3, 12 * s + 5),                 # step 1, after the optimizer step: ends with the step
        _entry(3, 1, 21 * s, pg=("1", "undefined")),  # step 2, another group
        _entry(4, 4, 30 * s, retired=False),      # step 3, not marked retired yet: the step's end bounds it
        _entry(5, 5, 40 * s),                     # after the last step: held
    ]}
    found = entries(dump, {"0": 2, "1": 2}, 2)
    windows = [Window(1, 9 * s, 11 * s, 13 * s), Window(2, 20 * s, None, 22 * s), Window(3, 29 * s, None, 31 * s)]
    records, later = assign(found, windows, before_first=0)
    by_seq = {r.seq: r for r in records}
    assert [r.step for r in records] == [0, 1, 1, 2, 3]
    assert by_seq[SEQ_BASE + 1].duration_s == pytest.approx(8.0)     # until the first step began
    assert by_seq[SEQ_BASE + 2].duration_s == pytest.approx(1.0)     # until the optimizer step
    assert by_seq[SEQ_BASE + 3].duration_s == pytest.approx(1.0, abs=1e-6)  # until the step's end
    assert by_seq[SEQ_BASE + (1 << 20) + 1].group == "pg1"           # seq keeps groups apart
    assert all(r.tag == CAPTURED_TAG and r.wire_bytes == 4000 for r in records)
    assert by_seq[SEQ_BASE + 4].duration_s == pytest.approx(1.0)
    assert [e.record_id for e in later] == [5]
    assert busy_seconds(r for r in records if r.step == 1) == pytest.approx(2.0, abs=1e-6)


def test_a_read_refreshes_what_it_held_and_skips_vigils_own_groups() -> None:
    s = 1_000_000_000
    dumps = [
        {"entries": [_entry(0, 1, 1 * s, retired=False), _entry(1, 1, 1 * s, pg=("7", "undefined"))]},
        {"entries": [_entry(0, 1, 1 * s), _entry(1, 1, 1 * s, pg=("7", "undefined")), _entry(2, 2, 2 * s)]},
    ]
    cap = CollectiveCapture(2, exclude={"7"}, dump=lambda: dumps.pop(0))
    first = cap.read()
    assert [(e.record_id, e.done) for e in first] == [(0, False)]
    cap.hold(first)
    second = cap.read()
    assert [(e.record_id, e.done) for e in second] == [(0, True), (2, True)]
    assert cap.reads == 2


# -- two real ranks ------------------------------------------------------------------------------------


def fr_on(rank: int) -> None:
    """In each rank's process, before its process group: the Flight Recorder on. (The ranks fork from a
    forkserver that an earlier test may have started with another environment.)"""
    import os

    os.environ[FR_BUFFER_ENV] = "500"


def _plain_ddp(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A user's plain DDP loop: torch's DDP and AdamW, a dist.all_reduce of its own on a group of its own,
    and Vigil's init / step / report / checkpoint only."""
    sink = Sink()
    ctx = vigil.RankContext(rank=rank, world_size=world_size, job_id="job-capture", telemetry=sink,
                            checkpoint_root=Path(root))
    spec = JobCreate.model_validate({"name": "cap", "steps": 5, "checkpoint": {"interval_steps": 5}})

    def train(config: dict[str, Any]) -> None:
        vigil.init()
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mine = dist.new_group([0, 1])
        x = torch.randn(32, 16)
        for step in range(1, 6):
            with vigil.step(step):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total, group=mine)
                vigil.report(loss=float(total) / world_size, tokens=32)
            vigil.checkpoint(step, model=model, optimizer=opt)

    vigil.run(train, ctx, spec)
    return {
        "steps": [(s.step, s.comm_s) for s in sink.steps],
        "records": [(r.step, r.seq, r.op, r.group, r.tag, r.payload_bytes, r.wire_bytes, r.duration_s)
                    for recs in sink.records for r in recs],
    }


def test_plain_ddp_collectives_are_captured_per_step_on_every_rank(tmp_path: Path) -> None:
    out = run_ranks(2, _plain_ddp, str(tmp_path / "ckpt"), timeout=120, setup=fr_on)
    params = 16 * 32 + 32 + 32 + 1
    for rank_out in out:
        assert [s for s, _ in rank_out["steps"]] == [1, 2, 3, 4, 5]
        assert all(c is not None and c > 0 for _, c in rank_out["steps"])
        recs = rank_out["records"]
        assert recs and all(r[4] == CAPTURED_TAG for r in recs)
        for step in range(1, 6):
            ops = {(op, group) for s, _, op, group, *_ in recs if s == step}
            # DDP's gradient bucket on the world, and the user's own all-reduce on its own group
            assert ("all_reduce", "world") in ops and any(op == "all_reduce" and g.startswith("pg") for op, g in ops)
        grads = [r for r in recs if r[0] >= 1 and r[3] == "world" and r[2] == "all_reduce"]
        assert all(p == params * 4 and w == params * 4 for *_, p, w, _d in grads)  # 2 (n-1)/n = 1 for n = 2
        assert any(s == 0 and op == "broadcast" for s, _, op, *_ in recs)  # DDP's start-up broadcast
        assert all(d >= 0 for *_, d in recs)
    # The same call has the same seq on both ranks (the controller lines them up for the wait).
    keys = [{(s, q, op, g) for s, q, op, g, *_ in o["records"]} for o in out]
    assert keys[0] == keys[1]


def _sleepy(rank: int, world_size: int) -> list[dict[str, Any]]:
    """A plain DDP loop whose rank 1 sleeps in its own code at step 4 (no fault API): what each rank's
    watcher reports meanwhile."""
    sink = Sink()
    reports: list[dict[str, Any]] = []
    sink.send_progress = lambda p: reports.append(p.model_dump(mode="json"))  # type: ignore[attr-defined]
    ctx = vigil.RankContext(rank=rank, world_size=world_size, job_id="job-hang", telemetry=sink)
    spec = JobCreate.model_validate({"name": "hang", "steps": 5, "checkpoint": {"interval_steps": 0}})

    def train(config: dict[str, Any]) -> None:
        import time

        vigil.init()
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, 6):
            with vigil.step(step):
                if rank == 1 and step == 4:
                    time.sleep(5.0)
                opt.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                opt.step()

    vigil.run(train, ctx, spec)
    return reports


def test_a_rank_asleep_in_its_own_loop_is_named_by_the_collective_the_other_waits_in() -> None:
    from controller.recovery.collectives import analyse

    out = run_ranks(2, _sleepy, timeout=120, setup=fr_on)
    assert out[0] and out[1], "both watchers report while the steps stall"
    waiting = [r for r in out[0] if r["in_flight"]]
    assert waiting and waiting[-1]["in_flight"][-1]["op"] == "all_reduce" and waiting[-1]["step"] == 4
    assert not out[1][-1]["in_flight"]  # the sleeper is inside no collective
    last = {rank: {"step": o[-1]["step"], "idle_s": o[-1]["idle_s"], "state": o[-1]} for rank, o in enumerate(out)}
    last[0] = {"step": waiting[-1]["step"], "idle_s": waiting[-1]["idle_s"], "state": waiting[-1]}
    found = analyse(last)
    assert found is not None and found["not_entered"] == [1] and found["waiting_ranks"] == [0]
    assert found["waiting_in"]["group"] == "world"


def _unmarked(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Code written for plain PyTorch: no vigil.step, no vigil.report; Vigil only opened the session. A
    slow_rank fault file for rank 1 from step 6."""
    import json

    from vigil.contract.settings import fault_file_path

    fault = fault_file_path(Path(root) / "run", "job-auto", rank)
    if rank == 1:
        fault.parent.mkdir(parents=True, exist_ok=True)
        fault.write_text(json.dumps({"kind": "slow_rank", "step": 6, "fault_id": 3, "factor": 6}))
    sink = Sink()
    ctx = vigil.RankContext(rank=rank, world_size=world_size, job_id="job-auto", telemetry=sink, fault_file=fault)
    spec = JobCreate.model_validate({"name": "auto", "steps": 10, "checkpoint": {"interval_steps": 0}})

    def train(config: dict[str, Any]) -> None:
        import time

        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 16)
        for _ in range(10):
            time.sleep(0.02)  # compute the slow rank stretches
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    vigil.run(train, ctx, spec)
    return {"steps": [(s.step, s.fwd_bwd_s, s.comm_s, s.optim_s) for s in sink.steps],
            "records": [(r.step, r.op, r.group) for recs in sink.records for r in recs]}


def test_unmarked_code_is_stepped_by_its_optimizer_with_collectives_and_faults(tmp_path: Path) -> None:
    out = run_ranks(2, _unmarked, str(tmp_path), timeout=120, setup=fr_on)
    for o in out:
        # The first optimizer step starts the clock; the rest are steps, numbered by AdamW's own count.
        assert [s for s, *_ in o["steps"]] == list(range(2, 11))
        assert all(c is not None and c > 0 and opt is not None for _, _, c, opt in o["steps"])
        assert {s for s, op, g in o["records"] if op == "all_reduce" and g == "world"} >= set(range(2, 11))
    compute = {r: sorted(c for s, c, *_ in out[r]["steps"] if s >= 7) for r in (0, 1)}
    # rank 1's compute stretched 6x from step 6 on; rank 0's wait for it is communication, not compute
    assert compute[1][len(compute[1]) // 2] > 3 * compute[0][len(compute[0]) // 2], compute
