"""``gpuhub``: the admin's command line over the GPU ledger.

    gpuhub limits show
    gpuhub limits set --default 1 | --group students 2 | --user alice 4 [--gpu-hours H] [--window-hours W]
    gpuhub limits unset --user alice
    gpuhub gpus
    gpuhub usage [--since 2026-11-01 | --since 7d] [--user alice]
    gpuhub db upgrade
    gpuhub kernel install [--user | --prefix P]

It reads the hub's ``jupyterhub_config.py`` (``--config``; by default the one in the
current directory, if any) for ``c.GpuHub.*``; ``--db-url`` (or ``$GPUHUB_DB_URL``)
overrides the ledger URL. It never changes the inventory: the hub and its broker keep it.
Run it as the hub's account: the ledger is readable only by the hub.

Each command is one module of this package: its ``register`` adds the command's parsers and
sets the function that runs it (:func:`.parsers.command`); :mod:`.output` and :mod:`.context` are
what they share.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# only what parsing the command line needs is imported here: the ledger's modules (SQLAlchemy,
# alembic: most of a second) come in the commands that open a ledger, so --help, a refused
# option or a missing config file answer at once
from spawner.cli.output import UsageError, first_line
from spawner.cli.parsers import EXIT_CODES

# the modules of spawner.cli, one per command, in the order ``gpuhub --help`` lists them
COMMANDS = ("limits", "gpus", "usage", "queue", "slurm", "sampler", "db", "kernel")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpuhub",
        description="Admin commands for the gpuhub GPU ledger.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", "-f", help="jupyterhub_config.py to read c.GpuHub from")
    p.add_argument("--db-url", help="ledger database URL (overrides c.GpuHub.db_url)")
    p.add_argument("--json", action="store_true", help="print JSON (gpus, usage, limits show)")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"spawner.cli.{name}").register(sub)
    return p


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    return args.func(args, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"gpuhub: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # imported only now: whatever raised one of these had imported its module already
        from sqlalchemy.exc import SQLAlchemyError

        from spawner.ledger.db import SchemaError
        from spawner.slurm import SlurmError
        from spawner.spawners.inventory import InventoryError

        if isinstance(e, (SchemaError, InventoryError, SlurmError)):
            print(f"gpuhub: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, SQLAlchemyError):  # the database went away or refused mid-command
            print(f"gpuhub: error: the ledger database failed: {first_line(e)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
