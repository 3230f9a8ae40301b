"""Where checkpoints live: a job's checkpoint root, the ``step-XXXXXXXX`` folders under it and the
manifest's file name. Part of the contract: the trainer writes this layout, the agent (corrupting
the newest checkpoint on request) and the recovery bench find checkpoints by it.

``<storage>/<slug(job id)>/checkpoints/step-00000120`` holds the checkpoint taken after step 120; it
is complete once its :data:`MANIFEST_FILE` exists (:mod:`vigil.checkpointing.format` says what the
manifest holds and how a folder is verified). Standard library and the schemas only.

**A location** (:data:`Location`) is a local folder, as a :class:`~pathlib.Path`, or a URI of an object
store or another fsspec filesystem, as a ``str`` (``s3://bucket/prefix``: ``Path`` would fold its
``//``). :func:`as_location` makes one from configuration; the names below keep the kind they are given
(a ``Path`` root gives ``Path`` folders, a URI root URI folders). Only the trainer reads and writes a
URI (:mod:`vigil.checkpointing.storage`, over fsspec); :func:`list_step_dirs` and
:func:`newest_complete` here read local folders.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import TypeAlias

from vigil.contract.schemas import slugify

MANIFEST_FILE = "manifest.json"
STEP_DIR_PREFIX = "step-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


Location: TypeAlias = Path | str
"""A local folder (``Path``) or a URI (``str``, ``scheme://...``) that names one on another filesystem."""


def is_uri(value: object) -> bool:
    """Whether ``value`` is a URI string (``scheme://...``; a ``Path`` never is one)."""
    return isinstance(value, str) and "://" in value


def normalise_uri(uri: str) -> str:
    """``uri`` with its scheme in lower case and no trailing ``/``. A ``.`` or ``..`` segment or an empty
    one (``//``) is refused (``ValueError``): an object store takes them literally, so ``a/../b`` names
    neither ``b`` nor anything under ``a``'s parent, and no prefix comparison could tell what it means."""
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme or not rest.strip("/"):
        raise ValueError(f"not a URI with a path: {uri!r}")
    rest = rest.rstrip("/")
    if any(seg in ("", ".", "..") for seg in rest.split("/")):
        raise ValueError(f"{uri!r}: a URI path may not hold '.', '..' or an empty segment")
    return f"{scheme.lower()}://{rest}"


def as_location(value: str | Path) -> Location:
    """A location from configuration or from a recorded path: a URI (:func:`normalise_uri`) as a ``str``,
    ``file://`` URIs and anything else as a ``Path`` (not resolved: callers resolve local paths)."""
    if isinstance(value, Path):
        return value
    if value.lower().startswith("file://"):
        return Path(value[len("file://"):])
    return normalise_uri(value) if is_uri(value) else Path(value)


def join(location: Location, *parts: str) -> Location:
    """``location / part / ...`` of the same kind (a URI stays a URI)."""
    if is_uri(location):
        return posixpath.join(str(location), *parts)
    return Path(location).joinpath(*parts)


def name_of(location: Location) -> str:
    """The last segment of ``location`` (its folder or file name)."""
    return posixpath.basename(str(location).rstrip("/")) if is_uri(location) else Path(location).name


def parent_of(location: Location) -> Location:
    """The location above ``location`` (same kind)."""
    return posixpath.dirname(str(location).rstrip("/")) if is_uri(location) else Path(location).parent


ATTEMPTS_DIR = "attempts"
"""``<root>/attempts/<n>``: one empty folder per run attempt of the job's ranks (see :func:`attempts_dir`)."""


def attempts_dir(root: Location) -> Location:
    """Where a job's run attempts are claimed: ``<checkpoint root>/attempts``. Every start of the ranks
    (the first, and each restart) makes the next numbered entry there (a folder; an empty object on an
    object store), so the attempt numbers of one job increase on its shared storage across every restart
    and node (vigil.checkpointing)."""
    return join(root, ATTEMPTS_DIR)


def job_checkpoint_root(storage_path: Location, job_id: str) -> Location:
    """The checkpoint root of job ``job_id`` under the storage path (a folder or a URI):
    ``<storage>/<slug(job id)>/checkpoints``."""
    return join(as_location(storage_path), slugify(job_id), "checkpoints")


def newest_complete(root: Path) -> tuple[int, Path] | None:
    """``(step, folder)`` of the newest complete checkpoint under the local folder ``root`` (a ``step-*``
    folder, not a symbolic link, holding its manifest), else None."""
    done = [(s, p) for s, p in list_step_dirs(root) if not p.is_symlink() and (p / MANIFEST_FILE).is_file()]
    return done[-1] if done else None


def step_dir(root: Location, step: int) -> Location:
    """The folder of the checkpoint taken after ``step`` under ``root`` (a URI under a URI root)."""
    return join(root, f"{STEP_DIR_PREFIX}{step:08d}")


def step_of(directory: Location) -> int | None:
    """The step in a ``step-XXXXXXXX`` folder name, else None."""
    m = _STEP_DIR.match(name_of(directory))
    return int(m.group(1)) if m else None


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-*`` folder under the local folder ``root``, oldest first (any
    storage, a URI too: :func:`vigil.checkpointing.format.list_step_dirs`)."""
    if is_uri(root):
        raise ValueError(f"{root}: a URI; vigil.checkpointing.format.list_step_dirs lists any storage")
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return sorted(found)
