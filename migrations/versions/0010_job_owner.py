"""jobs.created_by: the token that submitted a job (a ``user`` token acts only on its own jobs)

Jobs stored before this revision have no owner recorded: only an admin acts on them.

Revision ID: 0010_job_owner
Revises: 0009_rank_progress
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010_job_owner'
down_revision: str | None = '0009_rank_progress'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('created_by', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('created_by')
