"""exactly once per sample: a run attempt on raw samples, a unique key per sample, a fault's hit step

step_metrics and collective_metrics gain ``attempt`` (the rank group's run attempt, increasing at
every restart of the ranks) and a unique index per sample: (job_id, rank, step, attempt) and
(job_id, step, rank, attempt, seq). Ingest inserts with ON CONFLICT DO NOTHING, so a replay under
any batch number stores nothing twice. Rows written before carry no attempt: several rows of one
(job, rank, step) were re-runs after a restore, numbered here 0, 1, ... in arrival (id) order, which
is the order the reads used to pick the newest by. The new unique indexes replace
ix_step_metrics_job_rank_step and ix_collective_metrics_job_step (their prefixes).
faults gain ``hit_step``: the step a fault really hit.

Revision ID: 0007_sample_attempt
Revises: 0006_views
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007_sample_attempt'
down_revision: str | None = '0006_views'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _number_legacy_attempts(table: str, key: str) -> None:
    """attempt = 0, 1, ... per ``key`` in id order (window functions: SQLite >= 3.25, PostgreSQL)."""
    op.execute(
        f"UPDATE {table} SET attempt = numbered.n FROM ("
        f"SELECT id, ROW_NUMBER() OVER (PARTITION BY {key} ORDER BY id) - 1 AS n FROM {table}"
        f") AS numbered WHERE {table}.id = numbered.id AND numbered.n > 0"
    )


def upgrade() -> None:
    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), server_default='0', nullable=False))
    with op.batch_alter_table('collective_metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), server_default='0', nullable=False))
    _number_legacy_attempts('step_metrics', 'job_id, rank, step')
    _number_legacy_attempts('collective_metrics', 'job_id, step, rank, seq')
    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_step_metrics_job_rank_step')
        batch_op.create_index('uq_step_metrics_sample', ['job_id', 'rank', 'step', 'attempt'], unique=True)
    with op.batch_alter_table('collective_metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_collective_metrics_job_step')
        batch_op.create_index('uq_collective_metrics_sample', ['job_id', 'step', 'rank', 'attempt', 'seq'],
                              unique=True)
    with op.batch_alter_table('faults', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hit_step', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('faults', schema=None) as batch_op:
        batch_op.drop_column('hit_step')
    with op.batch_alter_table('collective_metrics', schema=None) as batch_op:
        batch_op.drop_index('uq_collective_metrics_sample')
        batch_op.create_index('ix_collective_metrics_job_step', ['job_id', 'step'], unique=False)
        batch_op.drop_column('attempt')
    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.drop_index('uq_step_metrics_sample')
        batch_op.create_index('ix_step_metrics_job_rank_step', ['job_id', 'rank', 'step'], unique=False)
        batch_op.drop_column('attempt')
