"""energy: what each allocation used per UTC day, from gpuhub's own readings

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "energy_use",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("joules", sa.Float(), nullable=False),
        sa.Column("idle_joules", sa.Float(), nullable=False),
        sa.Column("measured_seconds", sa.Float(), nullable=False),
        sa.Column("unknown_seconds", sa.Float(), nullable=False),
        sa.Column("idle_seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"], ["allocations.id"], name=op.f("fk_energy_use_allocation_id_allocations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_energy_use")),
        sa.UniqueConstraint("allocation_id", "day", name="uq_energy_use_allocation_day"),
    )
    sums = ["joules", "idle_joules", "measured_seconds", "unknown_seconds", "idle_seconds"]
    op.create_index("ix_energy_use_day_user", "energy_use", ["day", "user", *sums], unique=False)
    op.create_index("ix_energy_use_user_day", "energy_use", ["user", "day", *sums], unique=False)


def downgrade() -> None:
    op.drop_index("ix_energy_use_user_day", table_name="energy_use")
    op.drop_index("ix_energy_use_day_user", table_name="energy_use")
    op.drop_table("energy_use")
