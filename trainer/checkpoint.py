"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): a manifest, validity, fallback, retention, resharding.

On disk, one folder per checkpoint under a root::

    <root>/step-00000120/
        __0_0.distcp, __1_0.distcp, ...   DCP's data files (one per rank)
        .metadata                          DCP's index (a pickle, DCP's own format)
        manifest.json                      written LAST, by rank 0, atomically (temp file + rename)

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
restored are deleted (a valid-False :class:`~controller.schemas.CheckpointSample` says why first),
so a later save of the same step never mixes with their files.

**Retention**: after each new checkpoint, rank 0 keeps the newest ``keep_last`` *complete* ones
(manifest present, file sizes right: a cheap check; checksums are verified at restore) and deletes
older folders, complete or not. A folder is renamed away before it is deleted, so a half-deleted
folder never looks like a checkpoint.

**Non-finite state is never written**: :meth:`Checkpointer.save` first agrees across ranks that
every rank's loss of the step and every parameter are finite; if not, nothing is written. That is
what makes a rollback after a NaN land on a good state.

**Asynchronous saves**: :meth:`Checkpointer.save` uses ``dcp.async_save`` (torch 2.13, gloo/CPU):
it copies ("stages") the state to fresh CPU memory on the calling thread and writes it from a
background thread, over a process group of its own (gloo), so training goes on and the training
group's collectives never interleave with the checkpoint's. Rank 0 writes the manifest when the
write completes; the loop polls for completion once per step. One save is in flight at a time. If
async saving fails to start, the save falls back to a synchronous ``dcp.save``.

**What is saved, and resharding.** Each rank's state is one tree: the step, the model's
``state_dict()``, the strategy's ``state_dict()``, the data position and the RNG states. The
strategy's :meth:`~trainer.optim.base.Strategy.state_layout` says which parts are replicated,
flat-sharded, per-rank local or "current" (see :mod:`trainer.optim.base`); the RNG is local, the
step and the data position are replicated, the model is replicated unless the layout says it is
local. Tensors are stored under DCP keys by part, because DCP keeps one copy of a plain tensor that
several ranks save under the same key:

* ``rep/<path>``: replicated (every rank writes it, DCP keeps one);
* ``rank<r>/<path>``: rank ``r``'s local tensors;
* ``shard<r>/<path>``: rank ``r``'s shard of a flat-sharded tensor;
* ``meta/rank<r>``: rank ``r``'s tree with every tensor replaced by a reference, as JSON in a uint8
  tensor (so the structure and the plain values need no pickle).

A restore on N' ranks from a checkpoint of N ranks: new rank ``r`` reads the tree of old rank
``r`` (old rank 0's when ``r >= N``), loads replicated tensors as they are, its own local ones from
old rank ``r`` (fresh values when there is none), and rebuilds each shard from the old shards that
overlap its new slice (reading only those). On the same world size every rank gets back exactly
what it saved.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from controller.schemas import CheckpointSample, slugify
from trainer.optim.base import Shard, StateLayout, StatePath, Strategy

log = logging.getLogger(__name__)

# DCP warns on every single-process save or load, also from the async writer's thread: a world of
# one process is meant here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")

FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
POINTER_FILE = "vigil-checkpoint.json"
"""The file of a pointer folder (what Ray Train copies): ``{"path": ..., "step": ..., "manifest_sha256": ...}``."""
STEP_DIR_PREFIX = "step-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_HASH_CHUNK = 1 << 20

# Top-level keys of a rank's state tree (named constants: CONVENTIONS 6).
KEY_STEP = "step"
KEY_MODEL = "model"
KEY_STRATEGY = "strategy"
KEY_DATA = "data"
KEY_RNG = "rng"
KEY_RNG_TORCH = "torch"
KEY_RNG_PYTHON = "python"

# DCP key prefixes.
_REP = "rep"
_META = "meta"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class InvalidCheckpoint(Exception):
    """A checkpoint folder that is partial (no manifest) or corrupt (a file's size or checksum is wrong)."""


def step_dir(root: Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` under ``root``."""
    return Path(root) / f"{STEP_DIR_PREFIX}{step:08d}"


def step_of(directory: Path) -> int | None:
    """The step in a ``step-XXXXXXXX`` folder name, else None."""
    m = _STEP_DIR.match(Path(directory).name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, as written (and verified)."""

    directory: Path
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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_manifest(
    directory: Path, *, step: int, world_size: int, loss: float | None = None, job_id: str = ""
) -> Manifest:
    """Checksum every file of ``directory`` and write its manifest, atomically (temp + rename, fsync'ed).

    Call only once the data files are complete (after DCP's save returned on the coordinator).
    """
    directory = Path(directory)
    files: dict[str, tuple[int, str]] = {}
    for p in sorted(directory.iterdir()):
        if p.name == MANIFEST_FILE or p.name.startswith(MANIFEST_FILE + ".") or not p.is_file():
            continue
        files[p.name] = (p.stat().st_size, _sha256_file(p))
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
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=MANIFEST_FILE + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return Manifest(directory=directory, step=step, world_size=world_size, files=files,
                    sha256=hashlib.sha256(data).hexdigest(), loss=finite_loss, created=created)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory`` as written (nothing verified); :class:`InvalidCheckpoint` if absent or unreadable."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    try:
        data = path.read_bytes()
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


def verify(directory: Path, *, checksums: bool = True) -> Manifest:
    """The manifest of ``directory`` once every file it lists has its size (and sha256 when ``checksums``).

    Raises :class:`InvalidCheckpoint` naming the first problem.
    """
    manifest = read_manifest(directory)
    if ".metadata" not in manifest.files:
        raise InvalidCheckpoint(f"{directory}: manifest lists no .metadata")
    for name, (size, digest) in manifest.files.items():
        if "/" in name or name in ("", ".", ".."):
            raise InvalidCheckpoint(f"{directory}: manifest names an unsafe path {name!r}")
        p = Path(directory) / name
        try:
            actual = p.stat().st_size
        except OSError:
            raise InvalidCheckpoint(f"{directory}: {name} is missing") from None
        if actual != size:
            raise InvalidCheckpoint(f"{directory}: {name} has {actual} bytes, the manifest says {size}")
        if checksums and _sha256_file(p) != digest:
            raise InvalidCheckpoint(f"{directory}: {name} fails its sha256 checksum (corrupt)")
    return manifest


def resolve(directory: Path) -> Path:
    """A checkpoint folder, or the folder a pointer folder (:data:`POINTER_FILE`) names."""
    directory = Path(directory)
    pointer = directory / POINTER_FILE
    if not (directory / MANIFEST_FILE).exists() and pointer.exists():
        try:
            return Path(json.loads(pointer.read_text())["path"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidCheckpoint(f"{directory}: unreadable {POINTER_FILE} ({e})") from None
    return directory


def write_pointer(directory: Path, checkpoint_dir: Path) -> Path:
    """Write a pointer to the checkpoint folder ``checkpoint_dir`` into ``directory`` (what Ray Train copies)."""
    manifest = read_manifest(checkpoint_dir)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / POINTER_FILE
    path.write_text(json.dumps({"path": str(Path(checkpoint_dir).resolve()), "step": manifest.step,
                                "manifest_sha256": manifest.sha256}))
    return path


def job_root(storage_path: Path | str, job_id: str) -> Path:
    """The checkpoint root of job ``job_id`` under the storage path: ``<storage>/<slug(job id)>/checkpoints``."""
    return Path(storage_path) / slugify(job_id) / "checkpoints"


# --------------------------------------------------------------------------------------------------
# Retention and choice
# --------------------------------------------------------------------------------------------------


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-*`` folder under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return sorted(found)


def remove_dir(directory: Path) -> None:
    """Delete a checkpoint folder: renamed away first, so a half-deleted folder never looks like one."""
    directory = Path(directory)
    trash = directory.with_name(f".deleting-{directory.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(directory, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = directory
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: Path, keep_last: int) -> list[Path]:
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

    directory: Path
    step: int
    reason: str
    world_size: int = 1


def choose(root: Path | None, hint: Path | None = None) -> tuple[Manifest | None, list[Skipped]]:
    """The newest valid checkpoint among ``root``'s folders and ``hint`` (a folder or a pointer), with
    the newer candidates that failed verification."""
    candidates: dict[Path, int] = {}
    if root is not None:
        for s, d in list_step_dirs(root):
            candidates[d.resolve()] = s
    if hint is not None:
        try:
            target = resolve(hint).resolve()
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


# --------------------------------------------------------------------------------------------------
# State trees: flatten to DCP keys (with a JSON skeleton), and back
# --------------------------------------------------------------------------------------------------


def _seg(p: str | int) -> str:
    if isinstance(p, bool) or not isinstance(p, int | str):
        raise TypeError(f"state dict keys must be str or int, got {type(p).__name__}: {p!r}")
    if isinstance(p, int):
        return f"#{p}"
    return p.replace("%", "%25").replace("/", "%2F").replace("#", "%23") or "%"


def _path_str(path: StatePath) -> str:
    return "/".join(_seg(p) for p in path)


RESERVED_KEYS = frozenset({KEY_STEP, KEY_RNG})
"""Names a caller's state objects may not take: the tree's own entries."""
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def state_of(model: nn.Module | None = None, strategy: Stateful | None = None,
             data: Stateful | None = None) -> dict[str, Stateful]:
    """The classic trio as a state mapping (``model``, ``strategy``, ``data``), leaving out what is None."""
    return {k: v for k, v in ((KEY_MODEL, model), (KEY_STRATEGY, strategy), (KEY_DATA, data)) if v is not None}


def check_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as a dict, its names and objects checked (``ValueError`` naming the offending one)."""
    if not state:
        raise ValueError("checkpoint state: hand in at least one object (model=..., optimizer=..., ...)")
    for name, obj in state.items():
        if not isinstance(name, str) or not _STATE_NAME.match(name) or name in RESERVED_KEYS:
            raise ValueError(f"checkpoint state: name {name!r} must be an identifier of at most 64 characters, "
                             f"not one of {sorted(RESERVED_KEYS)}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"checkpoint state {name!r}: {type(obj).__name__} has no state_dict() / "
                             "load_state_dict() (wrap plain values in an object that has them)")
    return dict(state)


def _rank_tree(step: int, state: Mapping[str, Stateful]) -> dict[str, Any]:
    tree: dict[str, Any] = {KEY_STEP: step}
    for name, obj in state.items():
        tree[name] = obj.state_dict()
    tree[KEY_RNG] = {KEY_RNG_TORCH: torch.get_rng_state(), KEY_RNG_PYTHON: random.getstate()}
    return tree


class _TreeLayout:
    """The part of every path of a rank's tree.

    An object with a ``state_layout()`` (an optimizer strategy) has its layout applied under its
    name; a module whose strategy says ``local_model`` is local; the RNG is local; the rest is
    replicated.
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.layouts: dict[str, StateLayout] = {
            name: obj.state_layout() for name, obj in state.items() if callable(getattr(obj, "state_layout", None))
        }
        local_modules = {id(getattr(state[name], "module", None)) for name, lay in self.layouts.items()
                         if lay.local_model}
        self.local_names = frozenset(name for name, obj in state.items()
                                     if isinstance(obj, nn.Module) and id(obj) in local_modules)

    def part(self, path: StatePath) -> str | Shard:
        head = path[0] if path else None
        if isinstance(head, str) and head in self.layouts:
            return self.layouts[head].part_of(path[1:])
        if head in self.local_names or head == KEY_RNG:
            return "local"
        return "replicated"

    def padded(self, path: StatePath) -> int | None:
        head = path[0] if path else None
        return self.layouts[head].padded.get(path[1:]) if isinstance(head, str) and head in self.layouts else None

    def is_local_model(self, path: StatePath) -> bool:
        return bool(path) and path[0] in self.local_names

    def boundary(self, path: StatePath) -> str | None:
        """``"local"`` / ``"current"`` when ``path`` is exactly where such a rule starts."""
        if path == (KEY_RNG,) or (len(path) == 1 and path[0] in self.local_names):
            return "local"
        if path and isinstance(path[0], str) and path[0] in self.layouts:
            layout, rest = self.layouts[path[0]], path[1:]
            if rest in layout.current:
                return "current"
            if rest in layout.local:
                return "local"
        return None


def _encode(obj: Any, path: StatePath, on_tensor: Callable[[StatePath, torch.Tensor], dict[str, Any]]) -> Any:
    if isinstance(obj, torch.Tensor):
        return on_tensor(path, obj)
    if isinstance(obj, dict):
        return {"__d__": [[k if isinstance(k, str) else _as_int_key(k, path), _encode(v, (*path, k), on_tensor)]
                          for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"__l__": [_encode(v, (*path, i), on_tensor) for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"__tu__": [_encode(v, (*path, i), on_tensor) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {_path_str(path)!r}: keep state to tensors "
                    "and plain Python values")


def _as_int_key(k: Any, path: StatePath) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"state dict key {k!r} at {_path_str(path)!r} is neither str nor int")
    return k


class _Ref:
    """A tensor the restore still has to read (pass 1), then build (pass 2)."""

    def __init__(self, build: Callable[[dict[str, torch.Tensor]], torch.Tensor], keys: list[str]) -> None:
        self.build = build
        self.keys = keys


_DROP = object()
"""A key that the restored tree leaves out (absent from the fresh state it was to be taken from)."""
_KEEP = object()
"""``substitute``'s answer when the saved subtree is to be decoded (no substitution)."""


def _decode(node: Any, path: StatePath, leaf: Callable[[StatePath, dict[str, Any]], Any],
            substitute: Callable[[StatePath], Any]) -> Any:
    sub = substitute(path)
    if sub is not _KEEP:
        return sub
    if isinstance(node, dict):
        if "__t__" in node:
            return leaf(path, node)
        if "__d__" in node:
            out = {}
            for k, v in node["__d__"]:
                val = _decode(v, (*path, k), leaf, substitute)
                if val is not _DROP:
                    out[k] = val
            return out
        if "__l__" in node:
            return [x for i, v in enumerate(node["__l__"]) if (x := _decode(v, (*path, i), leaf, substitute)) is not _DROP]
        if "__tu__" in node:
            return tuple(_decode(v, (*path, i), leaf, substitute) for i, v in enumerate(node["__tu__"]))
        raise InvalidCheckpoint(f"unknown node in checkpoint tree at {_path_str(path)!r}")
    return node


def _lookup(tree: Any, path: StatePath) -> Any:
    node = tree
    for p in path:
        found = (isinstance(node, dict) and p in node) or (
            isinstance(node, list | tuple) and isinstance(p, int) and 0 <= p < len(node)
        )
        if not found:
            return _DROP
        node = node[p]
    return node


def _resized(t: torch.Tensor, length: int | None) -> torch.Tensor:
    """A replicated/local 1-D flat buffer cut or zero-extended to ``length`` (real elements first)."""
    if length is None or t.dim() != 1 or t.numel() == length:
        return t
    out = torch.zeros(length, dtype=t.dtype)
    n = min(t.numel(), length)
    out[:n] = t[:n]
    return out


def _save_state(step: int, rank: int, world_size: int, state: Mapping[str, Stateful]) -> dict[str, torch.Tensor]:
    """This rank's state as a flat ``{DCP key: tensor}``, including its JSON tree under ``meta/rank<r>``."""
    layout = _TreeLayout(state)
    flat: dict[str, torch.Tensor] = {}

    def on_tensor(path: StatePath, t: torch.Tensor) -> dict[str, Any]:
        part = layout.part(path)
        p = _path_str(path)
        ref: dict[str, Any] = {"__t__": p, "dtype": str(t.dtype), "shape": list(t.shape)}
        if isinstance(part, Shard):
            if t.dim() != 1 or t.numel() != part.length:
                raise ValueError(f"sharded {p!r}: expected a 1-D tensor of {part.length}, got {tuple(t.shape)}")
            ref.update(part="shard", numel=part.numel, length=part.length)
            key = f"shard{rank}/{p}"
        elif part == "replicated":
            ref["part"] = "replicated"
            key = f"{_REP}/{p}"
        else:  # local, current: per rank
            ref["part"] = "local"
            key = f"rank{rank}/{p}"
        flat[key] = t.detach()
        return ref

    tree = _encode(_rank_tree(step, state), (), on_tensor)
    skeleton = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "step": step, "tree": tree}
    flat[f"{_META}/rank{rank}"] = torch.frombuffer(bytearray(json.dumps(skeleton).encode()), dtype=torch.uint8)
    return flat


def _read(directory: Path, metadata: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``keys`` of the checkpoint, read by this rank alone (no collective)."""
    targets: dict[str, torch.Tensor] = {}
    for k in sorted(set(keys)):
        md = metadata.state_dict_metadata.get(k)
        if not isinstance(md, TensorStorageMetadata):
            raise InvalidCheckpoint(f"{directory}: no tensor {k!r} in the checkpoint")
        targets[k] = torch.empty(md.size, dtype=md.properties.dtype)
    if targets:
        dcp.load(targets, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return targets


# --------------------------------------------------------------------------------------------------
# Save and restore one checkpoint folder
# --------------------------------------------------------------------------------------------------


def save(
    directory: Path, *, step: int, rank: int, world_size: int, state: Mapping[str, Stateful] | None = None,
    model: nn.Module | None = None, strategy: Strategy | None = None, data: Stateful | None = None,
    group: Any = None, loss: float | None = None, job_id: str = "",
) -> Manifest | None:
    """Save every rank's state after ``step`` into ``directory``, synchronously; collective over ``group``.

    ``state``: named objects with ``state_dict()`` (``model``, ``strategy``, ``data`` are shorthands
    for those names). Rank 0 then writes the manifest and returns it (other ranks return None). Does
    not check the loss (see :meth:`Checkpointer.save`).
    """
    directory = Path(directory)
    named = check_state({**state_of(model, strategy, data), **(state or {})})
    flat = _save_state(step, rank, world_size, named)
    dcp.save(flat, storage_writer=FileSystemWriter(str(directory)), process_group=group)
    if rank == 0:
        return write_manifest(directory, step=step, world_size=world_size, loss=loss, job_id=job_id)
    return None


def restore(
    directory: Path, *, rank: int, world_size: int, state: Mapping[str, Stateful] | None = None,
    model: nn.Module | None = None, strategy: Strategy | None = None, data: Stateful | None = None,
    verify_checksums: bool = True,
) -> int:
    """Load this rank's state from the checkpoint ``directory`` in place; returns its step.

    ``state``: the same names as saved (``model``, ``strategy``, ``data`` are shorthands). Any world
    size: see the module docstring. On a world size other than the checkpoint's, every rank must
    call this (``after_restore`` of a strategy may communicate). Raises :class:`InvalidCheckpoint`
    when the folder does not verify, ``ValueError`` when it lacks a name asked for.
    """
    named = check_state({**state_of(model, strategy, data), **(state or {})})
    directory = resolve(Path(directory))
    manifest = verify(directory, checksums=verify_checksums)
    reader = FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    old_world = sum(1 for k in metadata.state_dict_metadata if k.startswith(f"{_META}/rank"))
    if old_world != manifest.world_size:
        raise InvalidCheckpoint(f"{directory}: {old_world} rank trees, the manifest says {manifest.world_size} ranks")
    src = rank if rank < old_world else None
    template_rank = src if src is not None else 0
    raw = _read(directory, metadata, [f"{_META}/rank{template_rank}"])[f"{_META}/rank{template_rank}"]
    skeleton = json.loads(bytes(raw.numpy()).decode())
    if skeleton.get("format") != FORMAT_VERSION:
        raise InvalidCheckpoint(f"{directory}: rank tree format {skeleton.get('format')!r}")

    saved_names = {k for k, _ in skeleton["tree"].get("__d__", [])} - RESERVED_KEYS
    missing = sorted(set(named) - saved_names)
    if missing:
        raise ValueError(f"{directory}: the checkpoint holds no state named {missing} (it holds {sorted(saved_names)})")
    skeleton["tree"]["__d__"] = [[k, v] for k, v in skeleton["tree"]["__d__"] if k in named or k in RESERVED_KEYS]
    layout = _TreeLayout(named)
    fresh = _rank_tree(0, named)
    model_src = src if src is not None else rank % old_world
    refs: list[_Ref] = []

    def substitute(path: StatePath) -> Any:
        kind = layout.boundary(path)
        if kind == "current" or (kind == "local" and src is None and not layout.is_local_model(path)):
            return _lookup(fresh, path)
        return _KEEP

    def leaf(path: StatePath, ref: dict[str, Any]) -> Any:
        p = ref["__t__"]
        length = layout.padded(path)
        part = ref.get("part")
        if part in ("replicated", "local"):
            owner = model_src if layout.is_local_model(path) and src is None else template_rank
            key = f"{_REP}/{p}" if part == "replicated" else f"rank{owner}/{p}"

            def whole(got: dict[str, torch.Tensor], key: str = key, length: int | None = length) -> torch.Tensor:
                return _resized(got[key], length)

            r = _Ref(whole, [key])
        elif part == "shard":
            new = layout.part(path)
            if not isinstance(new, Shard):
                raise InvalidCheckpoint(f"{directory}: {p!r} was sharded; this strategy does not shard it")
            numel, old_len = int(ref["numel"]), int(ref["length"])
            if new.numel != numel:
                raise InvalidCheckpoint(f"{directory}: {p!r} shards {numel} elements, this model has {new.numel}")
            lo = rank * new.length
            # Same layout: the slice verbatim, padding included (a strategy may keep rounding noise
            # there, and exactness needs it). Another layout: the real elements, zero padding.
            same = old_world == world_size and old_len == new.length
            hi = (rank + 1) * new.length if same else min((rank + 1) * new.length, numel)
            owners = list(range(lo // old_len, -(-hi // old_len))) if hi > lo and old_len > 0 else []
            keys = [f"shard{j}/{p}" for j in owners]
            dtype = getattr(torch, ref["dtype"].removeprefix("torch."))

            def build(got: dict[str, torch.Tensor], lo: int = lo, hi: int = hi, owners: list[int] = owners,
                      keys: list[str] = keys, length: int = new.length, old_len: int = old_len,
                      dtype: torch.dtype = dtype) -> torch.Tensor:
                out = torch.zeros(length, dtype=dtype)
                for j, key in zip(owners, keys, strict=True):
                    a, b = max(lo, j * old_len), min(hi, (j + 1) * old_len)
                    out[a - lo : b - lo] = got[key][a - j * old_len : b - j * old_len]
                return out

            r = _Ref(build, keys)
        else:
            raise InvalidCheckpoint(f"{directory}: unknown part {part!r} at {p!r}")
        refs.append(r)
        return r

    tree = _decode(skeleton["tree"], (), leaf, substitute)
    got = _read(directory, metadata, [k for r in refs for k in r.keys])

    def resolve_refs(node: Any) -> Any:
        if isinstance(node, _Ref):
            return node.build(got)
        if isinstance(node, dict):
            return {k: resolve_refs(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve_refs(v) for v in node]
        if isinstance(node, tuple):
            return tuple(resolve_refs(v) for v in node)
        return node

    tree = resolve_refs(tree)
    for name, obj in named.items():
        obj.load_state_dict(tree[name])
    torch.set_rng_state(tree[KEY_RNG][KEY_RNG_TORCH])
    random.setstate(_as_python_rng_state(tree[KEY_RNG][KEY_RNG_PYTHON]))
    step = int(tree[KEY_STEP])
    if old_world != world_size:
        for obj in named.values():
            after = getattr(obj, "after_restore", None)
            if callable(after) and callable(getattr(obj, "state_layout", None)):
                after(old_world_size=old_world, fresh=src is None)
        log.warning("rank %d: restored step %d from %s, taken on %d ranks, now %d (%s)", rank, step, directory,
                    old_world, world_size, "fresh local state" if src is None else f"old rank {src}'s local state")
    else:
        log.info("rank %d restored step %d from %s", rank, step, directory)
    return step


def _as_python_rng_state(s: Any) -> tuple[Any, ...]:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


# --------------------------------------------------------------------------------------------------
# The train loop's checkpointer: choice on start, async saves, manifest, retention, reports
# --------------------------------------------------------------------------------------------------


class CheckpointSink(Protocol):
    """Where rank 0's checkpoint samples go (the rank's telemetry)."""

    def send_checkpoint(self, sample: CheckpointSample) -> None: ...


@dataclass
class _Pending:
    step: int
    directory: Path
    future: concurrent.futures.Future[Any]
    loss: float | None


@dataclass
class Checkpointer:
    """Checkpoints of one rank session (:mod:`trainer.sdk`): every method is called by every rank at the same step.

    ``root`` None: a temporary root for this call (rank 0 makes it, every rank uses it, :meth:`close`
    deletes it), with synchronous saves, so a checkpoint is complete at the report of its step.
    """

    root: Path | None
    rank: int
    world_size: int
    job_id: str
    keep_last: int = 3
    sink: CheckpointSink | None = None
    async_save: bool = True
    _group: Any = field(default=None, init=False, repr=False)
    _ctl: Any = field(default=None, init=False, repr=False)
    _temporary: bool = field(default=False, init=False)
    _pending: _Pending | None = field(default=None, init=False, repr=False)
    _finisher: concurrent.futures.ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _completed: Manifest | None = field(default=None, init=False, repr=False)
    _reported_step: int = field(default=-1, init=False)
    saved_steps: list[int] = field(default_factory=list, init=False)
    """Steps whose checkpoint this rank wrote (complete or in flight)."""
    skipped_steps: list[int] = field(default_factory=list, init=False)
    """Steps whose checkpoint was not written (non-finite loss or parameters)."""

    def __post_init__(self) -> None:
        self._distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        if self._distributed:
            # Groups of its own, both gloo (CPU tensors, whatever the training backend): one for the
            # async writer, whose collectives run on a background thread and must never interleave
            # with anyone else's, one for the small agreements of the main thread.
            self._group = dist.new_group(backend="gloo")
            self._ctl = dist.new_group(backend="gloo")
        if self.root is None:
            self._temporary = True
            self.async_save = False
            made = tempfile.mkdtemp(prefix="vigil-ckpt-") if self.rank == 0 else None
            self.root = Path(self._broadcast_object(made))
        self.root = Path(self.root)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.async_save:
                self._finisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-ckpt")

    # -- collectives -------------------------------------------------------------------------------

    def _broadcast_object(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctl)
        return box[0]

    @property
    def control_group(self) -> Any:
        """A gloo group of every rank for small main-thread agreements (None when not distributed)."""
        return self._ctl

    def _agree_finite(self, loss: float | None, state: Mapping[str, Any]) -> tuple[bool, float | None]:
        """Whether every rank's loss and every parameter of the state's modules is finite, and the mean
        loss (None when a rank reported none). A rank without a loss counts as finite."""
        modules = [o for o in state.values() if isinstance(o, nn.Module)]
        has_loss = loss is not None
        ok = (loss is None or math.isfinite(loss)) and all(
            bool(torch.isfinite(p).all()) for m in modules for p in m.parameters())
        t = torch.tensor([loss if ok and loss is not None else 0.0, 0.0 if ok else 1.0, 0.0 if has_loss else 1.0],
                         dtype=torch.float64)
        if self._distributed:
            dist.all_reduce(t, group=self._ctl)
        if t[1] > 0:
            return False, None
        return True, (None if t[2] > 0 else float(t[0]) / self.world_size)

    # -- restore -----------------------------------------------------------------------------------

    def restore(self, state: Mapping[str, Stateful], hint: Path | None = None) -> int:
        """Restore the newest valid checkpoint (root and ``hint``) into the named ``state`` objects;
        the step restored, 0 when none."""
        state = check_state(state)
        choice: str | None = None
        if self.rank == 0:
            manifest, skipped = choose(None if self._temporary else self.root, hint)
            for bad in skipped:
                log.error("skipping checkpoint %s: %s", bad.directory, bad.reason)
                self._send(CheckpointSample(job_id=self.job_id, step=bad.step, ts=time.time(), path=str(bad.directory),
                                            valid=False, world_size=bad.world_size, message=bad.reason[:1024]))
            if manifest is not None:
                choice = str(manifest.directory)
            # Invalid folders newer than the one restored are dropped, so a save of the same step
            # never writes into them.
            assert self.root is not None
            floor = manifest.step if manifest is not None else -1
            for s, d in list_step_dirs(self.root):
                if s > floor and d.resolve() != (manifest.directory.resolve() if manifest else None):
                    log.warning("removing invalid checkpoint %s (newer than the one restored)", d)
                    remove_dir(d)
            if manifest is None and skipped:
                log.error("no valid checkpoint left: starting from step 1")
        choice = self._broadcast_object(choice)
        if choice is None:
            return 0
        return restore(Path(choice), rank=self.rank, world_size=self.world_size, state=state, verify_checksums=False)

    # -- save --------------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Stateful], loss: float | None, *, wait: bool = False) -> bool:
        """Checkpoint the named ``state`` after ``step`` unless some rank's loss or parameters are non-finite.

        Returns whether a checkpoint was started. ``wait``: return once it is complete (manifest
        written). Every rank must call this at the same step with the same names.
        """
        state = check_state(state)
        self.wait()  # one save in flight at a time
        assert self.root is not None
        directory = step_dir(self.root, step)
        if self.rank == 0 and directory.exists():
            remove_dir(directory)  # a leftover of an earlier attempt; before the collective below
        finite, mean_loss = self._agree_finite(loss, state)  # also the barrier after that removal
        if not finite:
            self.skipped_steps.append(step)
            if self.rank == 0:
                log.warning("not checkpointing step %d: a rank's loss or parameters are not finite", step)
            return False
        flat = _save_state(step, self.rank, self.world_size, state)
        future: concurrent.futures.Future[Any] | None = None
        if self.async_save:
            try:
                started = dcp.async_save(flat, storage_writer=FileSystemWriter(str(directory)),
                                         process_group=self._group)
                future = started if isinstance(started, concurrent.futures.Future) else started.upload_completion
            except (AssertionError, RuntimeError, ValueError) as e:  # backend without async support
                log.warning("async checkpointing unavailable (%s); saving synchronously from now on", e)
                self.async_save = False
        if future is None:
            future = concurrent.futures.Future()
            try:
                dcp.save(flat, storage_writer=FileSystemWriter(str(directory)), process_group=self._group)
                future.set_result(None)
            except Exception as e:  # noqa: BLE001 - handed to the future, reported when collected
                future.set_exception(e)
        if self.rank == 0:
            if self._finisher is not None:
                future = self._finisher.submit(self._complete, future, step, directory, mean_loss)
            else:
                done: concurrent.futures.Future[Any] = concurrent.futures.Future()
                try:
                    done.set_result(self._complete(future, step, directory, mean_loss))
                except Exception as e:  # noqa: BLE001 - handed to the future, reported when collected
                    done.set_exception(e)
                future = done
        self._pending = _Pending(step=step, directory=directory, future=future, loss=mean_loss)
        self.saved_steps.append(step)
        if wait or not self.async_save:
            self.wait()
        return True

    def _complete(self, written: concurrent.futures.Future[Any], step: int, directory: Path,
                  loss: float | None) -> Manifest:
        written.result()  # re-raises a failed write
        manifest = write_manifest(directory, step=step, world_size=self.world_size, loss=loss, job_id=self.job_id)
        assert self.root is not None
        removed = prune(self.root, self.keep_last)
        if removed:
            log.info("retention: removed %s", ", ".join(d.name for d in removed))
        return manifest

    def poll(self) -> None:
        """Collect a finished save, if any (never blocks); rank 0 then reports it."""
        if self._pending is not None and self._pending.future.done():
            self._collect()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending.future])
            self._collect()

    def _collect(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            result = pending.future.result()
        except Exception as e:  # noqa: BLE001 - a failed checkpoint is logged; training goes on
            log.error("checkpoint of step %d failed: %s: %s", pending.step, type(e).__name__, e)
            return
        if self.rank == 0 and isinstance(result, Manifest):
            self._completed = result
            log.info("checkpoint of step %d complete: %s (%d files, %d bytes)", result.step, result.directory,
                     len(result.files), result.total_bytes)
            self._send(CheckpointSample(
                job_id=self.job_id, step=result.step, ts=time.time(), path=str(result.directory), valid=True,
                world_size=result.world_size, files=len(result.files), bytes=result.total_bytes,
                manifest_sha256=result.sha256, loss=result.loss,
            ))

    def _send(self, sample: CheckpointSample) -> None:
        if self.sink is not None:
            try:
                self.sink.send_checkpoint(sample)
            except Exception as e:  # noqa: BLE001 - telemetry never stops training
                log.warning("cannot send checkpoint sample: %s", e)

    def reportable(self) -> Manifest | None:
        """The newest complete checkpoint not reported yet (the same answer on every rank; collective).

        Rank 0 knows completion; it tells the others which step (or none). Other ranks get a
        :class:`Manifest` with only ``directory`` and ``step`` meaningful.
        """
        newest = self._completed if self.rank == 0 else None
        step = newest.step if newest is not None and newest.step > self._reported_step else -1
        step = int(self._broadcast_object(step))
        if step < 0:
            return None
        self._reported_step = step
        if self.rank == 0 and newest is not None:
            return newest
        assert self.root is not None
        return Manifest(directory=step_dir(self.root, step), step=step, world_size=self.world_size, files={},
                        sha256="")

    def abort(self) -> None:
        """After a failure on this rank: no collectives, no waiting; a save in flight is left to fail
        (it never gets a manifest, so it never counts)."""
        self._pending = None
        if self._finisher is not None:
            self._finisher.shutdown(wait=False, cancel_futures=True)
            self._finisher = None
        if self._temporary and self.rank == 0 and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """Wait for the save in flight; delete a temporary root (after every rank is done with it)."""
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None
            if self._temporary:
                if self._distributed:
                    dist.barrier(group=self._ctl)
                if self.rank == 0 and self.root is not None:
                    shutil.rmtree(self.root, ignore_errors=True)
            for group in (self._group, self._ctl):
                if group is not None:
                    try:
                        dist.destroy_process_group(group)
                    except (RuntimeError, ValueError):
                        pass
            self._group = self._ctl = None
