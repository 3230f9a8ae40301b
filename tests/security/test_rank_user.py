"""Ranks run as a user of their own under `vigil up` as root (controller/rankuser.py).

Before: every raylet, so every rank, ran as the controller's user (root here): a job read the admin token and
the SQLite database in the controller's home. Now the raylets run through :attr:`Isolation.drop`; these tests
run real processes through it (the e2e proof on a whole cluster is tests/e2e/test_tenant.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from controller.rankuser import isolate, reveal_argv, unreachable_by_others

root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                               reason="switching users needs root and setpriv")


@pytest.fixture
def ray_temp():
    d = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_folder_closed_to_others_is_found_on_the_way(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    tmp_path.chmod(0o755)
    assert unreachable_by_others([closed / "inner"]) in (closed, *closed.parents)
    closed.chmod(0o711)
    assert unreachable_by_others([closed / "inner"]) in (None, *tmp_path.parents)


@root_only
def test_the_rank_user_reaches_only_what_it_is_shown(ray_temp: Path) -> None:
    hidden = Path(tempfile.mkdtemp(prefix="vh-", dir="/tmp"))  # 0700, like /root holding a pyenv Python
    try:
        (hidden / "python").mkdir()
        (hidden / "python" / "lib.py").write_text("x = 1\n")
        (hidden / "secret").write_text("root's\n")
        prefix = [*reveal_argv([hidden / "python"], ray_temp / ".mnt"),
                  "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        shown = subprocess.run([*prefix, "cat", str(hidden / "python" / "lib.py")], capture_output=True, text=True, check=False)
        assert shown.returncode == 0 and shown.stdout == "x = 1\n", shown.stderr
        listing = subprocess.run([*prefix, "ls", "-A", str(hidden)], capture_output=True, text=True, check=False)
        assert listing.stdout.split() == ["python"], listing  # the rest of the folder is not even there
        direct = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "cat",
                                 str(hidden / "python" / "lib.py")], capture_output=True, text=True, check=False)
        assert direct.returncode != 0  # without the namespace it stays closed (nothing changed on the host)
        assert (hidden.stat().st_mode & 0o777) == 0o700
    finally:
        shutil.rmtree(hidden, ignore_errors=True)


@root_only
def test_a_rank_runs_unprivileged_and_cannot_read_the_controllers_home(tmp_path: Path, ray_temp: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin-token").write_text("admin\n")
    (home / "admin-token").chmod(0o644)  # even a readable file: the home itself is closed
    storage = tmp_path / "storage-not-used"
    iso = isolate(home, ray_temp, None, storage)
    try:
        assert iso.user is not None and iso.user.uid != 0
        assert (home.stat().st_mode & 0o777) == 0o700
        code = ("import os, sys, pathlib; print(os.getuid(), os.geteuid());"
                "pathlib.Path(sys.argv[2], 'ckpt').write_text('ok');"
                "print(open(sys.argv[1]).read())")
        out = subprocess.run([*iso.drop, sys.executable, "-c", code, str(home / "admin-token"), str(iso.storage)],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.stdout.split()[:2] == [str(iso.user.uid)] * 2, out
        assert "PermissionError" in out.stderr, out.stderr[-1000:]
        assert (iso.storage / "ckpt").read_text() == "ok"  # its checkpoints: writable by it
    finally:
        shutil.rmtree(iso.storage, ignore_errors=True)
