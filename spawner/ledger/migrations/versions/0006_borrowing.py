"""borrowing: allocations' borrowed GPUs, preemptions

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN (SQLite can): a batch copy of the table would break the foreign keys
    op.add_column(
        "allocations", sa.Column("borrowed", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.create_table(
        "preemptions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("borrowed", sa.Integer(), nullable=False),
        sa.Column("for_user", sa.String(length=255), nullable=False),
        sa.Column("entry_id", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("created", sa.DateTime(), nullable=False),
        sa.Column("due", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"], ["allocations.id"], name=op.f("fk_preemptions_allocation_id_allocations")
        ),
        sa.ForeignKeyConstraint(
            ["entry_id"], ["queue_entries.id"], name=op.f("fk_preemptions_entry_id_queue_entries")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_preemptions")),
        sa.UniqueConstraint("allocation_id", name=op.f("uq_preemptions_allocation_id")),
    )
    op.create_index(op.f("ix_preemptions_user"), "preemptions", ["user"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_preemptions_user"), table_name="preemptions")
    op.drop_table("preemptions")
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("borrowed")
