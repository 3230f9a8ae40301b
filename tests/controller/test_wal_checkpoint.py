"""SQLite's WAL is checkpointed by the leader's :class:`~controller.db.WalCheckpointer`, not by the
ingest's commits (controller/db.py: ``WAL_AUTOCHECKPOINT_PAGES``, ``checkpoint_wal``).

The database file itself is read with ``immutable=1`` (no WAL): the rows a batch wrote are there only
once a checkpoint copied them. Real app, SQLite file. No PostgreSQL: it has no WAL file to checkpoint.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from controller.db import WAL_AUTOCHECKPOINT_PAGES, WalCheckpointer, checkpoint_wal
from tests.controller.samples import random_run
from tests.controller.telemetry_client import make_client, post


def _in_file(db: Path) -> int:
    """Step rows in the database file alone, ignoring the WAL."""
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    try:
        return con.execute("SELECT count(*) FROM step_metrics").fetchone()[0]
    finally:
        con.close()


def test_the_leaders_checkpointer_checkpoints_the_wal_the_ingest_does_not(tmp_path: Path) -> None:
    db = tmp_path / "vigil.db"
    with make_client(f"sqlite:///{db}", tmp_path) as client:
        with client.app.state.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == WAL_AUTOCHECKPOINT_PAGES
        r = client.post("/api/v1/jobs", json={"name": "wal", "steps": 10})
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        samples = random_run(job, ranks=100, steps=36, calls=8)  # 32,400 samples, 3 steps a batch: past
        per = len(samples) // 12  # SQLite's default of 1,000 pages, at which a commit would checkpoint
        for seq in range(12):
            post(client, samples[seq * per:(seq + 1) * per], seq)
        assert (tmp_path / "vigil.db-wal").stat().st_size > 1000 * 4096
        assert _in_file(db) == 0  # all of it still in the WAL
        checkpointers = [loop for loop in client.app.state.leadership.loops if isinstance(loop, WalCheckpointer)]
        assert len(checkpointers) == 1  # one of the leader's loops
        checkpointers[0].tick()
        assert _in_file(db) > 0
        pages, done = checkpoint_wal(client.app.state.sessions)
        assert pages == done  # nothing left behind
