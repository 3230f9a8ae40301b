"""The file kinds of the executor: ``write_fault_file`` (atomic, never fired twice) and
``corrupt_files`` (only under ``storage_root``; symlinks, hard links, manifests and hidden files are
left alone; a fixed pattern, so a redo finds its own bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.commands.args import CorruptArgs, FaultFileArgs, _validate
from agent.commands.config import ExecutorConfig
from agent.commands.errors import CommandError
from vigil.contract.checkpoint_layout import MANIFEST_FILE, newest_complete
from vigil.contract.schemas import CommandResult
from vigil.contract.settings import FAULT_FIRED_SUFFIX, adapt_file_path, fault_file_path

#: ``corrupt_files`` leaves files whose name contains this alone (the checkpoint's manifest).
MANIFEST_MARKER = "manifest"
#: Bytes overwritten in the middle of each data file. A fixed pattern, so a redo finds the bytes
#: already corrupted and reports that instead of undoing (an XOR would) or re-randomising them.
CORRUPTION = (b"VIGIL-CORRUPTED!" * 4)[:64]
#: The rank renames its fault file to ``rank-<r>.json`` + this when the fault fires (vigil/faults.py).


class FileKinds:
    """``write_fault_file`` and ``corrupt_files``.

    Mixed into :class:`~agent.commands.executor.CommandExecutor`, which provides what is declared here.
    """

    config: ExecutorConfig

    # -- kinds: files -----------------------------------------------------------------------------
    def write_fault_file(self, args: Mapping[str, Any]) -> CommandResult:
        a: FaultFileArgs = _validate(FaultFileArgs, args)
        adapt = a.file == "adapt"
        path = (adapt_file_path if adapt else fault_file_path)(self.config.run_dir, a.job_id, a.rank)
        try:
            data = json.dumps(a.fault, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise CommandError(f"bad args: fault is not JSON: {exc}") from None
        fired = path.with_name(path.name + FAULT_FIRED_SUFFIX)
        with contextlib.suppress(OSError):
            if not adapt and fired.read_bytes() == data:
                # A redo of a fault the rank already took: writing it again would fire it twice.
                return CommandResult(
                    ok=True, message=f"{path} already fired", output={"path": str(path), "fired": True}
                )
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.config.rank_group is not None:  # the ranks (another user) rename it to .fired: their folder
            os.chown(path.parent, -1, self.config.rank_group)
            path.parent.chmod(0o770)
        # Atomic: the rank's once-per-step stat sees either no file or the whole file.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return CommandResult(ok=True, message=f"wrote {path}", output={"path": str(path)})

    def _inside_storage(self, raw: str) -> Path:
        root = self.config.storage_root.resolve()
        given = Path(raw).expanduser()
        candidate = given if given.is_absolute() else root / given
        try:
            target = candidate.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise CommandError(f"no such path: {raw} ({type(exc).__name__})") from None
        if target == root or not target.is_relative_to(root):
            raise CommandError(f"refused: {raw} resolves to {target}, not inside the storage root {root}")
        return target

    def corrupt_files(self, args: Mapping[str, Any]) -> CommandResult:
        a: CorruptArgs = _validate(CorruptArgs, args)
        root = self.config.storage_root.resolve()
        target = self._inside_storage(a.path)
        if a.newest_under:
            target = self._newest_complete(target)
        files: list[Path] = []
        if target.is_dir():
            for dirpath, dirnames, filenames in os.walk(target, followlinks=False):
                dirnames.sort()
                files.extend(Path(dirpath) / n for n in sorted(filenames))
        else:
            files.append(target)
        touched: list[str] = []
        already: list[str] = []
        skipped: dict[str, str] = {}
        for f in files:
            why = self._corrupt_one(f, root)
            if why == "corrupted":
                touched.append(str(f))
            elif why == "already":
                already.append(str(f))
            else:
                skipped[str(f)] = why
        output = {
            "path": str(target),
            "files": touched,
            "already_corrupted": already,
            "skipped": skipped,
            "bytes_per_file": len(CORRUPTION),
        }
        if not touched and not already:
            return CommandResult(ok=False, message=f"no data file to corrupt under {target}", output=output)
        return CommandResult(
            ok=True,
            message=f"corrupted {len(touched)} file(s) under {target}"
            + (f" ({len(already)} already corrupted)" if already else ""),
            output=output,
        )

    def _newest_complete(self, folder: Path) -> Path:
        """The newest checkpoint under ``folder`` that its writer finished (the shared layout: a
        ``step-XXXXXXXX`` folder holding its manifest)."""
        if not folder.is_dir():
            raise CommandError(f"newest_under: {folder} is not a folder")
        newest = newest_complete(folder)
        if newest is None:
            raise CommandError(f"newest_under: no complete checkpoint (a step-* folder with its {MANIFEST_FILE}) "
                               f"in {folder}")
        return self._inside_storage(str(newest[1]))

    @staticmethod
    def _corrupt_one(path: Path, root: Path) -> str:
        """'corrupted', 'already', or why the file was skipped."""
        if MANIFEST_MARKER in path.name.lower():
            return "manifest"
        if path.name.startswith("."):
            return "hidden (metadata or a temporary file)"
        try:
            st = path.lstat()
        except OSError as exc:
            return f"cannot stat: {exc}"
        if not stat.S_ISREG(st.st_mode):  # lstat: a symlink is never followed
            return "not a regular file (symlinks are never followed)"
        if st.st_nlink > 1:
            return "has other hard links (may live outside the storage root)"
        if not path.resolve().is_relative_to(root):
            return "outside the storage root"
        if st.st_size == 0:
            return "empty"
        n = min(len(CORRUPTION), st.st_size)
        offset = (st.st_size - n) // 2
        try:
            fd = open_under(root, path)
        except OSError as exc:
            return f"cannot open: {exc}"
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or now.st_nlink > 1:
                return "changed since it was checked (replaced or linked): left alone"
            if os.pread(fd, n, offset) == CORRUPTION[:n]:
                return "already"
            os.pwrite(fd, CORRUPTION[:n], offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        return "corrupted"


def open_under(root: Path, path: Path) -> int:
    """``path`` (inside ``root``) opened read-write, one component at a time from ``root`` without following a
    symbolic link anywhere (``O_NOFOLLOW`` on each, relative to the folder opened before): a folder on the way
    swapped for a link after the checks (a job's own files are the job's to change) fails with ELOOP or
    ENOTDIR instead of leading outside the storage root."""
    rel = path.relative_to(root).parts
    if not rel:
        raise IsADirectoryError(str(path))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in rel[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(rel[-1], os.O_RDWR | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)
