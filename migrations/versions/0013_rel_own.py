"""each rank's own time over the step's median (rank_step_stats.rel_own_s): the history a rank's offset in the
seconds-lost model is read from; and each step sample's run-queue wait (step_metrics.cpu_wait_s), which
tells a rank slowed by its host's other load from a rank slow by itself

Rows from before this revision have None: their steps give no history (a rank's offset then rests on the
steps aggregated since) and no run-queue wait.

Revision ID: 0013_rel_own
Revises: 0012_seconds_lost
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013_rel_own'
down_revision: str | None = '0012_seconds_lost'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('rank_step_stats') as batch:
        batch.add_column(sa.Column('rel_own_s', sa.Float(), nullable=True))
    with op.batch_alter_table('step_metrics') as batch:
        batch.add_column(sa.Column('cpu_wait_s', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('step_metrics') as batch:
        batch.drop_column('cpu_wait_s')
    with op.batch_alter_table('rank_step_stats') as batch:
        batch.drop_column('rel_own_s')
