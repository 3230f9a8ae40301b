"""Code packages: a user's project folder as a zip, packed by the CLI, checked and stored by the controller.

A job carries its code as ``working_dir: "sha256:<hex>"``, the SHA-256 of a zip uploaded to
``POST /api/v1/packages``. The controller stores it content-addressed (``<packages_dir>/<hex>.zip``)
and hands that file to Ray's own runtime environment (``runtime_env["working_dir"]``), which uploads
it to the cluster and unpacks it as the working directory (and an import root) of the job's driver
and of every rank. Ray keeps a zip uploaded this way as it is (its files at the zip's root), so
:func:`pack_directory` puts the folder's files at the root. Vigil does not distribute code itself.

A package is refused (:class:`PackageError`, nothing stored) when it is not a zip, holds a path that
could land outside the folder it is unpacked into (absolute, ``..``, backslashes, drive letters), a
symbolic link, an encrypted or duplicate entry, too many files, or more uncompressed bytes than the
limit. Uncompressed sizes are not taken from the zip's headers (they can lie): every entry is
decompressed, counting, and the check stops at the limit (a zip bomb costs at most the limit).

Torch- and Ray-free: the CLI (packing) and the controller (checking, storing) import it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import re
import stat
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git/", "__pycache__/", "*.pyc", ".venv/", "venv/", ".vigil/", "*.egg-info/", ".pytest_cache/",
    ".mypy_cache/", ".ruff_cache/", ".ipynb_checkpoints/",
)
"""Left out of every package (gitignore syntax: a trailing ``/`` matches folders only)."""
IGNORE_FILE = ".vigilignore"
"""A project's own exclude list (gitignore syntax: globs, trailing ``/`` for folders, ``#`` comments)."""
REF_PREFIX = "sha256:"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)
"""Every entry's timestamp: the same tree packs to the same bytes (and the same hash)."""
_CHUNK = 1 << 16


class PackageError(ValueError):
    """A package (or a folder to pack) that breaks a rule; the message names the rule and the entry."""


@dataclass(frozen=True)
class PackageInfo:
    """What a checked package holds."""

    sha256: str
    size: int
    files: int
    unzipped_bytes: int

    @property
    def ref(self) -> str:
        """How a job spec names it (``working_dir``)."""
        return f"{REF_PREFIX}{self.sha256}"


# --------------------------------------------------------------------------------------------------
# Packing (the CLI)
# --------------------------------------------------------------------------------------------------


def read_ignore_file(root: Path) -> list[str]:
    """The patterns of ``root/.vigilignore`` (none when there is no such file)."""
    path = root / IGNORE_FILE
    if not path.is_file():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def is_excluded(rel: PurePosixPath, is_dir: bool, patterns: Iterable[str]) -> bool:
    """Whether ``rel`` (a path relative to the folder) matches one of ``patterns``.

    A pattern with a ``/`` inside matches the whole relative path (anchored at the folder, a leading
    ``/`` allowed); one without matches any single name along the way. A trailing ``/``: folders only.
    """
    text = rel.as_posix()
    for raw in patterns:
        dir_only = raw.endswith("/")
        pattern = raw.rstrip("/")
        if not pattern or (dir_only and not is_dir):
            continue
        if "/" in pattern:
            if fnmatch.fnmatchcase(text, pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(rel.name, pattern):
            return True
    return False


def pack_directory(root: Path, excludes: Sequence[str] = (), *, max_bytes: int | None = None) -> bytes:
    """``root``'s files as a deterministic zip (sorted entries, fixed times, files at the zip's root).

    Leaves out :data:`DEFAULT_EXCLUDES`, the patterns of ``root/.vigilignore`` and ``excludes``.
    Refuses (:class:`PackageError`) a missing folder, a symbolic link inside it, an empty result, and
    a zip larger than ``max_bytes``.
    """
    root = Path(root)
    if not root.is_dir():
        raise PackageError(f"working dir {root}: not a folder")
    patterns = [*DEFAULT_EXCLUDES, *read_ignore_file(root), *excludes]
    files: list[tuple[PurePosixPath, Path]] = []

    def walk(folder: Path) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            path = Path(entry.path)
            rel = PurePosixPath(path.relative_to(root).as_posix())
            if entry.is_symlink():
                if is_excluded(rel, path.is_dir(), patterns):
                    continue
                raise PackageError(f"working dir: {rel} is a symbolic link; packages hold plain files only "
                                   f"(copy its target in, or list it in {IGNORE_FILE})")
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_excluded(rel, is_dir, patterns):
                continue
            if is_dir:
                walk(path)
            elif entry.is_file(follow_symlinks=False):
                files.append((rel, path))

    walk(root)
    if not files:
        raise PackageError(f"working dir {root}: no files left to pack (all excluded?)")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel, path in files:
            info = zipfile.ZipInfo(rel.as_posix(), date_time=_FIXED_TIME)
            mode = path.stat().st_mode
            info.external_attr = (stat.S_IFREG | (0o755 if mode & stat.S_IXUSR else 0o644)) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with path.open("rb") as src, zf.open(info, "w") as dst:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    if max_bytes is not None and buf.tell() > max_bytes:
                        raise PackageError(f"working dir {root}: the package passes the limit of {max_bytes} "
                                           f"bytes at {rel} (leave large files out with {IGNORE_FILE})")
    data = buf.getvalue()
    if max_bytes is not None and len(data) > max_bytes:
        raise PackageError(f"working dir {root}: the package is {len(data)} bytes, over the limit of {max_bytes}")
    return data


# --------------------------------------------------------------------------------------------------
# Checking and storing (the controller)
# --------------------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not name or "\\" in name or "\x00" in name:
        raise PackageError(f"entry {name!r}: names use '/' only, without NUL")
    path = PurePosixPath(name)
    if path.is_absolute() or re.match(r"^[A-Za-z]:", name):
        raise PackageError(f"entry {name!r}: an absolute path would land outside the working dir")
    if ".." in path.parts:
        raise PackageError(f"entry {name!r}: '..' would land outside the working dir")
    # One spelling per path: `a/./b.py` or `a//b.py` is `a/b.py` to the filesystem but not to a check on names.
    segments = name.rstrip("/").split("/")
    if any(s in ("", ".") for s in segments):
        raise PackageError(f"entry {name!r}: '.' and empty path segments are refused (one spelling per path)")


def _check_mode(name: str, info: zipfile.ZipInfo) -> None:
    """Plain files and folders only, without setuid, setgid or sticky bits (a zip made on Windows has no mode)."""
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise PackageError(f"entry {name!r} is a symbolic link; packages hold plain files only")
    kind = stat.S_IFMT(mode)
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise PackageError(f"entry {name!r} is not a plain file or folder (mode {mode:o}); packages hold plain files only")
    if mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
        raise PackageError(f"entry {name!r} has a setuid, setgid or sticky bit (mode {mode:o}): refused")


def _entries_declared(data: bytes) -> int:
    """The entry count the archive's end record declares, read before its central directory is parsed (a
    directory of a million tiny entries costs hundreds of MB to parse: the limit must come first)."""
    try:
        end = zipfile._EndRecData(io.BytesIO(data))  # the stdlib's own reader of the end record (zip64 too)
    except (OSError, ValueError, struct.error) as e:
        raise PackageError(f"package is not a readable zip archive ({e})") from e
    if end is None:
        raise PackageError("package is not a zip archive")
    return int(end[zipfile._ECD_ENTRIES_TOTAL])


def validate_package(data: bytes, *, max_bytes: int, max_unzipped_bytes: int, max_files: int) -> PackageInfo:
    """Check ``data`` as a code package (module docstring); :class:`PackageError` naming the rule."""
    if len(data) > max_bytes:
        raise PackageError(f"package is {len(data)} bytes, over the limit of {max_bytes}")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise PackageError("package is not a zip archive")
    declared = _entries_declared(data)
    if declared > max_files:
        raise PackageError(f"package holds {declared} entries, over the limit of {max_files}")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise PackageError(f"package is not a readable zip archive ({e})") from e
    with zf:
        infos = zf.infolist()
        if len(infos) > max_files:
            raise PackageError(f"package holds {len(infos)} entries, over the limit of {max_files}")
        seen: dict[str, str] = {}
        names: set[str] = set()
        total = 0
        files = 0
        for info in infos:
            name = info.filename
            _check_name(name)
            key = name.rstrip("/")
            if key in names:
                raise PackageError(f"entry {name!r} appears twice")
            names.add(key)
            # `Model.py` beside `model.py`: two files on Linux, one on macOS and Windows (which one wins?)
            folded = key.casefold()
            if folded in seen:
                raise PackageError(f"entry {name!r} differs from {seen[folded]!r} only by case: refused")
            seen[folded] = key
            _check_mode(name, info)
            if info.flag_bits & 0x1:
                raise PackageError(f"entry {name!r} is encrypted")
            if info.is_dir():
                continue
            files += 1
            try:
                with zf.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        total += len(chunk)
                        if total > max_unzipped_bytes:
                            raise PackageError(f"package unpacks to more than the limit of {max_unzipped_bytes} "
                                               f"bytes (at {name!r}): refused as a zip bomb or too large")
            except PackageError:
                raise
            except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError) as e:
                raise PackageError(f"entry {name!r} cannot be read ({e})") from e
        if files == 0:
            raise PackageError("package holds no files")
    return PackageInfo(sha256=hashlib.sha256(data).hexdigest(), size=len(data), files=files, unzipped_bytes=total)


def parse_ref(ref: str) -> str:
    """The hex digest of a ``sha256:<hex>`` reference (or of a bare hex digest)."""
    digest = ref.removeprefix(REF_PREFIX)
    if not _HEX.match(digest):
        raise PackageError(f"package reference {ref!r}: expected 'sha256:' and 64 lowercase hex digits")
    return digest


def package_path(packages_dir: Path, ref: str) -> Path:
    """Where the package ``ref`` is (or would be) stored."""
    return Path(packages_dir) / f"{parse_ref(ref)}.zip"


def package_exists(packages_dir: Path, ref: str) -> bool:
    return package_path(packages_dir, ref).is_file()


def store_package(data: bytes, packages_dir: Path, *, max_bytes: int, max_unzipped_bytes: int,
                  max_files: int, admit: Callable[[PackageInfo], None] | None = None) -> tuple[PackageInfo, bool]:
    """Check ``data`` and store it under its hash; ``(info, created)``. Idempotent: the same bytes are
    stored once. Written to a temporary file in the same folder, then renamed: never half a package.
    ``admit(info)`` runs once the package is found valid and before anything is written (it may raise:
    a quota)."""
    info = validate_package(data, max_bytes=max_bytes, max_unzipped_bytes=max_unzipped_bytes, max_files=max_files)
    if admit is not None:
        admit(info)
    packages_dir = Path(packages_dir)
    target = packages_dir / f"{info.sha256}.zip"
    if target.is_file():
        return info, False
    packages_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".upload-", suffix=".tmp", dir=packages_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return info, True


def read_info(packages_dir: Path, ref: str) -> PackageInfo:
    """The :class:`PackageInfo` of a stored package (``FileNotFoundError`` when there is none)."""
    data = package_path(packages_dir, ref).read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
        return PackageInfo(sha256=hashlib.sha256(data).hexdigest(), size=len(data), files=len(infos),
                           unzipped_bytes=sum(i.file_size for i in infos))
