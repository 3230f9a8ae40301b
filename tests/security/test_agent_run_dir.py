"""Attacks on the agent's run folder (its rank socket, the ranks' fault files).

Finding (issue 23): a root agent used ``/tmp/vigil`` by default, a path any local user can create first (with
a socket or fault files of their own in it, or as a link elsewhere). The default is now ``/run/vigil`` for
root (``$XDG_RUNTIME_DIR/vigil`` or ``/tmp/vigil-<uid>`` otherwise), and the agent refuses a run folder that
is a link, owned by another user, or writable by others. Each test failed before the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.rundir import RunDirError, prepare_run_dir
from vigil.contract.settings import Settings


def test_the_default_run_dir_is_no_fixed_tmp_path() -> None:
    run_dir = Settings().run_dir
    assert run_dir != Path("/tmp/vigil")
    if os.geteuid() == 0:
        assert run_dir == Path("/run/vigil")
    else:
        assert str(run_dir).endswith(f"vigil-{os.geteuid()}") or run_dir.name == "vigil"


def test_a_run_dir_made_unsafe_by_someone_else_is_refused(tmp_path: Path) -> None:
    made = prepare_run_dir(tmp_path / "run")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o755
    prepare_run_dir(made)  # its own folder again: fine
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match="not a plain folder"):
        prepare_run_dir(tmp_path / "link")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(RunDirError, match="writable by group or others"):
        prepare_run_dir(tmp_path / "open")
    if os.geteuid() == 0:  # a folder another user made first
        (tmp_path / "theirs").mkdir()
        os.chown(tmp_path / "theirs", 65534, 65534)
        with pytest.raises(RunDirError, match="owned by uid 65534"):
            prepare_run_dir(tmp_path / "theirs")
