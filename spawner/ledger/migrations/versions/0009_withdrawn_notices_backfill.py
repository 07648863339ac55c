"""preemption notices that are withdrawn; allocations started ahead of the queue (backfill)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMNs (SQLite can): a batch copy of the tables would break the foreign keys
    op.add_column("preemptions", sa.Column("withdrawn", sa.DateTime(), nullable=True))
    op.add_column("preemptions", sa.Column("withdrawn_reason", sa.String(length=255), nullable=True))
    op.add_column("allocations", sa.Column("backfill_for", sa.String(length=4000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("backfill_for")
    with op.batch_alter_table("preemptions") as batch:
        batch.drop_column("withdrawn_reason")
        batch.drop_column("withdrawn")
