"""bursts that belong to a server: released when it stops

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMNs (SQLite can): a batch copy of the tables would break the foreign keys
    for table in ("allocations", "queue_entries"):
        op.add_column(table, sa.Column("of_server", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    for table in ("queue_entries", "allocations"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("of_server")
