"""first schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created", sa.DateTime(), nullable=False),
        sa.Column("started", sa.DateTime(), nullable=True),
        sa.Column("ended", sa.DateTime(), nullable=True),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("backend_job_id", sa.String(length=64), nullable=True),
        sa.Column("end_reason", sa.String(length=255), nullable=True),
        sa.CheckConstraint("purpose IN ('server', 'distributed')", name=op.f("ck_allocations_purpose")),
        sa.CheckConstraint("state IN ('starting', 'running', 'released')", name=op.f("ck_allocations_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocations")),
    )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.create_index("ix_allocations_user_state", ["user", "state"], unique=False)

    op.create_table(
        "ledger_lock",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_lock")),
    )
    op.create_table(
        "limits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.Column("gpu_hours", sa.Float(), nullable=True),
        sa.Column("window_hours", sa.Float(), nullable=True),
        sa.Column("updated", sa.DateTime(), nullable=False),
        sa.CheckConstraint("scope IN ('default', 'group', 'user')", name=op.f("ck_limits_scope")),
        sa.CheckConstraint("max_gpus IS NULL OR max_gpus >= 0", name=op.f("ck_limits_max_gpus")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_limits")),
        sa.UniqueConstraint("scope", "name", name="uq_limits_scope_name"),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=True),
        sa.Column("uuid", sa.String(length=255), nullable=True),
        sa.Column("present", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_gpus_node_id_nodes")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
        sa.UniqueConstraint("node_id", "index", name="uq_gpus_node_index"),
    )
    op.create_table(
        "allocation_gpus",
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("held", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"], ["allocations.id"], name=op.f("fk_allocation_gpus_allocation_id_allocations")
        ),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"], name=op.f("fk_allocation_gpus_gpu_id_gpus")),
        sa.PrimaryKeyConstraint("allocation_id", "gpu_id", name=op.f("pk_allocation_gpus")),
    )
    with op.batch_alter_table("allocation_gpus", schema=None) as batch_op:
        batch_op.create_index(
            "uq_allocation_gpus_held_gpu",
            ["gpu_id"],
            unique=True,
            sqlite_where=sa.text("held = 1"),
            postgresql_where=sa.text("held"),
        )


def downgrade() -> None:
    with op.batch_alter_table("allocation_gpus", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_allocation_gpus_held_gpu", sqlite_where=sa.text("held = 1"), postgresql_where=sa.text("held")
        )

    op.drop_table("allocation_gpus")
    op.drop_table("gpus")
    op.drop_table("nodes")
    op.drop_table("limits")
    op.drop_table("ledger_lock")
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_index("ix_allocations_user_state")

    op.drop_table("allocations")
