"""reclaims: allocations taken back because their GPUs sat idle

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reclaims",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("idle_seconds", sa.Float(), nullable=False),
        sa.Column("gpu_hours", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("created", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"], ["allocations.id"], name=op.f("fk_reclaims_allocation_id_allocations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reclaims")),
        sa.UniqueConstraint("allocation_id", name=op.f("uq_reclaims_allocation_id")),
    )
    op.create_index(op.f("ix_reclaims_user"), "reclaims", ["user"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_reclaims_user"), table_name="reclaims")
    op.drop_table("reclaims")
