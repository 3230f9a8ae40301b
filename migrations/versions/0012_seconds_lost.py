"""seconds lost to slow ranks: per step (job_step_stats.lost_s) and each rank's share (rank_step_stats.lost_s)

Rows aggregated before this revision have None: nothing is known of their ranks' own times (the views count
them as no loss).

Revision ID: 0012_seconds_lost
Revises: 0011_code_packages
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012_seconds_lost'
down_revision: str | None = '0011_code_packages'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('job_step_stats') as batch:
        batch.add_column(sa.Column('lost_s', sa.Float(), nullable=True))
    with op.batch_alter_table('rank_step_stats') as batch:
        batch.add_column(sa.Column('lost_s', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('rank_step_stats') as batch:
        batch.drop_column('lost_s')
    with op.batch_alter_table('job_step_stats') as batch:
        batch.drop_column('lost_s')
