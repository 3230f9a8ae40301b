"""DCP checkpoint folders: exact round trip, manifest, validity, fallback past corrupt and partial
checkpoints, retention, the non-finite guard, pointers, asynchronous saves.

Single process, no process group (world size 1 strategies do not communicate); CPU torch only;
files under pytest's tmp_path. The multi-rank and world-size-change cases are in
``test_checkpoint_reshard.py``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vigil.checkpoint_helpers import CheckpointSink as Sink
from tests.vigil.checkpoint_helpers import build_parts as _parts
from tests.vigil.checkpoint_helpers import train_steps as _train_steps
from vigil import checkpointing as checkpoint
from vigil.checkpointing import Checkpointer, InvalidCheckpoint, state_of
from vigil.data import BatchSampler


def _save(root: Path, step: int, parts: tuple[Any, Any, BatchSampler]) -> Path:
    d = checkpoint.step_dir(root, step)
    model, strategy, data = parts
    checkpoint.save(d, step=step, rank=0, world_size=1, model=model, strategy=strategy, data=data, loss=1.5)
    return d


def _data_file(d: Path) -> Path:
    return next(p for p in d.iterdir() if p.suffix == ".distcp")


def test_round_trip_restores_everything_and_the_manifest_describes_the_folder(tmp_path: Path) -> None:
    model, strategy, data = parts = _parts(0)
    _train_steps(model, strategy, data, 3)
    d = _save(tmp_path, 3, parts)
    assert sorted(p.name for p in d.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]  # no temp files
    manifest = checkpoint.verify(d)
    assert (manifest.step, manifest.world_size, manifest.loss) == (3, 1, 1.5)
    assert {n: size for n, (size, _) in manifest.files.items()} == {
        p.name: p.stat().st_size for p in d.iterdir() if p.name != "manifest.json"
    }
    body = json.loads((d / "manifest.json").read_text())
    assert body["step"] == 3 and body["world_size"] == 1 and len(body["files"]) == 2
    rng_at_save, py_rng_at_save = torch.get_rng_state(), random.getstate()

    m2, s2, d2 = _parts(1)  # different init, fresh optimizer, other data position
    torch.manual_seed(123)
    random.seed(5)
    assert checkpoint.restore(d, rank=0, world_size=1, model=m2, strategy=s2, data=d2) == 3
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert d2.index == data.index == 3
    assert torch.equal(torch.get_rng_state(), rng_at_save) and random.getstate() == py_rng_at_save
    # The optimizer state came back too: more identical steps keep the models identical.
    assert _train_steps(model, strategy, data, 2, 4) == _train_steps(m2, s2, d2, 2, 4)
    for a, b in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_corrupt_or_partial_checkpoint_is_refused(tmp_path: Path) -> None:
    parts = _parts(0)
    _train_steps(*parts, 1)
    corrupt = _save(tmp_path, 1, parts)
    f = _data_file(corrupt)
    with f.open("r+b") as fh:  # same size, other bytes: only the checksum can tell
        fh.seek(f.stat().st_size // 2)
        fh.write(b"\xde\xad\xbe\xef" * 4)
    with pytest.raises(InvalidCheckpoint, match="checksum"):
        checkpoint.verify(corrupt)
    checkpoint.verify(corrupt, checksums=False)  # sizes alone pass: retention's cheap check
    with pytest.raises(InvalidCheckpoint, match="checksum"):
        checkpoint.restore(corrupt, rank=0, world_size=1, model=parts[0], strategy=parts[1], data=parts[2])

    partial = _save(tmp_path, 2, parts)
    (partial / "manifest.json").unlink()
    with pytest.raises(InvalidCheckpoint, match="partial"):
        checkpoint.verify(partial)
    truncated = _save(tmp_path, 3, parts)
    f = _data_file(truncated)
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(InvalidCheckpoint, match="bytes"):
        checkpoint.verify(truncated)
    (tmp_path / "other").mkdir()
    with pytest.raises(InvalidCheckpoint, match="partial"):
        checkpoint.verify(tmp_path / "other")


def test_restore_falls_back_past_corrupt_and_partial_checkpoints(tmp_path: Path) -> None:
    model, strategy, data = parts = _parts(0)
    _train_steps(model, strategy, data, 2)
    good = _save(tmp_path, 2, parts)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _train_steps(model, strategy, data, 2, 3)
    corrupt = _save(tmp_path, 4, parts)
    with _data_file(corrupt).open("r+b") as fh:
        fh.seek(64)
        fh.write(b"\x00" * 32)
    _train_steps(model, strategy, data, 2, 5)
    partial = _save(tmp_path, 6, parts)
    (partial / "manifest.json").unlink()

    manifest, skipped = checkpoint.choose(tmp_path)
    assert manifest is not None and manifest.directory == good.resolve()
    assert [(s.step, "partial" in s.reason, "checksum" in s.reason) for s in skipped] == [
        (6, True, False), (4, False, True)
    ]

    sink = Sink()
    m2, s2, d2 = _parts(1)
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, job_id="j", sink=sink)
    assert ckpt.restore(state_of(m2, s2, d2)) == 2
    for k, v in want.items():
        assert torch.equal(m2.state_dict()[k], v), k
    # Rank 0 said which checkpoints it skipped, and why; they are gone, so a save of step 4 or 6
    # cannot mix with their files.
    assert [(s.step, s.valid, s.path) for s in sink.samples] == [
        (6, False, str(partial.resolve())), (4, False, str(corrupt.resolve()))
    ]
    assert all(s.message for s in sink.samples)
    assert [p.name for p in sorted(tmp_path.iterdir())] == [good.name]
    ckpt.close()


def test_nothing_valid_means_step_one(tmp_path: Path) -> None:
    parts = _parts(0)
    d = _save(tmp_path, 5, parts)
    (d / "manifest.json").unlink()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, job_id="j", sink=Sink())
    assert ckpt.restore(state_of(*_parts(1))) == 0
    assert Checkpointer(tmp_path / "empty", rank=0, world_size=1, job_id="j").restore(state_of(*_parts(1))) == 0


def test_retention_keeps_the_last_k_complete_checkpoints(tmp_path: Path) -> None:
    model, strategy, data = _parts(0)
    sink = Sink()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, job_id="j", keep_last=2, sink=sink, async_save=False)
    stale = checkpoint.step_dir(tmp_path, 1)  # an incomplete leftover older than what is kept
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x")
    for step in (2, 4, 6, 8):
        loss = _train_steps(model, strategy, data, 2, step - 1)
        assert ckpt.save(step, state_of(model, strategy, data), loss)
    assert [s for s, _ in checkpoint.list_step_dirs(tmp_path)] == [6, 8]
    assert all(checkpoint.verify(d) for _, d in checkpoint.list_step_dirs(tmp_path))
    assert [(s.step, s.valid, s.files) for s in sink.samples] == [(2, True, 2), (4, True, 2), (6, True, 2), (8, True, 2)]
    assert all(s.loss is not None and s.bytes > 0 and len(s.manifest_sha256) == 64 for s in sink.samples)
    ckpt.close()
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.prune(tmp_path, 0)


def test_non_finite_loss_or_weights_are_never_checkpointed(tmp_path: Path) -> None:
    model, strategy, data = _parts(0)
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, job_id="j", sink=Sink())
    loss = _train_steps(model, strategy, data, 1)
    assert not ckpt.save(1, state_of(model, strategy, data), math.nan)
    assert not ckpt.save(1, state_of(model, strategy, data), math.inf)
    with torch.no_grad():
        next(model.parameters())[0].fill_(math.nan)
    assert not ckpt.save(1, state_of(model, strategy, data), loss)  # a finite loss with NaN weights: still not
    # No loss reported at all (a user's loop may report none): the weights alone decide.
    assert not ckpt.save(1, state_of(model, strategy, data), None)
    assert ckpt.skipped_steps == [1, 1, 1, 1] and ckpt.saved_steps == []
    assert checkpoint.list_step_dirs(tmp_path) == []
    ckpt.close()


def test_async_save_completes_in_the_background_and_is_reported_once(tmp_path: Path) -> None:
    model, strategy, data = _parts(0)
    sink = Sink()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, job_id="job-a", sink=sink)
    assert ckpt.async_save
    loss = _train_steps(model, strategy, data, 2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert ckpt.save(2, state_of(model, strategy, data), loss)
    _train_steps(model, strategy, data, 2, 3)  # the weights move on while the save is written
    ckpt.wait()
    done = ckpt.reportable()
    assert done is not None and done.step == 2 and ckpt.reportable() is None  # reported once
    assert [(s.job_id, s.step, s.valid, s.path) for s in sink.samples] == [("job-a", 2, True, str(done.directory))]
    assert sink.samples[0].loss == pytest.approx(loss)
    m2, s2, d2 = _parts(1)
    assert checkpoint.restore(done.directory, rank=0, world_size=1, model=m2, strategy=s2, data=d2) == 2
    for k, v in want.items():  # what was staged at save time, not the weights of later steps
        assert torch.equal(m2.state_dict()[k], v), k
    ckpt.close()


def test_a_pointer_names_a_checkpoint_and_restore_takes_the_newest_valid_of_root_and_hint(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    model, strategy, data = parts = _parts(0)
    _train_steps(model, strategy, data, 1)
    _save(root, 1, parts)
    _train_steps(model, strategy, data, 2, 2)
    newer = _save(elsewhere, 3, parts)
    pointer = tmp_path / "ray-checkpoint"
    checkpoint.write_pointer(pointer, newer)
    assert checkpoint.resolve(pointer) == newer.resolve()
    assert json.loads((pointer / checkpoint.POINTER_FILE).read_text())["step"] == 3
    manifest, _ = checkpoint.choose(root, pointer)
    assert manifest is not None and manifest.step == 3
    # The hint is only a candidate: when it is older than the root's newest, the root's wins.
    older = tmp_path / "older"
    checkpoint.write_pointer(older, checkpoint.step_dir(root, 1))
    _train_steps(model, strategy, data, 2, 4)
    _save(root, 5, parts)
    manifest, _ = checkpoint.choose(root, older)
    assert manifest is not None and manifest.step == 5
    assert ".." not in checkpoint.job_root("/s", "../../etc").parts
    assert checkpoint.job_root("/s", "job_1") == Path("/s/job_1/checkpoints")


def test_state_that_is_not_tensors_and_plain_values_is_refused(tmp_path: Path) -> None:
    model, strategy, _ = _parts(0)

    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"index": 1, "thing": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(TypeError, match="thing"):
        checkpoint.save(tmp_path / "x", step=1, rank=0, world_size=1, model=model, strategy=strategy, data=Odd())


def test_any_named_state_round_trips_and_names_are_checked(tmp_path: Path) -> None:
    """The rank API's checkpoints: whatever objects the caller names (a plain torch optimizer too)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()

    class Position:
        def __init__(self, i: int) -> None:
            self.i = i

        def state_dict(self) -> dict[str, int]:
            return {"i": self.i}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.i = state["i"]

    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, job_id="j", async_save=False)
    assert ckpt.save(7, {"net": net, "opt": opt, "pos": Position(42)}, None)
    net2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    pos2 = Position(0)
    assert ckpt.restore({"net": net2, "opt": opt2, "pos": pos2}) == 7
    assert pos2.i == 42 and all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters(), strict=True))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], opt2.state_dict()["state"][0]["momentum_buffer"])
    with pytest.raises(ValueError, match=r"no state named \['other'\]"):
        ckpt.restore({"net": net2, "other": pos2})
    with pytest.raises(ValueError, match="name 'step'"):
        ckpt.save(8, {"step": pos2}, None)
    with pytest.raises(TypeError, match="has no state_dict"):
        ckpt.save(8, {"n": 3}, None)
    ckpt.close()
