"""code_packages: who uploaded each code package and how large it is (per-user quota, garbage collection)

Packages stored before this revision have no row: they count against no quota and are collected like any
other once no recent job uses them (their file's time stands for the upload).

Revision ID: 0011_code_packages
Revises: 0010_job_owner
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011_code_packages'
down_revision: str | None = '0010_job_owner'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'code_packages',
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('owner', sa.String(length=32), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('uploaded_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('sha256', 'owner', name=op.f('pk_code_packages')),
    )
    op.create_index(op.f('ix_code_packages_owner'), 'code_packages', ['owner'])


def downgrade() -> None:
    op.drop_index(op.f('ix_code_packages_owner'), table_name='code_packages')
    op.drop_table('code_packages')
