"""rank_progress: where each rank last stood in its collectives while its steps stalled

One row per (job, rank), the newest :class:`vigil.contract.schemas.ProgressSample` of the rank (its process
groups' last entered and completed collectives, what it is inside now): a hang's diagnosis lines them up
across ranks to name the rank that never entered the collective the others wait in.

Revision ID: 0009_rank_progress
Revises: 0008_raw_samples_no_fk
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009_rank_progress'
down_revision: str | None = '0008_raw_samples_no_fk'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'rank_progress',
        sa.Column('job_id', sa.String(length=64), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('ts', sa.Float(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('idle_s', sa.Float(), nullable=False),
        sa.Column('state', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('job_id', 'rank', name=op.f('pk_rank_progress')),
    )


def downgrade() -> None:
    op.drop_table('rank_progress')
