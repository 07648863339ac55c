"""queue: requests waiting for GPUs; allocations' idle deadlines

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "queue_entries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("groups", sa.String(length=4000), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("max_nodes", sa.Integer(), nullable=True),
        sa.Column("gpus_per_node", sa.Integer(), nullable=True),
        sa.Column("on_nodes", sa.String(length=4000), nullable=True),
        sa.Column("lease_seconds", sa.Float(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created", sa.DateTime(), nullable=False),
        sa.Column("seen", sa.DateTime(), nullable=False),
        sa.Column("front", sa.DateTime(), nullable=True),
        sa.Column("ended", sa.DateTime(), nullable=True),
        sa.Column("end_reason", sa.String(length=255), nullable=True),
        sa.Column("allocation_id", sa.Integer(), nullable=True),
        sa.CheckConstraint("state IN ('waiting', 'granted', 'left')", name=op.f("ck_queue_entries_state")),
        sa.CheckConstraint("purpose IN ('server', 'distributed')", name=op.f("ck_queue_entries_purpose")),
        sa.CheckConstraint("gpu_count >= 1", name=op.f("ck_queue_entries_gpu_count")),
        sa.ForeignKeyConstraint(
            ["allocation_id"], ["allocations.id"], name=op.f("fk_queue_entries_allocation_id_allocations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_queue_entries")),
    )
    op.create_index("ix_queue_entries_state_user", "queue_entries", ["state", "user"], unique=False)
    op.add_column("allocations", sa.Column("idle_deadline", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("idle_deadline")
    op.drop_index("ix_queue_entries_state_user", table_name="queue_entries")
    op.drop_table("queue_entries")
