"""Fixtures of the controller tests: ``env``, a controller driven one monitor step at a time
(tests/controller/recovery_env.py; a module's own ``env`` fixture takes precedence), and ``sessions``, a
migrated SQLite database of the test's own."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from controller import migrate
from controller.db import make_engine
from tests.controller.recovery_env import env

__all__ = ["env", "sessions"]


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'vigil.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    yield sessionmaker(engine)
    engine.dispose()
