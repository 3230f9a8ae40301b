"""Migrations agree with the models, upgrade an empty database and downgrade it, on SQLite and PostgreSQL.

Needs: the PostgreSQL server on 127.0.0.1:5432 (started if it is down) for the postgresql cases.
"""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from controller import migrate
from controller.db import make_engine
from controller.models import Base


def test_upgrade_matches_models_then_downgrade(db_url: str) -> None:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
            assert diff == [], f"models and migrations disagree: {diff}"
            assert ctx.get_current_revision() is not None
        tables = set(inspect(engine).get_table_names())
        assert set(Base.metadata.tables) <= tables
    finally:
        engine.dispose()

    migrate.downgrade(db_url, "base")
    engine = make_engine(db_url)
    try:
        left = set(inspect(engine).get_table_names()) - {"alembic_version"}
        assert left == set()
    finally:
        engine.dispose()
    # and up again: downgrade left nothing behind that blocks a fresh upgrade
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == _head(db_url)


def _head(url: str) -> str:
    """The single head revision (two heads mean two branches someone forgot to chain)."""
    heads = ScriptDirectory.from_config(migrate.alembic_config(url)).get_heads()
    assert len(heads) == 1, f"migrations/versions has several heads: {heads}"
    return heads[0]


def test_sqlite_runs_in_wal_mode(sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()
