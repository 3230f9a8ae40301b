"""``recovery.policy: adapt`` across ranks: the agreement at checkpoint boundaries (vigil/rank/adapt.py) in
real 2-rank gloo runs of the rank API (``run_ranks``: 127.0.0.1, a free port, under a timeout).

Each rank writes its own adapt file at a chosen step of its loop, standing in for its node's agent (which
writes the ranks' files at different times); the test then checks when each rank's ``local_adamw`` changed
its ``tau``, at which steps it really synchronised, which ``adapt`` collectives it made and what it reported.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.vigil.optim.harness import run_ranks
from tests.vigil.telemetry_sink import FaultSink
from vigil import sdk as vigil
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import adapt_file_path, fault_file_path

TIMEOUT = 100
Versions = list[tuple[int, dict[str, Any]]]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _write(path: Path, versions: Versions) -> None:
    """As the agent does: the whole history, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"versions": [{"version": v, "params": p} for v, p in versions]}))
    os.replace(tmp, path)


def _spec(policy: str, steps: int) -> JobCreate:
    recovery: dict[str, Any] = {"policy": policy}
    if policy == "adapt":
        recovery["adapt"] = {"params": {"tau": 6}}
    return JobCreate.model_validate({
        "name": "adapt", "steps": steps, "checkpoint": {"interval_steps": 10},
        "optimizer": {"kind": "local_adamw", "lr": 1e-2, "params": {"tau": 4}}, "recovery": recovery})


def _rank(rank: int, world: int, root: str, policy: str, steps: int,
          writes: dict[int, dict[int, Versions]]) -> dict[str, Any]:
    """One rank's run: ``writes[rank][step]`` is written to its adapt file just before ``step`` opens."""
    job = f"job-{policy.replace('_', '-')}"
    sink, lines, taus = FaultSink(), _Lines(), {}
    logging.getLogger("vigil.rank.adapt").addHandler(lines)
    ctx = vigil.RankContext(rank=rank, world_size=world, job_id=job, telemetry=sink,
                            fault_file=fault_file_path(root, job, rank), checkpoint_root=Path(root) / "ckpt",
                            async_checkpoints=False)

    def loop(cfg: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = vigil.optimizer(model)
        g = torch.Generator().manual_seed(10 + rank)
        for step in range(1, steps + 1):
            if step in writes.get(rank, {}):
                _write(adapt_file_path(root, job, rank), writes[rank][step])
            with vigil.step(step) as s:
                x = torch.randn(8, 4, generator=g)
                opt.zero_grad()
                loss = nn.functional.mse_loss(opt.model(x), x[:, :1])
                loss.backward()
                opt.step()
                s.report(loss)
            taus[step] = opt.strategy.tau  # type: ignore[attr-defined]
            vigil.checkpoint(step, model=model, optimizer=opt)

    vigil.run(loop, ctx, _spec(policy, steps))
    records = [r for recs in sink.records for r in recs]
    return {
        "taus": taus,
        "syncs": sorted({r.step for r in records if r.tag == "sync"}),
        "adapt": [(r.step, r.op) for r in records if r.tag == "adapt"],
        "faults": [(f.fault_kind, f.fault_id, f.step, f.rank, f.job_id) for f in sink.faults],
        "log": lines.lines,
    }


def _taus(*spans: tuple[int, int, int]) -> dict[int, int]:
    """Step -> tau after that step, from (first, last, tau) spans."""
    return {s: tau for first, last, tau in spans for s in range(first, last + 1)}


@pytest.mark.timeout(TIMEOUT + 20)
def test_ranks_switch_together_at_the_boundary_after_the_last_of_them_reads_a_version(tmp_path: Path) -> None:
    v1: Versions = [(1, {"tau": 6})]
    v2: Versions = [*v1, (2, {})]
    # Rank 0 reads version 1 before step 10, rank 1 only after step 20: the switch waits for step 30.
    # Version 2 (the spec's own) likewise: rank 0 before step 40, rank 1 after it.
    writes = {0: {5: v1, 35: v2}, 1: {25: v1, 45: v2}}
    per_rank = run_ranks(2, _rank, str(tmp_path), "adapt", 60, writes, timeout=TIMEOUT)
    for rank, res in enumerate(per_rank):
        assert res["taus"] == _taus((1, 29, 4), (30, 49, 6), (50, 60, 4)), rank
        # tau 4 until step 30 (last sync at 28), then 6 from that sync on (34, 40, 46), then 4 from 46 on
        # (step 50, 4 steps after it, still ran with 6: the switch comes after its optimizer step).
        assert res["syncs"] == [4, 8, 12, 16, 20, 24, 28, 34, 40, 46, 51, 55, 59], rank
        # One all-reduce at the first step and at each boundary, and the params check where a version is taken.
        assert res["adapt"] == [(s, "all_reduce") for s in (1, 10, 20, 30, 30, 40, 50, 50, 60)], rank
        assert res["faults"] == [("adapt", 1, 30, rank, "job-adapt"), ("adapt", 2, 50, rank, "job-adapt")], rank
        assert res["log"] == ["adapt: version 1 (tau 4 -> 6) from step 30", "adapt: version 2 (tau 6 -> 4) from step 50"]


@pytest.mark.timeout(TIMEOUT + 20)
def test_a_version_whose_params_differ_between_ranks_is_taken_by_none(tmp_path: Path) -> None:
    # A faulty controller gave the ranks different params for version 1: taking them would split the sync
    # schedule (and pair one rank's sync with another's next collective). Version 2 agrees.
    writes = {0: {1: [(1, {"tau": 7})], 3: [(1, {"tau": 7}), (2, {"tau": 5})]},
              1: {1: [(1, {"tau": 9})], 6: [(1, {"tau": 9}), (2, {"tau": 5})]}}
    per_rank = run_ranks(2, _rank, str(tmp_path), "adapt", 20, writes, timeout=TIMEOUT)
    for rank, res in enumerate(per_rank):
        assert res["taus"] == _taus((1, 9, 4), (10, 20, 5)), rank
        assert res["syncs"] == [4, 8, 13, 18], rank
        assert res["faults"] == [("adapt", 2, 10, rank, "job-adapt")], rank
        assert res["adapt"] == [(s, "all_reduce") for s in (1, 1, 10, 10, 20)], rank
        assert res["log"] == ["adapt: version 1 is not the same on every rank; the ranks keep version 0",
                              "adapt: version 2 (tau 4 -> 5) from step 10"], rank


@pytest.mark.timeout(TIMEOUT + 20)
def test_a_job_without_policy_adapt_makes_no_adapt_collective(tmp_path: Path) -> None:
    writes = {0: {1: [(1, {"tau": 7})]}, 1: {1: [(1, {"tau": 7})]}}  # files there, nobody looks
    per_rank = run_ranks(2, _rank, str(tmp_path), "evict_restart", 20, writes, timeout=TIMEOUT)
    for rank, res in enumerate(per_rank):
        assert res["adapt"] == [] and res["faults"] == [] and res["log"] == [], rank
        assert set(res["taus"].values()) == {4} and res["syncs"] == [4, 8, 12, 16, 20], rank
