"""Checkpoints on an S3-compatible object store: the same format, validity, fallback, retention, pointers
and resharding as on a local folder, with the storage root a URI (``s3://bucket/prefix``).

Needs the REAL S3-compatible server of :mod:`tests.s3server` (moto in server mode on 127.0.0.1, fixture
``s3``: endpoint and credentials in the standard ``AWS_*`` variables, a fresh prefix per test); objects
are looked at and corrupted behind the code's back with boto3, as an operator or a failing disk would.
CPU torch; the multi-rank cases run gloo ranks through ``harness.run_ranks`` (127.0.0.1, free port,
under a timeout), which are handed the ``AWS_*`` variables explicitly (their fork server may predate
the fixture). Local-folder behaviour is in ``test_checkpoint.py`` and ``test_checkpoint_reshard.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3server import S3Prefix
from tests.vigil.checkpoint_helpers import AFTER, CUT, Position
from tests.vigil.checkpoint_helpers import CheckpointSink as Sink
from tests.vigil.checkpoint_helpers import build_parts as _parts
from tests.vigil.checkpoint_helpers import check_restored as _check_restored
from tests.vigil.checkpoint_helpers import make_strategy as _make
from tests.vigil.checkpoint_helpers import snapshot as _snapshot
from tests.vigil.checkpoint_helpers import train as _train
from tests.vigil.checkpoint_helpers import train_steps as _train_steps
from tests.vigil.optim.harness import run_ranks
from vigil import checkpointing as checkpoint
from vigil.checkpointing import Checkpointer, InvalidCheckpoint, state_of

TIMEOUT = 120
RESHARD_KINDS: list[tuple[str, dict[str, Any]]] = [
    ("adamw", {}),  # replicated state
    ("dsm", {"tau": 3, "sign": "randomized"}),  # flat-sharded state
    ("local_adamw", {"tau": 3}),  # per-rank local models
]


def _state(parts: tuple[Any, Any, Any]) -> dict[str, Any]:
    return state_of(*parts)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_save_and_restore_round_trip_on_s3_with_the_same_files_as_a_folder(s3: S3Prefix, tmp_path: Path) -> None:
    root = checkpoint.job_root(s3.uri, "job-s3")
    assert root == f"{s3.uri}/job-s3/checkpoints"
    model, strategy, data = parts = _parts(0)
    loss = _train_steps(model, strategy, data, 3)
    sink = Sink()
    ckpt = Checkpointer(root, rank=0, world_size=1, job_id="job-s3", sink=sink)
    assert ckpt.async_save and [ckpt.claim_attempt(), ckpt.claim_attempt()] == [1, 2]
    assert ckpt.save(3, _state(parts), loss, wait=True)
    want, rng = _params(model), torch.get_rng_state()
    done = ckpt.reportable()
    assert done is not None and done.directory == f"{root}/step-00000003"
    assert [(s.step, s.valid, s.path, s.files) for s in sink.samples] == [(3, True, done.directory, 2)]
    ckpt.close()
    # The objects are the files a local folder gets (DCP's temporary .metadata renamed; no manifest temp).
    assert s3.objects() == ["job-s3/checkpoints/attempts/1", "job-s3/checkpoints/attempts/2",
                         "job-s3/checkpoints/step-00000003/.metadata", "job-s3/checkpoints/step-00000003/__0_0.distcp",
                         "job-s3/checkpoints/step-00000003/manifest.json"]
    local = Checkpointer(tmp_path, rank=0, world_size=1, job_id="job-s3", async_save=False)
    local.save(3, _state(parts), loss)
    local.close()
    assert sorted(p.name for p in checkpoint.step_dir(tmp_path, 3).iterdir()) == [
        k.rsplit("/", 1)[1] for k in s3.objects() if "/step-" in k]
    manifest = checkpoint.verify(done.directory)
    assert (manifest.step, manifest.world_size, manifest.loss) == (3, 1, pytest.approx(loss))

    m2, s2, d2 = _parts(1)
    torch.manual_seed(99)
    again = Checkpointer(root, rank=0, world_size=1, job_id="job-s3")
    assert again.restore(state_of(m2, s2, d2)) == 3 and again.claim_attempt() == 3
    again.close()
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in want.items())
    assert torch.equal(torch.get_rng_state(), rng) and d2.index == data.index == 3
    assert _train_steps(model, strategy, data, 2, 4) == _train_steps(m2, s2, d2, 2, 4)  # the optimizer came back


def test_retention_on_s3_keeps_the_last_k_complete_checkpoints(s3: S3Prefix) -> None:
    root = f"{s3.uri}/ret"
    model, strategy, data = _parts(0)
    # An incomplete leftover older than what is kept (a crash's), written behind the code's back.
    s3.client().put_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/ret/step-00000001/__0_0.distcp", Body=b"x")
    sink = Sink()
    ckpt = Checkpointer(root, rank=0, world_size=1, job_id="j", keep_last=2, sink=sink, async_save=False)
    for step in (2, 4, 6, 8):
        loss = _train_steps(model, strategy, data, 2, step - 1)
        assert ckpt.save(step, state_of(model, strategy, data), loss)
    ckpt.close()
    assert checkpoint.list_step_dirs(root) == [(6, f"{root}/step-00000006"), (8, f"{root}/step-00000008")]
    assert all(checkpoint.verify(d) for _, d in checkpoint.list_step_dirs(root))
    assert {k.split("/")[1] for k in s3.objects()} == {"step-00000006", "step-00000008"}  # nothing else left behind
    assert [(s.step, s.valid) for s in sink.samples] == [(2, True), (4, True), (6, True), (8, True)]
    assert checkpoint.prune(root, 1) == [f"{root}/step-00000006"]
    assert [s for s, _ in checkpoint.list_step_dirs(root)] == [8]


def test_pointer_and_newest_valid_choice_on_s3(s3: S3Prefix, tmp_path: Path) -> None:
    root, elsewhere = f"{s3.uri}/root", f"{s3.uri}/elsewhere"
    model, strategy, data = parts = _parts(0)
    _train_steps(model, strategy, data, 1)
    checkpoint.save(checkpoint.step_dir(root, 1), step=1, rank=0, world_size=1, state=_state(parts), loss=1.0)
    _train_steps(model, strategy, data, 2, 2)
    newer = checkpoint.step_dir(elsewhere, 3)
    checkpoint.save(newer, step=3, rank=0, world_size=1, state=_state(parts), loss=1.0)
    pointer = tmp_path / "ray-checkpoint"  # the folder Ray Train copies: local, naming the URI
    checkpoint.write_pointer(pointer, newer)
    assert json.loads((pointer / checkpoint.POINTER_FILE).read_text())["path"] == newer
    assert checkpoint.resolve(pointer) == newer
    manifest, skipped = checkpoint.choose(root, pointer)
    assert manifest is not None and (manifest.step, manifest.directory, skipped) == (3, newer, [])
    # The hint is only a candidate: older than the root's newest valid one, the root's wins ...
    older = tmp_path / "older"
    checkpoint.write_pointer(older, checkpoint.step_dir(root, 1))
    _train_steps(model, strategy, data, 2, 4)
    checkpoint.save(checkpoint.step_dir(root, 5), step=5, rank=0, world_size=1, state=_state(parts), loss=1.0)
    manifest, _ = checkpoint.choose(root, older)
    assert manifest is not None and manifest.step == 5
    # ... and a newer one without its manifest (partial: deleted on the server) is passed over.
    checkpoint.save(checkpoint.step_dir(root, 7), step=7, rank=0, world_size=1, state=_state(parts), loss=1.0)
    s3.client().delete_object(Bucket=s3.server.bucket, Key=s3.key(f"{root}/step-00000007/manifest.json"))
    manifest, skipped = checkpoint.choose(root, older)
    assert manifest is not None and manifest.step == 5
    assert [(s.step, s.directory, "partial" in s.reason) for s in skipped] == [(7, f"{root}/step-00000007", True)]


# --------------------------------------------------------------------------------------------------
# Several ranks: resharding, and a corrupt shard on the server
# --------------------------------------------------------------------------------------------------


def _save_phase(rank: int, world: int, uri: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Every kind: CUT steps, then the Checkpointer's (asynchronous) save to ``uri``."""
    os.environ.update(env)
    out = []
    for i, (kind, params) in enumerate(RESHARD_KINDS):
        strategy, pos = _make(kind, params), Position()
        _train(strategy, rank, 0, CUT, pos)
        ckpt = Checkpointer(f"{uri}/{i}-{kind}", rank=rank, world_size=world, job_id="reshard")
        assert ckpt.save(CUT, state_of(strategy.module, strategy, pos), 1.0, wait=True)
        ckpt.close()
        out.append(_snapshot(strategy))
    return out


def _restore_phase(rank: int, world: int, uri: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Every kind: the Checkpointer's restore from ``uri`` on this world size, then AFTER steps."""
    os.environ.update(env)
    out = []
    for i, (kind, params) in enumerate(RESHARD_KINDS):
        strategy, pos = _make(kind, params, seed=7), Position()
        fresh = _snapshot(strategy)
        ckpt = Checkpointer(f"{uri}/{i}-{kind}", rank=rank, world_size=world, job_id="reshard")
        step = ckpt.restore(state_of(strategy.module, strategy, pos))
        ckpt.close()
        restored = _snapshot(strategy)
        losses = _train(strategy, rank, step, AFTER, pos)
        out.append({"fresh": fresh, "restored": restored, "losses": losses, "step": step, "index": pos.index})
    return out


@pytest.mark.timeout(4 * TIMEOUT)
def test_a_checkpoint_on_s3_restores_on_another_world_size(s3: S3Prefix) -> None:
    saved = run_ranks(2, _save_phase, s3.uri, s3.env, timeout=TIMEOUT)
    assert any(k.endswith("/__1_0.distcp") for k in s3.objects())  # both ranks wrote their shard to the server
    restored = run_ranks(3, _restore_phase, s3.uri, s3.env, timeout=TIMEOUT)
    for i, (kind, _) in enumerate(RESHARD_KINDS):
        _check_restored([r[i] for r in saved], [r[i]["restored"] for r in restored], [r[i]["fresh"] for r in restored],
                        kind)
        for r in restored:
            assert (r[i]["step"], r[i]["index"]) == (CUT, CUT + AFTER)
            assert all(math.isfinite(x) for x in r[i]["losses"]), (kind, r[i]["losses"])


SHARDED = ("dsm", {"tau": 3, "sign": "randomized"})


def _save_twice(rank: int, world: int, root: str, env: dict[str, str]) -> dict[str, Any]:
    """Checkpoints after steps 2 and 4 (a flat-sharded strategy: each rank's file holds its shard)."""
    os.environ.update(env)
    strategy, pos = _make(*SHARDED), Position()
    ckpt = Checkpointer(root, rank=rank, world_size=world, job_id="corrupt")
    _train(strategy, rank, 0, 2, pos)
    assert ckpt.save(2, state_of(strategy.module, strategy, pos), 1.0, wait=True)
    at_two = _snapshot(strategy)
    _train(strategy, rank, 2, 2, pos)
    assert ckpt.save(4, state_of(strategy.module, strategy, pos), 1.0, wait=True)
    ckpt.close()
    return at_two


def _restore_newest_valid(rank: int, world: int, root: str, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    strategy, pos = _make(*SHARDED, seed=5), Position()
    sink = Sink()
    ckpt = Checkpointer(root, rank=rank, world_size=world, job_id="corrupt", sink=sink)
    step = ckpt.restore(state_of(strategy.module, strategy, pos))
    ckpt.close()
    return {"step": step, "index": pos.index, "restored": _snapshot(strategy),
            "samples": [(s.step, s.valid, s.path, s.message) for s in sink.samples]}


@pytest.mark.timeout(4 * TIMEOUT)
def test_a_shard_corrupted_on_s3_is_caught_by_its_checksum_and_the_previous_checkpoint_restored(s3: S3Prefix) -> None:
    root = checkpoint.job_root(s3.uri, "corrupt")
    at_two = run_ranks(2, _save_twice, root, s3.env, timeout=TIMEOUT)
    newest = checkpoint.step_dir(root, 4)
    checkpoint.verify(newest)
    # Rank 1's shard of the newest checkpoint, overwritten on the server: same size, other bytes.
    client, key = s3.client(), s3.key(f"{newest}/__1_0.distcp")
    body = client.get_object(Bucket=s3.server.bucket, Key=key)["Body"].read()
    mid = len(body) // 2
    client.put_object(Bucket=s3.server.bucket, Key=key, Body=body[:mid] + bytes(b ^ 0xFF for b in body[mid:mid + 16])
                      + body[mid + 16:])
    with pytest.raises(InvalidCheckpoint, match="__1_0.distcp fails its sha256 checksum"):
        checkpoint.verify(newest)
    checkpoint.verify(newest, checksums=False)  # the sizes alone still match: only the checksum tells

    restored = run_ranks(2, _restore_newest_valid, root, s3.env, timeout=TIMEOUT)
    for rank, r in enumerate(restored):
        assert (r["step"], r["index"]) == (2, 2)
        want = at_two[rank]
        assert torch.equal(r["restored"]["model"], want["model"])
        assert all(torch.equal(r["restored"]["state"][p], t) for p, t in want["state"].items())
    # Rank 0 said which checkpoint it passed over, and why; the corrupt one is gone from the server.
    ((step, valid, path, message),) = restored[0]["samples"]
    assert (step, valid, path) == (4, False, newest) and "checksum" in message
    assert not any("/step-00000004/" in k for k in s3.objects())
    assert [s for s, _ in checkpoint.list_step_dirs(root)] == [2]


def test_the_driver_hands_an_s3_storage_to_ray_train_and_the_ranks_and_sees_progress_there(
    s3: S3Prefix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``VIGIL_STORAGE_PATH=s3://...`` reaches Ray Train's run config and every rank's checkpoint root as the
    URI; the driver's "did the run progress" reads the checkpoints and Ray Train's manifests on the server."""
    from vigil import raytrain
    from vigil.contract.schemas import JobCreate
    from vigil.driver import (
        UsageError,
        build_trainer,
        newest_valid_step,
        parse_config,
        rank_config,
        ray_train_env,
        run_name,
    )
    from vigil.runner import job_files_dir

    for name in ray_train_env(1):  # build_trainer sets them; restored after the test
        monkeypatch.delenv(name, raising=False)
    env = {"VIGIL_JOB_ID": "drv-s3", "VIGIL_JOB_SPEC": JobCreate(name="drv").model_dump_json(),
           "VIGIL_STORAGE_PATH": s3.uri + "/"}
    cfg = parse_config([], env)
    root = f"{s3.uri}/drv-s3/checkpoints"
    assert cfg.storage_path == s3.uri and rank_config(cfg)["checkpoint_root"] == root
    assert build_trainer(cfg).run_config.storage_path == s3.uri
    assert job_files_dir(root) == f"{s3.uri}/drv-s3/files"  # VIGIL_JOB_DIR of the ranks
    with pytest.raises(UsageError, match="checkpoint storage"):
        parse_config([], {**env, "VIGIL_STORAGE_PATH": f"{s3.uri}/../elsewhere"})

    run_folder = f"{s3.uri}/{run_name('drv-s3')}"
    assert newest_valid_step(root, run_folder) == -1
    parts = _parts(0)
    checkpoint.save(checkpoint.step_dir(root, 3), step=3, rank=0, world_size=1, state=_state(parts), loss=1.0)
    assert newest_valid_step(root, run_folder) == 3
    # A Ray Train checkpoint of the code's own, with the manifest Vigil writes into it, in Ray's run folder.
    s3.client().put_object(Bucket=s3.server.bucket, Key=s3.key(f"{run_folder}/checkpoint_1/{raytrain.MANIFEST}"),
                           Body=json.dumps({"step": 7}).encode())
    assert raytrain.newest_step(run_folder) == 7 and newest_valid_step(root, run_folder) == 7
