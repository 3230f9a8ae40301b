"""The unprivileged user a job's ranks run as under ``vigil up`` (docs/SECURITY.md).

``vigil up`` started by root runs every raylet (and so every Ray worker: the jobs' drivers and ranks) as
:data:`RANK_USER`, created if missing as Ray's own images create theirs, while the controller, the agents
and the controller's home (mode 0700: the admin token, the SQLite database, the agents' spools) stay root's.
A rank then cannot read Vigil's secrets on disk, nor the agents' environment under ``/proc``, nor signal
them. The drop is ``setpriv`` (util-linux) in front of the raylet's command line, so that it also works
through ``ip netns exec`` and for a raylet an agent starts again (its join command carries the prefix).

A non-root ``vigil up`` cannot switch users: its ranks run as that user, and it says so in one line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

RANK_USER = "vigil-worker"
"""The system user ranks run as (``VIGIL_RANK_USER`` overrides the name)."""

PRIVATE_STORAGE_ROOT = Path("/var/lib/vigil/storage")
"""Where an isolated ``vigil up`` keeps checkpoints unless ``VIGIL_STORAGE_PATH`` says otherwise: outside the
controller's home (0700), one folder per home, owned by the rank user."""


class RankUserError(RuntimeError):
    """The rank user cannot be set up (no ``setpriv``, ``useradd`` failed, or it cannot reach Python)."""


@dataclass(frozen=True)
class RankUser:
    name: str
    uid: int
    gid: int

    def drop_argv(self, home: Path) -> list[str]:
        """The prefix that runs a command as this user: real and effective ids, no supplementary groups, no
        new privileges (a setuid binary does not raise them again), ``HOME``/``USER`` its own."""
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        return [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--no-new-privs", "--",
                "/usr/bin/env", f"HOME={home}", f"USER={self.name}", f"LOGNAME={self.name}"]

    def give(self, path: Path, mode: int = 0o700) -> Path:
        """``path`` (a folder, created if missing) owned by this user with ``mode``."""
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        path.chmod(mode)
        return path


def ensure_rank_user(name: str | None = None) -> RankUser | None:
    """The rank user (created if missing) when this process is root; None otherwise (ranks run as this user)."""
    name = name or os.environ.get("VIGIL_RANK_USER") or RANK_USER
    if os.geteuid() != 0:
        log.warning("vigil up is not root: ranks run as %s, who can read this Vigil's home (single-user only)",
                    pwd.getpwuid(os.geteuid()).pw_name)
        return None
    if shutil.which("setpriv") is None:
        raise RankUserError("setpriv (util-linux) is missing: vigil up as root runs ranks as an unprivileged user "
                            "through it; install util-linux")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        done = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                               "--shell", "/usr/sbin/nologin", name], capture_output=True, text=True, check=False)
        try:  # another vigil up may have created it meanwhile
            entry = pwd.getpwnam(name)
        except KeyError:
            raise RankUserError(f"cannot create the rank user {name!r}: {done.stderr.strip()}") from None
        log.info("created the system user %s (uid %d): ranks run as it", name, entry.pw_uid)
    if entry.pw_uid == 0:
        raise RankUserError(f"VIGIL_RANK_USER={name!r} is root: ranks must run unprivileged")
    return RankUser(name, entry.pw_uid, entry.pw_gid)


def unreachable_by_others(paths: list[Path]) -> Path | None:
    """The first folder on the way to any of ``paths`` that another user cannot enter (no ``o+x``), or None."""
    for path in paths:
        for folder in [*reversed(Path(path).resolve().parents), Path(path).resolve()]:
            try:
                st = folder.stat()
            except OSError:
                return folder
            if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
                return folder
    return None


def reveal_argv(needed: list[Path], stage: Path) -> list[str]:
    """The prefix that lets the rank user reach ``needed`` (Python, the venv, Vigil's code) where a folder on
    the way is closed to others (``/root`` holding a pyenv Python, 0700): in a private mount namespace that
    folder is an empty tmpfs (mode 0755) holding only the needed folders, bound read-only. Nothing changes
    outside it, and the ranks see nothing else of that folder. Empty when everything is reachable already."""
    binds: list[Path] = []
    for path in needed:
        if unreachable_by_others([path]) is not None and not any(path.is_relative_to(b) for b in binds):
            binds = [b for b in binds if not b.is_relative_to(path)] + [path]
    if not binds:
        return []
    hidden = sorted({unreachable_by_others([b]) for b in binds}, key=lambda p: len(p.parts))  # type: ignore[arg-type]
    stage.mkdir(mode=0o700, parents=True, exist_ok=True)
    q = shlex.quote
    script = ["set -e"]
    for i, b in enumerate(binds):
        (stage / f"m{i}").mkdir(exist_ok=True)
        script.append(f"mount --bind {q(str(b))} {q(str(stage / f'm{i}'))}")
    for h in hidden:
        if not any(h.is_relative_to(o) and h != o for o in hidden):
            script.append(f"mount -t tmpfs -o mode=755,size=1m vigil-hidden {q(str(h))}")
    for i, b in enumerate(binds):
        script += [f"mkdir -p {q(str(b))}", f"mount --move {q(str(stage / f'm{i}'))} {q(str(b))}",
                   f"mount -o remount,bind,ro {q(str(b))}"]
    script.append('exec "$@"')
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    return [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "; ".join(script), "vigil-reveal"]


def private_storage(home: Path) -> Path:
    """The isolated default checkpoint storage of the Vigil whose home is ``home``."""
    return PRIVATE_STORAGE_ROOT / hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]


def make_home_private(home: Path) -> None:
    """The controller's home 0700, root's: nothing in it is readable by a rank."""
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o700)


@dataclass(frozen=True)
class Isolation:
    """What ``vigil up`` changes to run ranks as :class:`RankUser` (all empty when it cannot)."""

    user: RankUser | None
    drop: list[str]
    """Prefix of every raylet's command line (and of the join command an agent runs again)."""
    storage: Path | str
    """A local folder, or a URI (``s3://...``: nothing to give the rank user)."""
    env: dict[str, str]
    """Added to every child's environment (where Ray's token is for the rank user's raylets)."""


def isolate(home: Path, ray_temp: Path, storage: Path | str | None, default_storage: Path) -> Isolation:
    """Set up the rank user for a ``vigil up`` whose home is ``home``: the home made private, Ray's temp
    folder, Ray's token and the checkpoint storage given to the rank user. ``storage``: the operator's
    (``VIGIL_STORAGE_PATH``), else the private default."""
    user = ensure_rank_user()
    if user is None:
        return Isolation(None, [], storage or default_storage, {})
    import controller

    code = Path(controller.__file__).resolve().parent.parent
    needed = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), code]
    reveal = reveal_argv(needed, ray_temp / ".mnt")
    make_home_private(home)
    user.give(ray_temp)
    ray_home = user.give(ray_temp / "home")
    env: dict[str, str] = {}
    if not os.environ.get("RAY_AUTH_TOKEN") and os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled":
        source = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        token = ray_temp / "auth_token"
        token.write_bytes(source.read_bytes())
        os.chown(token, user.uid, user.gid)
        token.chmod(0o600)
        env["RAY_AUTH_TOKEN_PATH"] = str(token)
    store = storage or private_storage(home)
    if storage is None:
        user.give(store)
    return Isolation(user, [*reveal, *user.drop_argv(ray_home)], store, env)
