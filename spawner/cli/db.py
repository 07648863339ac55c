"""``gpuhub db upgrade``: migrate the ledger to this gpuhub's schema."""

from __future__ import annotations

from spawner.cli.context import load_settings
from spawner.cli.output import UsageError, first_line
from spawner.cli.parsers import actions, command


def register(sub) -> None:
    command(
        actions(sub, "db", "ledger database"),
        "upgrade",
        run,
        help="migrate the ledger to this gpuhub's schema",
    )


def run(args, out) -> int:
    settings = load_settings(args)
    from sqlalchemy.exc import SQLAlchemyError

    from spawner.ledger import db

    try:
        db.upgrade(settings.db_url)
    except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
        raise UsageError(
            f"cannot upgrade the ledger at {db.safe_url(settings.db_url)}: {first_line(e)}"
        ) from None
    print(f"ledger {db.safe_url(settings.db_url)} is at schema {db.head_revision()}", file=out)
    return 0
