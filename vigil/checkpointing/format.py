"""The stored format of a checkpoint folder: manifest, checksums, validity, pointers, retention, choice.

One folder per checkpoint under a root (folder names: :mod:`vigil.contract.checkpoint_layout`), on a local
or shared filesystem or an object store (``s3://bucket/prefix``: :mod:`vigil.checkpointing.storage`;
the same files, rules and code for both)::

    <root>/step-00000120/
        __0_0.distcp, __1_0.distcp, ...   DCP's data files (one per rank)
        .metadata                          DCP's index (a pickle, DCP's own format)
        manifest.json                      written LAST, by rank 0, atomically (temp file + rename; one PUT)

The manifest lists every other file of the folder with its size and sha256, the step, the world
size, the loss and the time. A checkpoint is **valid** only when its manifest exists and every file
it lists has that size and checksum; anything else (no manifest: partial; a mismatch: corrupt) is
skipped on restore. Checksums are verified *before* anything is loaded, so DCP never unpickles an
index that is not the one written.

**Where checkpoints live** (a decision). Each job has its own root,
``VIGIL_STORAGE_PATH/<slug(job id)>/checkpoints`` (the driver passes it to every rank). That root is
the source of truth: validity, fallback and retention work on Vigil's manifests there. Ray Train is
still told about each complete checkpoint through ``ray.train.report(checkpoint=...)``, but what it
copies is a *pointer*: a tiny folder with :data:`POINTER_FILE` naming the checkpoint folder (Ray's
own suggestion for externally stored checkpoints; the data is not copied twice). On start, the
candidates are every ``step-*`` folder of the root plus the folder Ray Train hands back
(``get_checkpoint()``, its pointer resolved); the newest step that verifies wins. Ray's pick can be
*older* than the root's newest (a checkpoint completes asynchronously and is reported at the next
report; a rank can die in between) or name a folder that was corrupted since; it can only be newer
when it points outside the root (the storage path moved). Invalid folders newer than the one
restored are deleted (a valid-False :class:`~vigil.contract.schemas.CheckpointSample` says why first),
so a later save of the same step never mixes with their files.

**Retention**: after each new checkpoint, rank 0 keeps the newest ``keep_last`` *complete* ones
(manifest present, file sizes right: a cheap check; checksums are verified at restore) and deletes
older folders, complete or not. A folder is renamed away before it is deleted (on an object store,
which cannot rename, its manifest is deleted first), so a half-deleted folder never looks like a
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from vigil.checkpointing.storage import (
    Location,
    as_location,
    exists,
    file_size,
    join,
    list_dir,
    open_file,
    read_bytes,
    remove_tree,
    same,
    write_atomic,
)
from vigil.contract.checkpoint_layout import MANIFEST_FILE, job_checkpoint_root, step_of

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
POINTER_FILE = "vigil-checkpoint.json"
"""The file of a pointer folder (what Ray Train copies): ``{"path": ..., "step": ..., "manifest_sha256": ...}``."""
_HASH_CHUNK = 1 << 20


class InvalidCheckpoint(Exception):
    """A checkpoint folder that is partial (no manifest) or corrupt (a file's size or checksum is wrong)."""


# --------------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, as written (and verified)."""

    directory: Location
    """The checkpoint folder: a ``Path``, or a URI (``str``) on an object store."""
    step: int
    world_size: int
    files: dict[str, tuple[int, str]]
    """File name -> (bytes, sha256)."""
    sha256: str
    """Checksum of the manifest file itself (identifies this checkpoint in reports)."""
    loss: float | None = None
    created: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())


def _sha256_file(location: Location) -> str:
    h = hashlib.sha256()
    with open_file(location) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(
    directory: Location, *, step: int, world_size: int, loss: float | None = None, job_id: str = ""
) -> Manifest:
    """Checksum every file of ``directory`` and write its manifest, atomically (temp + rename, fsync'ed;
    one PUT on an object store).

    Call only once the data files are complete (after DCP's save returned on the coordinator).
    """
    directory = as_location(directory)
    files: dict[str, tuple[int, str]] = {}
    for e in sorted(list_dir(directory)):
        if e.name == MANIFEST_FILE or e.name.startswith(MANIFEST_FILE + ".") or not e.is_file:
            continue
        files[e.name] = (e.size, _sha256_file(join(directory, e.name)))
    if ".metadata" not in files:
        raise InvalidCheckpoint(f"{directory}: DCP wrote no .metadata; refusing to mark it complete")
    created = time.time()
    finite_loss = loss if loss is not None and math.isfinite(loss) else None
    body = {
        "format": FORMAT_VERSION,
        "job_id": job_id,
        "step": step,
        "world_size": world_size,
        "loss": finite_loss,
        "created": created,
        "files": [{"path": name, "bytes": size, "sha256": digest} for name, (size, digest) in files.items()],
    }
    data = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    write_atomic(join(directory, MANIFEST_FILE), data, tmp_prefix=MANIFEST_FILE + ".")
    return Manifest(directory=directory, step=step, world_size=world_size, files=files,
                    sha256=hashlib.sha256(data).hexdigest(), loss=finite_loss, created=created)


def read_manifest(directory: Location) -> Manifest:
    """The manifest of ``directory`` as written (nothing verified); :class:`InvalidCheckpoint` if absent or unreadable."""
    directory = as_location(directory)
    try:
        data = read_bytes(join(directory, MANIFEST_FILE))
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{directory}: partial checkpoint (no {MANIFEST_FILE})") from None
    except OSError as e:
        raise InvalidCheckpoint(f"{directory}: cannot read {MANIFEST_FILE}: {e}") from None
    try:
        body = json.loads(data)
        if body.get("format") != FORMAT_VERSION:
            raise InvalidCheckpoint(f"{directory}: checkpoint format {body.get('format')!r}, expected {FORMAT_VERSION}")
        files = {str(f["path"]): (int(f["bytes"]), str(f["sha256"])) for f in body["files"]}
        return Manifest(directory=directory, step=int(body["step"]), world_size=int(body["world_size"]),
                        files=files, sha256=hashlib.sha256(data).hexdigest(), loss=body.get("loss"),
                        created=float(body.get("created", 0.0)))
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidCheckpoint(f"{directory}: unreadable {MANIFEST_FILE} ({type(e).__name__}: {e})") from None


def verify(directory: Location, *, checksums: bool = True) -> Manifest:
    """The manifest of ``directory`` once every file it lists has its size (and sha256 when ``checksums``).

    Raises :class:`InvalidCheckpoint` naming the first problem.
    """
    manifest = read_manifest(directory)
    directory = manifest.directory
    if ".metadata" not in manifest.files:
        raise InvalidCheckpoint(f"{directory}: manifest lists no .metadata")
    for name, (size, digest) in manifest.files.items():
        if "/" in name or name in ("", ".", ".."):
            raise InvalidCheckpoint(f"{directory}: manifest names an unsafe path {name!r}")
        p = join(directory, name)
        try:
            actual = file_size(p)
        except OSError:
            raise InvalidCheckpoint(f"{directory}: {name} is missing") from None
        if actual != size:
            raise InvalidCheckpoint(f"{directory}: {name} has {actual} bytes, the manifest says {size}")
        if checksums and _sha256_file(p) != digest:
            raise InvalidCheckpoint(f"{directory}: {name} fails its sha256 checksum (corrupt)")
    return manifest


def resolve(directory: Location) -> Location:
    """A checkpoint folder, or the folder a pointer folder (:data:`POINTER_FILE`) names."""
    directory = as_location(directory)
    pointer = join(directory, POINTER_FILE)
    if not exists(join(directory, MANIFEST_FILE)) and exists(pointer):
        try:
            return as_location(json.loads(read_bytes(pointer))["path"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidCheckpoint(f"{directory}: unreadable {POINTER_FILE} ({e})") from None
    return directory


def write_pointer(directory: Path, checkpoint_dir: Location) -> Path:
    """Write a pointer to the checkpoint folder ``checkpoint_dir`` (a folder or a URI) into the local
    folder ``directory`` (what Ray Train copies)."""
    manifest = read_manifest(checkpoint_dir)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / POINTER_FILE
    path.write_text(json.dumps({"path": str(same(manifest.directory)), "step": manifest.step,
                                "manifest_sha256": manifest.sha256}))
    return path


def job_root(storage_path: Location, job_id: str) -> Location:
    """The checkpoint root of job ``job_id`` under the storage path (a folder, or a URI such as
    ``s3://bucket/prefix``): ``<storage>/<slug(job id)>/checkpoints``."""
    return job_checkpoint_root(storage_path, job_id)


# --------------------------------------------------------------------------------------------------
# Retention and choice
# --------------------------------------------------------------------------------------------------


def list_step_dirs(root: Location) -> list[tuple[int, Location]]:
    """``(step, folder)`` of every ``step-*`` folder under ``root`` (a folder or a URI), oldest first."""
    root = as_location(root)
    found = [(s, join(root, e.name)) for e in list_dir(root) if e.is_dir and (s := step_of(e.name)) is not None]
    return sorted(found, key=lambda sd: (sd[0], str(sd[1])))


def remove_dir(directory: Location) -> None:
    """Delete a checkpoint folder so that a half-deleted folder never looks like one (renamed away first;
    on an object store, its manifest first)."""
    remove_tree(as_location(directory), first=MANIFEST_FILE)


def prune(root: Location, keep_last: int) -> list[Location]:
    """Keep the newest ``keep_last`` complete checkpoints under ``root``; delete older folders. Returns the deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    dirs = list_step_dirs(root)
    complete: list[int] = []
    for i, (_, d) in enumerate(dirs):
        try:
            verify(d, checksums=False)
            complete.append(i)
        except InvalidCheckpoint:
            pass
    if len(complete) <= keep_last:
        # Still drop incomplete folders older than the newest complete one (leftovers of crashes).
        cutoff = complete[-1] if complete else -1
        keep = set(complete)
    else:
        cutoff = complete[-keep_last]
        keep = set(complete[-keep_last:])
    removed = []
    for i, (_, d) in enumerate(dirs):
        if i < cutoff and i not in keep:
            remove_dir(d)
            removed.append(d)
    return removed


@dataclass(frozen=True)
class Skipped:
    """A candidate checkpoint that restore passed over."""

    directory: Location
    step: int
    reason: str
    world_size: int = 1


def choose(root: Location | None, hint: Location | None = None) -> tuple[Manifest | None, list[Skipped]]:
    """The newest valid checkpoint among ``root``'s folders and ``hint`` (a folder or a pointer), with
    the newer candidates that failed verification."""
    candidates: dict[Location, int] = {}
    if root is not None:
        for s, d in list_step_dirs(root):
            candidates[same(d)] = s
    if hint is not None:
        try:
            target = same(resolve(hint))
        except InvalidCheckpoint as e:
            log.warning("ignoring the checkpoint hint: %s", e)
        else:
            if target not in candidates:
                step = step_of(target)
                if step is None:
                    try:
                        step = read_manifest(target).step
                    except InvalidCheckpoint:
                        step = -1
                candidates[target] = step
    skipped: list[Skipped] = []
    for d, s in sorted(candidates.items(), key=lambda kv: (kv[1], str(kv[0])), reverse=True):
        try:
            return verify(d), skipped
        except InvalidCheckpoint as e:
            try:
                world = read_manifest(d).world_size
            except InvalidCheckpoint:
                world = 1
            skipped.append(Skipped(directory=d, step=max(s, 0), reason=str(e), world_size=world))
    return None, skipped
