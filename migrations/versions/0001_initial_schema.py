"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('ts', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=True),
    sa.Column('node_id', sa.String(length=128), nullable=True),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_ts'), ['ts'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('ray_job_id', sa.String(length=128), nullable=True),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_step', sa.Integer(), nullable=True),
    sa.Column('last_loss', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_status'), ['status'], unique=False)

    op.create_table('nodes',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('hostname', sa.String(length=128), nullable=False),
    sa.Column('address', sa.String(length=128), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('agent_id', sa.String(length=128), nullable=True),
    sa.Column('last_heartbeat', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ranks', sa.JSON(), nullable=False),
    sa.Column('host', sa.JSON(), nullable=False),
    sa.Column('dropped_samples', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes'))
    )
    op.create_table('telemetry_batches',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('agent_id', sa.String(length=128), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_telemetry_batches')),
    sa.UniqueConstraint('agent_id', 'seq', name='uq_telemetry_batches_agent_seq')
    )
    op.create_table('collective_metrics',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('node_id', sa.String(length=128), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('op', sa.String(length=64), nullable=False),
    sa.Column('group', sa.String(length=64), nullable=False),
    sa.Column('tag', sa.String(length=64), nullable=False),
    sa.Column('payload_bytes', sa.BigInteger(), nullable=False),
    sa.Column('wire_bytes', sa.BigInteger(), nullable=False),
    sa.Column('elements', sa.BigInteger(), nullable=False),
    sa.Column('duration_s', sa.Float(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_collective_metrics_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_collective_metrics'))
    )
    with op.batch_alter_table('collective_metrics', schema=None) as batch_op:
        batch_op.create_index('ix_collective_metrics_job_step', ['job_id', 'step'], unique=False)

    op.create_table('step_metrics',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('node_id', sa.String(length=128), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('lr', sa.Float(), nullable=True),
    sa.Column('tokens', sa.Integer(), nullable=False),
    sa.Column('step_time_s', sa.Float(), nullable=False),
    sa.Column('tokens_per_s', sa.Float(), nullable=False),
    sa.Column('data_s', sa.Float(), nullable=True),
    sa.Column('fwd_bwd_s', sa.Float(), nullable=True),
    sa.Column('optim_s', sa.Float(), nullable=True),
    sa.Column('comm_s', sa.Float(), nullable=True),
    sa.Column('comm_wait_s', sa.Float(), nullable=True),
    sa.Column('val_loss', sa.Float(), nullable=True),
    sa.Column('dropped', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_step_metrics_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_step_metrics'))
    )
    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.create_index('ix_step_metrics_job_rank_step', ['job_id', 'rank', 'step'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_step_metrics_job_rank_step')

    op.drop_table('step_metrics')
    with op.batch_alter_table('collective_metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_collective_metrics_job_step')

    op.drop_table('collective_metrics')
    op.drop_table('telemetry_batches')
    op.drop_table('nodes')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_status'))
        batch_op.drop_index(batch_op.f('ix_jobs_created_at'))

    op.drop_table('jobs')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_ts'))
        batch_op.drop_index(batch_op.f('ix_events_job_id'))

    op.drop_table('events')
