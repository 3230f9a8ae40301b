"""Ray Train code as it is, under Vigil: what its ``ray.train.report`` and ``ray.train.get_checkpoint`` do.

A ``train_loop_per_worker`` written as Ray Train's documentation writes it calls ``ray.train.report(metrics,
checkpoint=...)`` and ``ray.train.get_checkpoint()`` and never imports Vigil. Ray Train routes both through
the worker's function utilities (``TrainFnUtils``, which Ray documents as the class to replace "if new user
API behaviours are wanted"); Vigil's runner installs :class:`Bridge` in front of Ray's own before the code
starts, and everything still reaches Ray Train as the code wrote it. What Vigil adds:

* **Metrics become step telemetry**: ``loss``, ``val_loss``, ``lr`` and ``tokens`` of a report land on the
  step the report is about (:meth:`vigil.rank.autostep.AutoSteps.reported`): loss curves, NaN detection and
  throughput work for Ray Train code as for the rank API. Code that steps no torch optimizer is stepped by
  its reports.
* **Checkpoints get a manifest**: before Ray copies a reported checkpoint folder to its storage, Vigil
  writes :data:`MANIFEST` into it (every file, nested ones too, with its size and sha256, the step, the
  world size and the loss), and tells the controller (a ``checkpoint`` sample: the job's Checkpoints
  list, its size and time).
* **Restore past a corrupt one**: ``get_checkpoint()`` hands the code the checkpoint Ray picked when it
  verifies; when it does not (a file changed, truncated or missing), the newest checkpoint of the same run
  folder that verifies, and the controller is told which one was skipped and why. A checkpoint without a
  manifest (written before Vigil watched the job) is handed over as Ray picked it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil.contract.schemas import CheckpointSample

log = logging.getLogger(__name__)

MANIFEST = ".vigil-manifest.json"
"""The manifest's name inside a Ray Train checkpoint folder (hidden: the code's own files keep their names)."""
FORMAT = 1
_CHUNK = 1 << 20


class InvalidCheckpoint(Exception):
    """A checkpoint folder whose files do not match its manifest."""


class NoManifest(InvalidCheckpoint):
    """A checkpoint folder Vigil wrote no manifest into."""


# --------------------------------------------------------------------------------------------------
# Manifest of a checkpoint folder (local when written; any pyarrow filesystem when verified)
# --------------------------------------------------------------------------------------------------


def write_manifest(directory: Path, *, step: int, world_size: int, job_id: str, loss: float | None) -> dict[str, Any]:
    """Checksum every file under ``directory`` (nested too) and write :data:`MANIFEST` there; its body."""
    directory = Path(directory)
    files = []
    for dirpath, dirnames, names in os.walk(directory):
        dirnames.sort()
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(directory).as_posix()
            if rel == MANIFEST or p.is_symlink() or not p.is_file():
                continue
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            files.append({"path": rel, "bytes": p.stat().st_size, "sha256": h.hexdigest()})
    body = {"format": FORMAT, "job_id": job_id, "step": step, "world_size": world_size,
            "loss": loss if loss is not None and math.isfinite(loss) else None, "created": time.time(),
            "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)
    return body


def read_manifest(fs: Any, path: str) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path`` on the pyarrow filesystem ``fs``, nothing verified."""
    import pyarrow.fs as pafs

    where = posixpath.join(path, MANIFEST)
    if fs.get_file_info(where).type != pafs.FileType.File:
        raise NoManifest(f"{path}: no {MANIFEST}")
    try:
        with fs.open_input_stream(where) as f:
            body = json.loads(f.read())
        if body.get("format") != FORMAT:
            raise InvalidCheckpoint(f"{path}: manifest format {body.get('format')!r}, expected {FORMAT}")
        int(body["step"])
        for item in body["files"]:
            rel = str(item["path"])
            if rel.startswith("/") or ".." in rel.split("/") or rel in ("", "."):
                raise InvalidCheckpoint(f"{path}: manifest names an unsafe path {rel!r}")
        return body
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidCheckpoint(f"{path}: unreadable {MANIFEST} ({type(e).__name__}: {e})") from None


def verify(fs: Any, path: str) -> dict[str, Any]:
    """The manifest of ``path`` once every file it lists has its size and sha256; :class:`InvalidCheckpoint`
    naming the first that does not."""
    import pyarrow.fs as pafs

    body = read_manifest(fs, path)
    for item in body["files"]:
        where = posixpath.join(path, item["path"])
        info = fs.get_file_info(where)
        if info.type != pafs.FileType.File:
            raise InvalidCheckpoint(f"{path}: {item['path']} is missing")
        if info.size != int(item["bytes"]):
            raise InvalidCheckpoint(f"{path}: {item['path']} has {info.size} bytes, the manifest says {item['bytes']}")
        h = hashlib.sha256()
        with fs.open_input_stream(where) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != item["sha256"]:
            raise InvalidCheckpoint(f"{path}: {item['path']} fails its sha256 checksum (corrupt)")
    return body


@dataclass(frozen=True)
class Skipped:
    path: str
    step: int
    reason: str


def choose(fs: Any, path: str) -> tuple[str | None, dict[str, Any] | None, list[Skipped]]:
    """The checkpoint to restore when Ray Train hands back ``path``: ``path`` itself when it verifies or has no
    manifest, else the newest of its run folder's other checkpoints (no newer step than ``path``'s) that
    verifies; with the manifest (None when not Vigil's) and what was skipped."""
    import pyarrow.fs as pafs

    try:
        return path, verify(fs, path), []
    except NoManifest:
        return path, None, []
    except InvalidCheckpoint as e:
        try:
            bad_step = int(read_manifest(fs, path)["step"])
        except InvalidCheckpoint:
            bad_step = 2**31 - 1
        skipped = [Skipped(path, max(0, min(bad_step, 2**31 - 1)), str(e))]
    candidates: list[tuple[int, float, str]] = []
    parent = posixpath.dirname(path.rstrip("/"))
    for info in fs.get_file_info(pafs.FileSelector(parent)):
        if info.type != pafs.FileType.Directory or info.path.rstrip("/") == path.rstrip("/"):
            continue
        try:
            step = int(read_manifest(fs, info.path)["step"])
        except InvalidCheckpoint:
            continue
        if step <= bad_step:
            mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
            candidates.append((step, mtime, info.path))
    for step, _, other in sorted(candidates, reverse=True):
        try:
            return other, verify(fs, other), skipped
        except InvalidCheckpoint as e:
            skipped.append(Skipped(other, step, str(e)))
    return None, None, skipped


# --------------------------------------------------------------------------------------------------
# The bridge in front of Ray Train's function utilities
# --------------------------------------------------------------------------------------------------


def install(job_id: str, rank: int, world_size: int, session: Callable[[], Any]) -> Bridge | None:
    """Put a :class:`Bridge` in front of this worker's Ray Train function utilities; it (None outside Ray Train).
    ``session``: the rank's open Vigil session, or None (:func:`vigil.sdk` ``_current``)."""
    from ray.train.v2._internal.execution import train_fn_utils as utils

    try:
        inner = utils.get_train_fn_utils()
    except RuntimeError:
        return None
    if isinstance(inner, Bridge):
        return inner
    bridge = Bridge(inner, job_id=job_id, rank=rank, world_size=world_size, session=session)
    utils.set_train_fn_utils(bridge)
    return bridge


class Bridge:
    """Ray Train's function utilities, with Vigil's telemetry and manifests (module docstring). Everything
    not named here is Ray's own (``__getattr__``)."""

    def __init__(self, inner: Any, *, job_id: str, rank: int, world_size: int, session: Callable[[], Any]) -> None:
        self.inner = inner
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self._session = session
        self._chosen: dict[str, Any] = {}
        self.skipped: list[Skipped] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _send(self, sample: CheckpointSample) -> None:
        s = self._session()
        if s is not None:
            s.ctx.telemetry.send_checkpoint(sample)

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, *args: Any, **kwargs: Any) -> None:
        s = self._session()
        step = None
        if s is not None:
            try:
                step = s._auto.reported(metrics)
            except Exception:  # telemetry never breaks the code's own report
                log.exception("rank %d: could not take a report's metrics as step telemetry", self.rank)
        body = None
        if checkpoint is not None and _is_local(checkpoint):
            number = metrics.get("step")
            if not isinstance(number, int) or isinstance(number, bool) or number < 0:
                number = step if step is not None else (s._auto.last if s is not None else 0)
            loss = metrics.get("loss")
            t = time.perf_counter()
            body = write_manifest(Path(checkpoint.path), step=int(number), world_size=self.world_size,
                                  job_id=self.job_id, loss=float(loss) if isinstance(loss, int | float) else None)
            manifest_s = time.perf_counter() - t
        self.inner.report(metrics, checkpoint, *args, **kwargs)
        if body is not None:
            mode = kwargs.get("checkpoint_upload_mode")
            synced = mode is None or getattr(mode, "name", "") == "SYNC"  # the copy is done: Ray's path of it
            persisted = self.inner.get_checkpoint() if synced else None
            where = persisted.path if persisted is not None else checkpoint.path
            self._chosen[where] = persisted
            log.info("rank %d: checkpoint of step %d (%d files, manifest in %.3f s) at %s", self.rank, body["step"],
                     len(body["files"]), manifest_s, where)
            self._send(CheckpointSample(
                job_id=self.job_id, rank=self.rank, step=min(int(body["step"]), 2**31 - 1), ts=time.time(),
                path=str(where)[:1024], valid=True, world_size=self.world_size, files=len(body["files"]),
                bytes=sum(int(f["bytes"]) for f in body["files"]), loss=body["loss"],
                message="Ray Train checkpoint (the code's own), manifest by Vigil"))

    def get_checkpoint(self) -> Any:
        picked = self.inner.get_checkpoint()
        if picked is None:
            return None
        if picked.path in self._chosen:
            return self._chosen[picked.path]
        path, body, skipped = choose(picked.filesystem, picked.path)
        if path is None:
            chosen = None
        elif path == picked.path:
            chosen = picked
        else:
            chosen = type(picked)(path, filesystem=picked.filesystem)
        self._chosen[picked.path] = chosen
        self.skipped.extend(skipped)
        for bad in skipped:
            log.warning("rank %d: skipping the Ray Train checkpoint %s: %s", self.rank, bad.path, bad.reason)
            if self.rank == 0:
                self._send(CheckpointSample(job_id=self.job_id, rank=0, step=bad.step, ts=time.time(),
                                            path=bad.path[:1024], valid=False, world_size=self.world_size,
                                            message=f"skipped on restore: {bad.reason}"[:1024]))
        if skipped:
            log.warning("rank %d: restoring from %s (step %s)", self.rank, path,
                        body["step"] if body is not None else "?")
        return chosen


def _is_local(checkpoint: Any) -> bool:
    import pyarrow.fs as pafs

    return isinstance(getattr(checkpoint, "filesystem", None), pafs.LocalFileSystem) and Path(checkpoint.path).is_dir()


def newest_step(run_folder: Path | str) -> int:
    """The newest step among the manifests of a Ray Train run folder's checkpoints (-1: none); a cheap look,
    no checksum (the driver's "did the run make progress"). A folder or a URI (``s3://...``)."""
    from vigil.checkpointing.storage import filesystem

    best = -1
    fs, path = filesystem(run_folder)
    try:
        found = fs.glob(f"{path.rstrip('/')}/*/{MANIFEST}")
    except (FileNotFoundError, NotADirectoryError):
        return best
    for p in found:
        try:
            best = max(best, int(json.loads(fs.cat_file(p))["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return best
