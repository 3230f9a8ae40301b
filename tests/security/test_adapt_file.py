"""recovery.policy adapt, as an attacker: a job's code can write its own adapt file (its ranks own their faults
folder, as they own the fault file). What does a forged file get it? Only what the spec allows: a version
asking for a parameter other than ``tau`` (``lr``, ``sharded``), a value the params class refuses, or a file
that is not the format is never applied, the strategy keeps its setting, and the controller is told nothing
(no ``adapt`` report). This is the rank's side; on the controller's side a report can only name the job's own
incidents (``controller.recovery.adapt.record_switch`` looks up the sample's job), and samples for a job are
accepted only from nodes holding its ranks (the telemetry guard, issue 23)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.vigil.telemetry_sink import FaultSink
from vigil import sdk as vigil
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import adapt_file_path, fault_file_path

SPEC = JobCreate.model_validate({
    "name": "forged", "steps": 12, "checkpoint": {"interval_steps": 5},
    "optimizer": {"kind": "slowmo", "lr": 1e-2, "params": {"tau": 2}},
    "recovery": {"policy": "adapt", "adapt": {"params": {"tau": 6}}}})


def _train(steps: int, taus: dict[int, int], lrs: dict[int, float]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = vigil.optimizer(model)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        with vigil.step(step) as s:
            x = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(opt.model(x), x[:, :1])
            loss.backward()
            opt.step()
            s.report(loss)
        taus[step] = opt.strategy.tau  # type: ignore[attr-defined]
        lrs[step] = opt.strategy.config.alpha  # type: ignore[attr-defined]


@pytest.mark.parametrize("forged", [
    {"versions": [{"version": 1, "params": {"lr": 10.0}}]},  # not a param of the method at all
    {"versions": [{"version": 1, "params": {"alpha": 50.0}}]},  # a param adapt may not change
    {"versions": [{"version": 1, "params": {"sharded": False, "tau": 6}}]},  # tau smuggling another change
    {"versions": [{"version": 1, "params": {"tau": 0}}]},  # a value the params class refuses
    {"versions": [{"version": 1, "params": {"tau": "6; rm -rf /"}}]},  # not even a number
    "not json at all",
])
def test_a_forged_adapt_file_changes_nothing_and_reports_nothing(tmp_path: Path, forged: Any) -> None:
    path = adapt_file_path(tmp_path, "job-forged", 0)
    path.parent.mkdir(parents=True)
    path.write_text(forged if isinstance(forged, str) else json.dumps(forged))
    os.chmod(path, 0o644)
    sink, taus, alphas = FaultSink(), {}, {}
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-forged", telemetry=sink,
                            fault_file=fault_file_path(tmp_path, "job-forged", 0))
    vigil.run(lambda cfg: _train(12, taus, alphas), ctx, SPEC)
    assert set(taus.values()) == {2} and set(alphas.values()) == {1.0}  # the spec's setting throughout
    assert [f for f in sink.faults if f.fault_kind == "adapt"] == []  # nothing claimed to the controller
    assert len(sink.steps) == 12  # and the job trained on
