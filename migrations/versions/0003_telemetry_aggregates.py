"""telemetry aggregates: per-step stats kept for good (job, rank, collective kind) and the dirty-step queue

Raw step_metrics / collective_metrics rows are pruned after VIGIL_RAW_RETENTION_S once their step
is aggregated; these tables are what stays (see controller/aggregation.py).

Revision ID: 0003_telemetry_aggregates
Revises: 0002_tokens
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003_telemetry_aggregates'
down_revision: str | None = '0002_tokens'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('collective_step_stats',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('op', sa.String(length=64), nullable=False),
    sa.Column('group', sa.String(length=64), nullable=False),
    sa.Column('tag', sa.String(length=64), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('calls', sa.Integer(), nullable=False),
    sa.Column('ranks', sa.Integer(), nullable=False),
    sa.Column('p50_s', sa.Float(), nullable=False),
    sa.Column('max_s', sa.Float(), nullable=False),
    sa.Column('min_s', sa.Float(), nullable=False),
    sa.Column('slowest_rank', sa.Integer(), nullable=False),
    sa.Column('transfer_s', sa.Float(), nullable=False),
    sa.Column('wait_p50_s', sa.Float(), nullable=False),
    sa.Column('wait_max_s', sa.Float(), nullable=False),
    sa.Column('most_waiting_rank', sa.Integer(), nullable=False),
    sa.Column('payload_bytes', sa.BigInteger(), nullable=False),
    sa.Column('wire_bytes', sa.BigInteger(), nullable=False),
    sa.Column('elements', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_collective_step_stats_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step', 'op', 'group', 'tag', name=op.f('pk_collective_step_stats'))
    )
    op.create_table('job_step_stats',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('ranks', sa.Integer(), nullable=False),
    sa.Column('loss_mean', sa.Float(), nullable=True),
    sa.Column('step_time_p50_s', sa.Float(), nullable=True),
    sa.Column('step_time_max_s', sa.Float(), nullable=True),
    sa.Column('slowest_rank', sa.Integer(), nullable=True),
    sa.Column('comm_s_max', sa.Float(), nullable=True),
    sa.Column('comm_wait_max_s', sa.Float(), nullable=True),
    sa.Column('most_waiting_rank', sa.Integer(), nullable=True),
    sa.Column('collectives', sa.Integer(), nullable=False),
    sa.Column('payload_bytes', sa.BigInteger(), nullable=False),
    sa.Column('wire_bytes', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_step_stats_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step', name=op.f('pk_job_step_stats'))
    )
    op.create_table('rank_step_stats',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.String(length=128), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('tokens_per_s', sa.Float(), nullable=True),
    sa.Column('step_time_s', sa.Float(), nullable=True),
    sa.Column('data_s', sa.Float(), nullable=True),
    sa.Column('fwd_bwd_s', sa.Float(), nullable=True),
    sa.Column('optim_s', sa.Float(), nullable=True),
    sa.Column('comm_s', sa.Float(), nullable=True),
    sa.Column('comm_wait_s', sa.Float(), nullable=True),
    sa.Column('collectives', sa.Integer(), nullable=False),
    sa.Column('payload_bytes', sa.BigInteger(), nullable=False),
    sa.Column('wire_bytes', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_rank_step_stats_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step', 'rank', name=op.f('pk_rank_step_stats'))
    )
    op.create_table('telemetry_dirty_steps',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('touched_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_telemetry_dirty_steps_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step', name=op.f('pk_telemetry_dirty_steps'))
    )
    with op.batch_alter_table('telemetry_dirty_steps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_telemetry_dirty_steps_touched_at'), ['touched_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('telemetry_dirty_steps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_telemetry_dirty_steps_touched_at'))

    op.drop_table('telemetry_dirty_steps')
    op.drop_table('rank_step_stats')
    op.drop_table('job_step_stats')
    op.drop_table('collective_step_stats')
