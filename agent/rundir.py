"""The agent's run folder: where its rank socket and the ranks' fault files live, checked before use."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def prepare_run_dir(path: Path) -> Path:
    """The agent's run folder (its socket, the ranks' fault files), created 0755 if missing; refused when it
    is a link, not a folder, owned by another user, or writable by others (a folder someone else made first
    could hold a socket or fault file of theirs). Its parents are created as ``mkdir -p`` would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o755)
    except FileExistsError:
        pass
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"run dir {path}: not a plain folder (a link or a file): refused")
    if st.st_uid != os.geteuid():
        raise RunDirError(f"run dir {path}: owned by uid {st.st_uid}, not this agent's {os.geteuid()}: refused")
    if st.st_mode & 0o022:
        raise RunDirError(f"run dir {path}: writable by group or others (mode {st.st_mode & 0o7777:o}): refused")
    return path


class RunDirError(Exception):
    """The agent's run folder is not safe to use (see :func:`prepare_run_dir`)."""
