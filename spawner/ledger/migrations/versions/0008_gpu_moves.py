"""gpu moves: the GPUs each write took or gave back, for the other processes' kept free GPUs

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpu_moves",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("held", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_moves")),
    )
    op.create_index(op.f("ix_gpu_moves_generation"), "gpu_moves", ["generation"], unique=False)
    # every move of a generation after this one is in gpu_moves (none before this revision)
    op.add_column(
        "ledger_lock", sa.Column("moves_after", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.execute("UPDATE ledger_lock SET moves_after = generation")


def downgrade() -> None:
    with op.batch_alter_table("ledger_lock") as batch:
        batch.drop_column("moves_after")
    op.drop_index(op.f("ix_gpu_moves_generation"), table_name="gpu_moves")
    op.drop_table("gpu_moves")
