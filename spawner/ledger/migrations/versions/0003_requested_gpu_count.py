"""requested GPU count (a Slurm job's GPUs are known only once it runs), known users

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_count", sa.Integer(), nullable=True))
    op.create_table(
        "known_users",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("groups", sa.String(length=4000), nullable=False),
        sa.Column("updated", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_known_users")),
    )


def downgrade() -> None:
    op.drop_table("known_users")
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_column("gpu_count")
