"""Migrations agree with the models, upgrade an empty database and downgrade it, on SQLite and PostgreSQL.

Needs: the PostgreSQL server on 127.0.0.1:5432 (started if it is down) for the postgresql cases.
"""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

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


def test_sample_attempts_number_the_rows_stored_before_them(db_url: str) -> None:
    """0007 adds a unique key per sample: rows stored before, where a rank re-ran a step after a restore
    (several rows of one job, rank and step), become attempts 0, 1, ... in arrival order, not a
    failed upgrade or lost rows."""
    migrate.upgrade(db_url, "0006_views")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO jobs (id, name, status, spec, created_at, restarts, stalled_restarts) "
                              "VALUES ('j', 'j', 'RUNNING', '{}', CURRENT_TIMESTAMP, 0, 0)"))
            for rank, step, ts in [(0, 1, 1.0), (0, 2, 2.0), (0, 2, 9.0), (1, 2, 2.0), (0, 2, 12.0)]:
                conn.execute(text("INSERT INTO step_metrics (job_id, node_id, rank, step, ts, tokens, step_time_s, "
                                  "tokens_per_s, dropped) VALUES ('j', 'n', :r, :s, :t, 0, 0.1, 0, 0)"),
                             {"r": rank, "s": step, "t": ts})
            for seq, ts in [(0, 2.0), (1, 2.0), (0, 9.0)]:
                conn.execute(text("INSERT INTO collective_metrics (job_id, node_id, rank, step, seq, op, \"group\", "
                                  "tag, payload_bytes, wire_bytes, elements, duration_s, ts) "
                                  "VALUES ('j', 'n', 0, 2, :q, 'all_reduce', 'world', '', 1, 1, 1, 0.1, :t)"),
                             {"q": seq, "t": ts})
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            steps = conn.execute(text("SELECT rank, step, ts, attempt FROM step_metrics ORDER BY id")).all()
            colls = conn.execute(text("SELECT seq, ts, attempt FROM collective_metrics ORDER BY id")).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in steps] == [(0, 1, 1.0, 0), (0, 2, 2.0, 0), (0, 2, 9.0, 1), (1, 2, 2.0, 0),
                                         (0, 2, 12.0, 2)]
    assert [tuple(r) for r in colls] == [(0, 2.0, 0), (1, 2.0, 0), (0, 9.0, 1)]
