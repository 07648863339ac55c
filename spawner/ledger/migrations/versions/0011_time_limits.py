"""time limits: how long an allocation (or a waiting request, once granted) may run

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("allocations", "queue_entries"):  # NULL: no time limit
        op.add_column(table, sa.Column("time_limit_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    for table in ("queue_entries", "allocations"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("time_limit_seconds")
