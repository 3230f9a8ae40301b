"""Ray Train code as it is (vigil.raytrain): manifests of its checkpoints, restore past a corrupt one, and its
reported metrics as step telemetry.

The manifest and choice rules run on real folders through pyarrow's local filesystem (what Ray Train's
``Checkpoint`` carries). The bridge runs in front of a stand-in for Ray's worker utilities (``RayLike``:
copies a reported folder into a run folder as Ray's storage does, hands back the newest) inside a real Vigil
session of a world of one; the whole path on a real Ray cluster is tests/e2e/test_user_code.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
from ray.train import Checkpoint
from torch import nn

from tests.vigil.telemetry_sink import Sink
from vigil import raytrain
from vigil import sdk as vigil
from vigil.contract.schemas import JobCreate

FS = pafs.LocalFileSystem()


def _folder(root: Path, name: str, payload: bytes = b"weights") -> Path:
    d = root / name
    (d / "nested").mkdir(parents=True)
    (d / "state.pt").write_bytes(payload)
    (d / "nested" / "extra.json").write_text('{"epoch": 1}')
    return d


def test_a_manifest_lists_nested_files_and_verification_names_the_first_problem(tmp_path: Path) -> None:
    d = _folder(tmp_path, "ckpt")
    body = raytrain.write_manifest(d, step=40, world_size=2, job_id="j", loss=float("nan"))
    assert sorted(f["path"] for f in body["files"]) == ["nested/extra.json", "state.pt"]
    assert body["loss"] is None and body["step"] == 40
    assert raytrain.verify(FS, str(d))["step"] == 40
    (d / "nested" / "extra.json").write_text('{"epoch": 2}')  # same size, other bytes
    with pytest.raises(raytrain.InvalidCheckpoint, match="nested/extra.json fails its sha256"):
        raytrain.verify(FS, str(d))
    (d / "state.pt").write_bytes(b"w")
    with pytest.raises(raytrain.InvalidCheckpoint, match="state.pt has 1 bytes, the manifest says 7"):
        raytrain.verify(FS, str(d))
    (d / "state.pt").unlink()
    with pytest.raises(raytrain.InvalidCheckpoint, match="state.pt is missing"):
        raytrain.verify(FS, str(d))


def test_a_manifest_naming_a_path_outside_its_folder_is_refused(tmp_path: Path) -> None:
    d = _folder(tmp_path, "ckpt")
    body = raytrain.write_manifest(d, step=1, world_size=1, job_id="j", loss=None)
    body["files"][0]["path"] = "../../etc/passwd"
    (d / raytrain.MANIFEST).write_text(json.dumps(body))
    with pytest.raises(raytrain.InvalidCheckpoint, match="unsafe path"):
        raytrain.verify(FS, str(d))


def test_restore_takes_rays_pick_or_the_newest_sibling_that_verifies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (10, 20, 30):
        raytrain.write_manifest(_folder(run, f"checkpoint_{step}"), step=step, world_size=2, job_id="j", loss=1.0)
    _folder(run, "checkpoint_99")  # no manifest: not one of Vigil's, never a fallback
    path, body, skipped = raytrain.choose(FS, str(run / "checkpoint_30"))
    assert path == str(run / "checkpoint_30") and body is not None and not skipped
    (run / "checkpoint_30" / "state.pt").write_bytes(b"WEIGHTS")
    (run / "checkpoint_20" / "state.pt").write_bytes(b"")
    path, body, skipped = raytrain.choose(FS, str(run / "checkpoint_30"))
    assert path == str(run / "checkpoint_10") and body is not None and body["step"] == 10
    assert [(s.step, "sha256" in s.reason or "bytes" in s.reason) for s in skipped] == [(30, True), (20, True)]
    (run / "checkpoint_10" / "state.pt").unlink()
    assert raytrain.choose(FS, str(run / "checkpoint_30"))[0] is None
    # a checkpoint Vigil never saw written is handed over as Ray picked it
    assert raytrain.choose(FS, str(run / "checkpoint_99"))[:2] == (str(run / "checkpoint_99"), None)


class RayLike:
    """Ray Train's worker utilities as far as the bridge uses them: a reported folder is copied into the run
    folder (``checkpoint_<n>``), and the newest copy is the checkpoint handed back."""

    def __init__(self, run: Path, latest: Checkpoint | None = None) -> None:
        self.run, self.latest, self.reports = run, latest, []

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None, **kwargs: Any) -> None:
        self.reports.append(dict(metrics))
        if checkpoint is not None:
            dest = self.run / f"checkpoint_{len(self.reports):03d}"
            shutil.copytree(checkpoint.path, dest)
            self.latest = Checkpoint(str(dest))

    def get_checkpoint(self) -> Checkpoint | None:
        return self.latest

    def get_context(self) -> str:
        return "ray's own"


def _session_running(fn: Any, sink: Sink) -> None:
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-rt", telemetry=sink)
    spec = JobCreate.model_validate({"name": "rt", "steps": 8, "checkpoint": {"interval_steps": 0}})
    vigil.run(fn, ctx, spec)


def _bridge(inner: RayLike) -> raytrain.Bridge:
    return raytrain.Bridge(inner, job_id="job-rt", rank=0, world_size=1, session=lambda: vigil._current)


def test_reported_metrics_land_on_the_step_they_follow_and_checkpoints_get_manifests(tmp_path: Path) -> None:
    sink, inner = Sink(), RayLike(tmp_path / "run")
    inner.run.mkdir()
    bridge = _bridge(inner)

    def train(config: dict[str, Any]) -> None:
        model = nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(16, 4)
        for i in range(1, 9):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt = None
            if i % 4 == 0:
                folder = tmp_path / f"local-{i}"
                folder.mkdir()
                torch.save(model.state_dict(), folder / "state.pt")
                ckpt = Checkpoint.from_directory(str(folder))
            bridge.report({"loss": 10.0 + i, "lr": 1e-2, "step": i, "epoch": 0}, checkpoint=ckpt)

    _session_running(train, sink)
    assert bridge.get_context() == "ray's own"  # what the bridge does not change is Ray's
    assert [r["step"] for r in inner.reports] == list(range(1, 9))  # Ray Train got every report as written
    # step 1 only starts the clock (the first optimizer step); each later step carries its own report's loss
    assert [(s.step, s.loss, s.lr) for s in sink.steps] == [(i, 10.0 + i, 1e-2) for i in range(2, 9)]
    assert [(c.step, c.valid, c.files) for c in sink.checkpoints] == [(4, True, 1), (8, True, 1)]
    assert sink.checkpoints[1].path == str(inner.run / "checkpoint_008")  # where Ray keeps it, not the temp folder
    assert sink.checkpoints[1].bytes == (tmp_path / "local-8" / "state.pt").stat().st_size
    assert raytrain.verify(FS, sink.checkpoints[1].path)["step"] == 8


def test_code_without_a_torch_optimizer_is_stepped_by_its_reports(tmp_path: Path) -> None:
    sink, inner = Sink(), RayLike(tmp_path)
    bridge = _bridge(inner)

    def train(config: dict[str, Any]) -> None:
        import time

        for i in range(1, 7):
            time.sleep(0.01)
            bridge.report({"loss": float(i), "step": i})

    _session_running(train, sink)
    # the first report starts the clock, the second opens a step, each later one ends one
    assert [(s.step, s.loss) for s in sink.steps] == [(i, float(i)) for i in range(3, 7)]
    assert all(s.step_time_s >= 0.01 for s in sink.steps)


def test_a_restart_is_handed_the_newest_checkpoint_that_verifies_and_the_controller_told(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (30, 60):
        raytrain.write_manifest(_folder(run, f"checkpoint_{step}", b"weights-%d" % step), step=step, world_size=1,
                                job_id="job-rt", loss=None)
    (run / "checkpoint_60" / "state.pt").write_bytes(b"weights-66")  # one byte flipped after the save
    sink, inner = Sink(), RayLike(run, Checkpoint(str(run / "checkpoint_60")))
    bridge = _bridge(inner)
    got: list[Any] = []

    def train(config: dict[str, Any]) -> None:
        got.append(bridge.get_checkpoint())
        got.append(bridge.get_checkpoint())  # asked again: the same answer, not verified again

    _session_running(train, sink)
    assert [c.path for c in got] == [str(run / "checkpoint_30")] * 2
    assert [(c.step, c.valid) for c in sink.checkpoints] == [(60, False)]
    assert "sha256" in sink.checkpoints[0].message
