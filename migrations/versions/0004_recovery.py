"""recovery: incidents, faults, node commands, checkpoints, stack dumps; restart counters on jobs

Revision ID: 0004_recovery
Revises: 0003_telemetry_aggregates
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004_recovery'
down_revision: str | None = '0003_telemetry_aggregates'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('incidents',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('node_id', sa.String(length=128), nullable=True),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('action', sa.Text(), nullable=True),
    sa.Column('detected_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('acted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('recovered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('step_at_detect', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_incidents'))
    )
    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.create_index('ix_incidents_job_status', ['job_id', 'status'], unique=False)

    op.create_table('node_commands',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('node_id', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('args', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=True),
    sa.Column('incident_id', sa.BigInteger(), nullable=True),
    sa.Column('fault_id', sa.BigInteger(), nullable=True),
    sa.Column('result', sa.JSON(), nullable=False),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('done_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_node_commands'))
    )
    with op.batch_alter_table('node_commands', schema=None) as batch_op:
        batch_op.create_index('ix_node_commands_node_status', ['node_id', 'status'], unique=False)

    op.create_table('stack_dumps',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('incident_id', sa.BigInteger(), nullable=True),
    sa.Column('node_id', sa.String(length=128), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('stack', sa.Text(), nullable=False),
    sa.Column('collected_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_stack_dumps'))
    )
    with op.batch_alter_table('stack_dumps', schema=None) as batch_op:
        batch_op.create_index('ix_stack_dumps_job_ts', ['job_id', 'collected_at'], unique=False)

    op.create_table('checkpoints',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('path', sa.String(length=1024), nullable=False),
    sa.Column('valid', sa.Boolean(), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('files', sa.Integer(), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('manifest_sha256', sa.String(length=64), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_checkpoints_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('job_id', 'path', name='uq_checkpoints_job_path')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_job_id'), ['job_id'], unique=False)

    op.create_table('faults',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('node_id', sa.String(length=128), nullable=True),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('fired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cleared_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_faults_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_faults'))
    )
    with op.batch_alter_table('faults', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_faults_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_faults_status'), ['status'], unique=False)

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('restarts', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('stalled_restarts', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('progress_mark', sa.Integer(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('progress_mark')
        batch_op.drop_column('stalled_restarts')
        batch_op.drop_column('restarts')

    with op.batch_alter_table('faults', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_faults_status'))
        batch_op.drop_index(batch_op.f('ix_faults_job_id'))

    op.drop_table('faults')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_job_id'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('stack_dumps', schema=None) as batch_op:
        batch_op.drop_index('ix_stack_dumps_job_ts')

    op.drop_table('stack_dumps')
    with op.batch_alter_table('node_commands', schema=None) as batch_op:
        batch_op.drop_index('ix_node_commands_node_status')

    op.drop_table('node_commands')
    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.drop_index('ix_incidents_job_status')

    op.drop_table('incidents')
