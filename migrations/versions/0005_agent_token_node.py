"""agent tokens scoped to one node

Revision ID: 0005_agent_token_node
Revises: 0004_recovery
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005_agent_token_node'
down_revision: str | None = '0004_recovery'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.add_column(sa.Column('node_id', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.drop_column('node_id')
