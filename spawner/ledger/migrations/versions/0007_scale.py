"""scale: the inventory's version on the lock row; indexes for the per-decision and broker reads

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

LIVE = "state IN ('starting', 'running')"


def upgrade() -> None:
    # a plain ADD COLUMN (SQLite can): a batch copy of the table would break the foreign keys
    op.add_column(
        "ledger_lock", sa.Column("inventory", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    # an admission's reads: leases run out (lease_expires of live ones); a user's GPU-hours in the
    # window (user, ended); without them each is a scan of every allocation ever made
    # the live allocations are few among all ever made: a partial index finds them whatever
    # the planner's statistics say about ``state``
    op.create_index(
        "ix_allocations_live",
        "allocations",
        ["lease_expires"],
        sqlite_where=sa.text(LIVE),
        postgresql_where=sa.text(LIVE),
    )
    op.create_index("ix_allocations_user_ended", "allocations", ["user", "ended"])
    op.create_index("ix_allocations_ended", "allocations", ["ended"])
    # borrowed GPU-hours (metrics, usage): the few allocations that borrowed, not all
    op.create_index(
        "ix_allocations_borrowed",
        "allocations",
        ["user"],
        sqlite_where=sa.text("borrowed > 0"),
        postgresql_where=sa.text("borrowed > 0"),
    )


def downgrade() -> None:
    op.drop_index("ix_allocations_borrowed", table_name="allocations")
    op.drop_index("ix_allocations_ended", table_name="allocations")
    op.drop_index("ix_allocations_user_ended", table_name="allocations")
    op.drop_index("ix_allocations_live", table_name="allocations")
    with op.batch_alter_table("ledger_lock") as batch:
        batch.drop_column("inventory")
