"""time extensions: every extension of an allocation's time limit (who, when, how much)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "time_extensions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("by", sa.String(length=255), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("before_seconds", sa.Float(), nullable=False),
        sa.Column("after_seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"], ["allocations.id"], name=op.f("fk_time_extensions_allocation_id_allocations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_time_extensions")),
    )
    op.create_index(
        op.f("ix_time_extensions_allocation_id"), "time_extensions", ["allocation_id"], unique=False
    )
    op.create_index(op.f("ix_time_extensions_user"), "time_extensions", ["user"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_time_extensions_user"), table_name="time_extensions")
    op.drop_index(op.f("ix_time_extensions_allocation_id"), table_name="time_extensions")
    op.drop_table("time_extensions")
