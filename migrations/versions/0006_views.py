"""derived views: job-wide step figures (p90, throughput, validation loss, attempts) and the node host history

job_step_stats gains the figures the overview and goodput views read (rows written before keep
NULL there, ``reporting`` NULL marks them, and the views derive what they need from rank_step_stats)
and an index on (job_id, ts) to place events on the step axis; node_host_samples is the bounded
per-node history of host metrics (see controller/host_history.py). step_metrics gets an index on
(job_id, step): reading one step's raw rows (the aggregator's load_step, the views' forming steps)
otherwise scans the (job_id, rank, step) index over every raw row of the job (measured: 23 ms per
query at 1,024 ranks x 200 steps of raw rows on SQLite, growing with the retention window).

Revision ID: 0006_views
Revises: 0005_agent_token_node
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006_views'
down_revision: str | None = '0005_agent_token_node'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('job_step_stats', schema=None) as batch_op:
        batch_op.add_column(sa.Column('step_time_p90_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('val_loss_mean', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('tokens_per_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('reporting', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('start_ts', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('reruns', sa.JSON(), nullable=True))
        batch_op.create_index('ix_job_step_stats_job_ts', ['job_id', 'ts'], unique=False)

    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.create_index('ix_step_metrics_job_step', ['job_id', 'step'], unique=False)

    op.create_table('node_host_samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('node_id', sa.String(length=128), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('cpu_percent', sa.Float(), nullable=True),
    sa.Column('memory_percent', sa.Float(), nullable=True),
    sa.Column('disk_percent', sa.Float(), nullable=True),
    sa.Column('load_1m', sa.Float(), nullable=True),
    sa.Column('rx_bytes_per_s', sa.Float(), nullable=True),
    sa.Column('tx_bytes_per_s', sa.Float(), nullable=True),
    sa.Column('nic_errors_per_s', sa.Float(), nullable=True),
    sa.Column('nic_drops_per_s', sa.Float(), nullable=True),
    sa.Column('gpu_util_percent', sa.Float(), nullable=True),
    sa.Column('gpu_memory_percent', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_node_host_samples'))
    )
    with op.batch_alter_table('node_host_samples', schema=None) as batch_op:
        batch_op.create_index('ix_node_host_samples_node_ts', ['node_id', 'ts'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('node_host_samples', schema=None) as batch_op:
        batch_op.drop_index('ix_node_host_samples_node_ts')
    op.drop_table('node_host_samples')

    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_step_metrics_job_step')

    with op.batch_alter_table('job_step_stats', schema=None) as batch_op:
        batch_op.drop_index('ix_job_step_stats_job_ts')
        batch_op.drop_column('reruns')
        batch_op.drop_column('start_ts')
        batch_op.drop_column('reporting')
        batch_op.drop_column('tokens_per_s')
        batch_op.drop_column('val_loss_mean')
        batch_op.drop_column('step_time_p90_s')
