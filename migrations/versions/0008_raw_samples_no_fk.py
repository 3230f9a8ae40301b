"""raw samples without a foreign key to jobs: the per-row check cost a quarter of the ingest rate

step_metrics and collective_metrics lose their foreign key to jobs (``controller.models.RAW_SAMPLES_WITHOUT_FK``):
on PostgreSQL it is a trigger per inserted row that key-share locks the job's row, from every concurrent
ingest transaction; on SQLite a lookup per row. Measured on this machine, bulk inserts of the same rows
into PostgreSQL: 94k samples/s with it, 126k without. Ingest stores only samples of existing jobs and raw
rows are pruned by age, so nothing relies on the cascade.

Revision ID: 0008_raw_samples_no_fk
Revises: 0007_sample_attempt
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0008_raw_samples_no_fk'
down_revision: str | None = '0007_sample_attempt'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ('step_metrics', 'collective_metrics')


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(f'fk_{table}_job_id_jobs', type_='foreignkey')


def downgrade() -> None:
    for table in _TABLES:
        # Rows of jobs that no longer exist would block the constraint: they are orphans, dropped.
        op.execute(f'DELETE FROM {table} WHERE job_id NOT IN (SELECT id FROM jobs)')
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_foreign_key(f'fk_{table}_job_id_jobs', 'jobs', ['job_id'], ['id'], ondelete='CASCADE')
