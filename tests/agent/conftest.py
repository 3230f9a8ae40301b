"""Fixtures of the agent tests.

* ``short_dir``: a folder with a short path under /tmp (unix sockets);
* ``setup``: a migrated database (``db_url``) with an admin and an agent token, and a ``vigil controller``
  process on it, not started (:class:`tests.agent.crash_rig.ControllerProcess`), run from ``short_dir``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller import migrate
from controller.db import make_engine, make_session_factory, session_scope
from controller.tokens import create_token
from tests.harness import ControllerProcess
from vigil.contract.schemas import Role, TokenCreate


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path: unix socket paths are limited to 107 bytes, pytest's tmp_path
    can be longer."""
    d = Path(tempfile.mkdtemp(prefix="vga-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def setup(db_url: str, short_dir: Path) -> Iterator[tuple[ControllerProcess, dict[str, str], Path]]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    sessions = make_session_factory(engine)
    with session_scope(sessions) as s:
        tokens = {"admin": create_token(s, TokenCreate(role=Role.ADMIN, name="t")).token,
                  "agent": create_token(s, TokenCreate(role=Role.AGENT, name="t")).token}
    engine.dispose()
    ctl = ControllerProcess(short_dir, db_url)
    try:
        yield ctl, tokens, short_dir
    finally:
        ctl.stop()
