"""Shared fixtures: databases (SQLite file, and a fresh PostgreSQL database on 127.0.0.1:5432), and the
real controller served live (``live_controller``)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.live_controller import LiveController

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Helpers moved out of test modules keep pytest's assertion introspection, as they had there (only test
# modules and conftest files are rewritten unless named here, before anything imports them).
pytest.register_assert_rewrite(
    "tests.agent.crash_rig", "tests.controller.samples", "tests.controller.telemetry_client",
    "tests.dashboard.signin_helpers", "tests.vigil.checkpoint_helpers", "tests.vigil.telemetry_sink",
)


def pytest_configure(config: pytest.Config) -> None:
    """Ray token authentication on for the whole run, before any test touches Ray.

    Ray fixes a process's authentication mode at its first use. The clusters the tests start run
    with tokens, as `vigil up` runs them; without this, whichever test used Ray first would decide
    whether this process can talk to the later ones (seen: a Ray Train test run before the
    end-to-end ones left the process unable to reach any `vigil up` cluster).
    """
    from ops.localcluster import ensure_ray_token

    ensure_ray_token()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``beside`` (slow, but mostly waiting) first, in their order: in the parallel half of
    `make test` they then start at once beside the short tests, rather than end it alone. A test module
    that uses the network namespaces of ``ops.netns`` outside the slow part must be marked ``links``."""
    _check_links(items)
    beside = [i for i in items if i.get_closest_marker("beside")]
    if beside:
        ids = {id(i) for i in beside}
        items[:] = beside + [i for i in items if id(i) not in ids]


def _check_links(items: list[pytest.Item]) -> None:
    """The parallel half of `make test` runs the browser tests; Chromium aborts every request in flight
    when a link of the host's namespace comes or goes (seen in CI: a page stuck at "Loading..." with
    net::ERR_NETWORK_CHANGED, a click's callback lost). So a module that makes links (it uses ``ops.netns``)
    runs in the serial part: it is ``slow``, ``timing`` or ``links``."""
    import ops.netns

    strays = sorted({i.nodeid.split("::", 1)[0] for i in items
                     if isinstance(i, pytest.Function) and ops.netns in vars(i.module).values()
                     and not any(i.get_closest_marker(m) for m in ("slow", "timing", "links"))})
    if strays:
        raise pytest.UsageError(f"{strays} use ops.netns (host links) beside the browser tests: mark them "
                                "pytest.mark.links (or slow/timing) so make test runs them apart")


PG_ADMIN_URL = os.environ.get("VIGIL_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pg_connect():  # type: ignore[no-untyped-def]
    import psycopg

    return psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)


def _ensure_postgres() -> str | None:
    """None when PostgreSQL answers (starting it if it is installed but down), else the reason."""
    try:
        _pg_connect().close()
        return None
    except Exception as first:  # noqa: BLE001 - any failure means "try to start it"
        versions = Path("/etc/postgresql")
        if versions.is_dir():
            for v in sorted(versions.iterdir()):
                subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", v.name, "main", "start"],
                               check=False, capture_output=True, timeout=60)
            try:
                _pg_connect().close()
                return None
            except Exception as exc:  # noqa: BLE001
                return f"PostgreSQL on 127.0.0.1:5432 unreachable even after pg_ctlcluster start: {exc}"
        return f"PostgreSQL on 127.0.0.1:5432 unreachable and not installed here: {first}"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'vigil.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    reason = _ensure_postgres()
    if reason:
        pytest.skip(reason)
    name = f"vigil_test_{uuid.uuid4().hex[:10]}"
    with _pg_connect() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with _pg_connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs once on SQLite and once on PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


@pytest.fixture
def live_controller(tmp_path: Path) -> Iterator[LiveController]:
    """The real controller served on 127.0.0.1 (:mod:`tests.live_controller`), stopped after the test."""
    from tests.live_controller import LiveController

    controller = LiveController(tmp_path / "controller").start()
    try:
        yield controller
    finally:
        controller.stop()
