"""Alembic environment for the gpuhub ledger (configured from code, see spawner/ledger/db.py)."""

from alembic import context
from sqlalchemy import inspect

from spawner.ledger.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


# any number: the key of the PostgreSQL advisory lock that one upgrade holds at a time
UPGRADE_LOCK = 0x67707568


def migrate(connection) -> None:
    """Run the migrations in the connection's transaction, and make the ``ledger_lock`` row
    that every writer locks with them. On PostgreSQL, upgrades of one database wait for each
    other (two processes opening a new ledger at once): the second then finds the schema at
    head and the row made (SQLite's BEGIN IMMEDIATE does the same there)."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({UPGRADE_LOCK})")
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    context.run_migrations()
    if not inspect(connection).has_table("ledger_lock"):
        return  # downgraded to nothing
    if not connection.exec_driver_sql("SELECT 1 FROM ledger_lock WHERE id = 1").first():
        connection.exec_driver_sql("INSERT INTO ledger_lock (id, generation) VALUES (1, 0)")


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        migrate(connection)
        return
    from spawner.ledger.db import make_engine

    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        migrate(conn)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
