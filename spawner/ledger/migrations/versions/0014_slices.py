"""slices: a GPU held in parts (c.GpuHub.gpu_slices), each part by one holder at most

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def _part_columns(table: str) -> None:
    # plain ADD COLUMNs (SQLite can): a batch copy of the table would break the foreign keys
    op.add_column(table, sa.Column("part", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.add_column(table, sa.Column("parts", sa.Integer(), server_default=sa.text("0"), nullable=False))


def upgrade() -> None:
    _part_columns("allocation_gpus")
    _part_columns("gpu_moves")
    op.add_column("allocations", sa.Column("slice_parts", sa.Integer(), nullable=True))
    op.add_column("queue_entries", sa.Column("slice_parts", sa.Integer(), nullable=True))
    # a GPU held whole by one allocation at most; each part of it by one at most
    op.drop_index("uq_allocation_gpus_held_gpu", table_name="allocation_gpus")
    op.create_index(
        "uq_allocation_gpus_held_gpu",
        "allocation_gpus",
        ["gpu_id"],
        unique=True,
        sqlite_where=sa.text("held = 1 AND part = 0"),
        postgresql_where=sa.text("held AND part = 0"),
    )
    op.create_index(
        "uq_allocation_gpus_held_part",
        "allocation_gpus",
        ["gpu_id", "part"],
        unique=True,
        sqlite_where=sa.text("held = 1 AND part > 0"),
        postgresql_where=sa.text("held AND part > 0"),
    )
    if op.get_context().dialect.name == "postgresql":  # SQLite adds no constraint to a table
        op.create_check_constraint(
            "ck_allocation_gpus_part", "allocation_gpus", "part >= 0 AND parts >= 0 AND part <= parts"
        )


def downgrade() -> None:
    op.execute("DELETE FROM allocation_gpus WHERE part > 0")  # slices cannot be written without parts
    if op.get_context().dialect.name == "postgresql":
        op.drop_constraint("ck_allocation_gpus_part", "allocation_gpus", type_="check")
    op.drop_index("uq_allocation_gpus_held_part", table_name="allocation_gpus")
    op.drop_index("uq_allocation_gpus_held_gpu", table_name="allocation_gpus")
    op.create_index(
        "uq_allocation_gpus_held_gpu",
        "allocation_gpus",
        ["gpu_id"],
        unique=True,
        sqlite_where=sa.text("held = 1"),
        postgresql_where=sa.text("held"),
    )
    for table in ("queue_entries", "allocations"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("slice_parts")
    for table in ("gpu_moves", "allocation_gpus"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("parts")
            batch.drop_column("part")
