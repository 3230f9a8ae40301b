"""Fixtures of the controller tests: ``env``, a controller driven one monitor step at a time
(tests/controller/recovery_env.py; a module's own ``env`` fixture takes precedence), and ``sessions``, a
migrated SQLite database of the test's own; ``any_lc``, the live controller on SQLite and on PostgreSQL."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from controller import migrate
from controller.db import make_engine
from tests.controller.recovery_env import env
from tests.live_controller import LiveController

__all__ = ["any_lc", "env", "sessions"]


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'vigil.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    yield sessionmaker(engine)
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_lc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveController]:
    """The live controller on SQLite, and once more on a fresh PostgreSQL database."""
    settings = {}
    if request.param == "postgresql":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    with LiveController(tmp_path / "controller", **settings) as lc:
        yield lc
