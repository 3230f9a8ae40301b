"""Checkpoint storage over fsspec: a local folder or a URI (``s3://bucket/prefix``), one code path.

Every read, listing and size of :mod:`vigil.checkpointing` goes through fsspec
(``fsspec.core.url_to_fs``): its local filesystem for a plain path, ``s3fs`` for ``s3://`` (any
S3-compatible store: the endpoint comes from ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``, the
credentials from the standard AWS variables, as for any AWS SDK), any other fsspec protocol the same
way. What an object store cannot do as a filesystem does (and a folder keeps doing as it did) differs,
and only here:

* **atomic writes** (the manifest): a local file is written to a temporary name, fsync'ed and renamed;
  on an object store a single PUT is atomic already (the object appears whole or not at all);
* **deleting a checkpoint**: a local folder is renamed away first, then removed; an object store has
  no rename, so the manifest goes first and the rest after; either way a half-deleted folder never
  looks like a checkpoint;
* **claiming a name once** (run attempts): a local ``mkdir``; an object-store PUT with ``If-None-Match``
  (fsspec's ``mode="create"``), which S3, MinIO and moto honour;
* **DCP's reader and writer**: ``FileSystemReader`` / ``FileSystemWriter`` on a local folder (the files
  on disk stay as they were), ``FsspecReader`` / ``FsspecWriter`` on a URI.

Listings are never cached (``use_listings_cache=False``): ranks, retention and the agent change the
storage from other processes, and a stale listing would hide a new checkpoint or show a deleted one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from vigil.contract.checkpoint_layout import Location, as_location, is_uri, join, name_of, parent_of

# as_location, join, name_of and parent_of are re-exported: one import for every location helper.

__all__ = [
    "Entry",
    "Location",
    "as_location",
    "claim",
    "dcp_reader",
    "dcp_writer",
    "exists",
    "file_size",
    "filesystem",
    "is_local",
    "is_uri",
    "join",
    "list_dir",
    "makedirs",
    "name_of",
    "open_file",
    "parent_of",
    "read_bytes",
    "remove_tree",
    "same",
    "write_atomic",
]


def filesystem(location: Location) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``location`` and its path there (no listings cache)."""
    return url_to_fs(str(location), use_listings_cache=False)


def is_local(location: Location) -> bool:
    """Whether ``location`` is on a local (or locally mounted, shared) filesystem."""
    return not is_uri(location)


def same(location: Location) -> Location:
    """A canonical form for comparing locations: a local path resolved (symbolic links followed), a URI as is."""
    return location if is_uri(location) else Path(location).resolve()


class Entry(NamedTuple):
    """An entry of a folder listing."""

    name: str
    is_dir: bool
    is_file: bool
    size: int
    """Bytes of a file (0 for anything else)."""


def list_dir(location: Location) -> list[Entry]:
    """Every entry of the folder ``location`` (symbolic links followed); [] when there is none."""
    fs, path = filesystem(location)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    base = path.rstrip("/")
    out = []
    for e in entries:
        name = str(e["name"]).rstrip("/")
        if name == base:  # an object store may list a "folder" object of the folder's own name
            continue
        kind = e.get("type")
        out.append(Entry(name.rsplit("/", 1)[-1], kind == "directory", kind == "file",
                         int(e.get("size") or 0) if kind == "file" else 0))
    return out


def exists(location: Location) -> bool:
    """Whether a file or folder (an object or a prefix of some) is at ``location``."""
    fs, path = filesystem(location)
    return bool(fs.exists(path))


def file_size(location: Location) -> int:
    """The size in bytes of the file ``location``; ``FileNotFoundError`` when there is none."""
    fs, path = filesystem(location)
    info = fs.info(path)
    if info.get("type") != "file":
        raise FileNotFoundError(str(location))
    return int(info["size"])


@contextlib.contextmanager
def open_file(location: Location, mode: str = "rb") -> Iterator[IO[bytes]]:
    """The file ``location`` opened in ``mode`` (binary)."""
    fs, path = filesystem(location)
    with fs.open(path, mode) as f:
        yield f


def read_bytes(location: Location) -> bytes:
    """The whole file ``location``."""
    fs, path = filesystem(location)
    return bytes(fs.cat_file(path))


def makedirs(location: Location) -> None:
    """Make the folder ``location`` and its parents (nothing to make on an object store)."""
    fs, path = filesystem(location)
    fs.makedirs(path, exist_ok=True)


def write_atomic(location: Location, data: bytes, *, tmp_prefix: str = "") -> None:
    """Write ``data`` to the file ``location`` so that readers see all of it or nothing (module docstring)."""
    if is_uri(location):
        fs, path = filesystem(location)
        fs.pipe_file(path, data)
        return
    target = Path(location)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=tmp_prefix or target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


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


def remove_tree(location: Location, *, first: str | None = None) -> None:
    """Delete the folder ``location`` so that it never looks whole while it goes (module docstring):
    a local folder is renamed away first; on an object store the file ``first`` (the manifest) goes
    before the rest."""
    if is_local(location):
        directory = Path(location)
        trash = directory.with_name(f".deleting-{directory.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return
        except OSError:
            trash = directory
        shutil.rmtree(trash, ignore_errors=True)
        return
    fs, path = filesystem(location)
    if first is not None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{path.rstrip('/')}/{first}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def claim(location: Location) -> bool:
    """Create ``location`` unless it exists, atomically: True when this call made it. A local folder; on
    an object store an empty object written only if absent."""
    if is_local(location):
        try:
            Path(location).mkdir()
        except FileExistsError:
            return False
        return True
    fs, path = filesystem(location)
    try:
        fs.pipe_file(path, b"", mode="create")
    except FileExistsError:
        return False
    return True


def dcp_writer(directory: Location, **kwargs: Any) -> Any:
    """DCP's storage writer for the checkpoint folder ``directory`` (module docstring)."""
    if is_local(directory):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(str(directory), **kwargs)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # No fsync per file: DCP would fall back to a machine-wide os.sync() for streams without a file
    # descriptor; an object is durable once its upload completes.
    return FsspecWriter(str(directory), sync_files=False, **kwargs)


def dcp_reader(directory: Location) -> Any:
    """DCP's storage reader for the checkpoint folder ``directory`` (module docstring)."""
    if is_local(directory):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(str(directory))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(str(directory))
